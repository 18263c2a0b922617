#!/usr/bin/env bash
# Fetch the wheels that tools/gpu_check.sh installs on a GPU machine without a network.
#
# The GPU machine's image runs Python 3.12 on x86_64 and already holds torch, numpy, pyyaml,
# tqdm, matplotlib, pillow, fsspec, pytest (with pytest-timeout and pytest-xdist) and
# hypothesis. What disttrain needs beyond that (its gRPC stack at the versions the committed
# stubs are tested with, tenacity, shtab, cryptography, a tensorboard that reads that
# protobuf, and what these need in turn) is fetched here, at requirements.lock's exact
# versions, into .whl/ (git-ignored; carried to the GPU machine beside the working tree).
#
#   tools/gpu_wheels.sh            # or: make gpu-wheels
#   WHEEL_DIR=elsewhere tools/gpu_wheels.sh
set -euo pipefail

cd "$(dirname "$0")/.."
LOCK=requirements.lock
WHEEL_DIR=${WHEEL_DIR:-.whl}
PYTHON=${PYTHON:-python3}
# The packages the GPU image lacks or may hold at a version too old for the committed stubs
# (grpcio, protobuf), tensorboard at the version that reads protobuf 7's messages, and the
# packages those need in turn (cffi and pycparser for cryptography, typing_extensions for
# grpcio; the image has tensorboard's others). Each is fetched without its dependencies:
# keep this list closed under them.
PACKAGES=(grpcio grpcio-health-checking protobuf tenacity shtab cryptography cffi pycparser typing_extensions
          tensorboard)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux1_x86_64)

pinned() {  # the lock's version of $1 (names compared as pip does: case and -/_ folded)
    local want
    want=$(echo "$1" | tr 'A-Z_' 'a-z-')
    awk -F'==' -v want="$want" '{ name = tolower($1); gsub("_", "-", name) } name == want { print $2 }' "$LOCK"
}

rm -rf "$WHEEL_DIR"  # one version of each package: two would stop the install there
mkdir -p "$WHEEL_DIR"
for package in "${PACKAGES[@]}"; do
    version=$(pinned "$package")
    if [ -z "$version" ]; then
        echo "gpu_wheels: $package has no pin in $LOCK; run make lock, or drop it from PACKAGES" >&2
        exit 2
    fi
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp ${PLATFORMS[@]/#/--platform } -d "$WHEEL_DIR" "$package==$version"
done
count=$(ls "$WHEEL_DIR"/*.whl | wc -l)
echo "gpu_wheels: $count wheels, $(du -sh "$WHEEL_DIR" | cut -f1) in $WHEEL_DIR"
