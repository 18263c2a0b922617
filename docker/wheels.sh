#!/usr/bin/env bash
# Fetch, on this machine, every wheel the image installs, into docker/wheels/, so that the
# build itself needs no network: pip here already knows this machine's indexes, proxies,
# certificates and caches, which a build container does not. `make image` calls it; the
# Dockerfile installs from docker/wheels/ when it holds wheels, from the indexes otherwise.
#
#   docker/wheels.sh ENGINE BASE_IMAGE
#
# The wheels are those of requirements.lock's versions for the base image's Python, C
# library and machine (asked of the image itself): torch from pip's find-links when a
# wheel of the pinned version is there (no download), else from TORCH_INDEX (PyTorch's CPU
# index unless told otherwise); the rest from pip's configured index. Wheels from an
# earlier call are reused without a download and those no longer needed are removed; when
# nothing they depend on changed (docker/wheels/.key), nothing is asked of any index.
set -euo pipefail

engine=${1:?usage: docker/wheels.sh ENGINE BASE_IMAGE}
base=${2:?usage: docker/wheels.sh ENGINE BASE_IMAGE}
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CPU_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX=${TORCH_INDEX:-$CPU_INDEX}
LOCK=requirements.lock
WHEELS=docker/wheels
mkdir -p "$WHEELS"
torch_version=$(sed -n 's/^torch==//p' "$LOCK")

# What the wheels depend on: the lock, the project's dependencies, the base image and the
# torch index. The same as at the last fetch: nothing to do, and no network needed.
key=$( { cat "$LOCK"; "$PYTHON" -c '
import tomllib
print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")'
         "$engine" image inspect --format '{{.Id}}' "$base"; echo "$TORCH_INDEX"; } | sha256sum | cut -d' ' -f1)
if [ -f "$WHEELS/.key" ] && [ "$(cat "$WHEELS/.key")" = "$key" ] && ls "$WHEELS"/torch-*.whl >/dev/null 2>&1; then
    echo "docker/wheels: up to date ($(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1))"
    exit 0
fi

# "3.11 2.36 x86_64": the base's Python, glibc and machine.
read -r py_version glibc machine < <("$engine" run --rm "$base" python3 -c \
    'import os, platform, sys; print("%d.%d" % sys.version_info[:2], os.confstr("CS_GNU_LIBC_VERSION").split()[1], platform.machine())')
glibc_minor=${glibc#2.}
platforms=()
for ((minor = glibc_minor; minor >= 17; minor--)); do
    platforms+=(--platform "manylinux_2_${minor}_${machine}")
done
platforms+=(--platform "manylinux2014_${machine}" --platform "manylinux1_${machine}")
target=(--only-binary=:all: --python-version "$py_version" --implementation cp "${platforms[@]}")

fresh=$(mktemp -d "$WHEELS.XXXXXX")
trap 'rm -rf "$fresh"' EXIT
pip_download() { "$PYTHON" -m pip download --quiet --disable-pip-version-check "${target[@]}" \
                     --find-links "$WHEELS" -d "$fresh" "$@"; }

# torch alone first, so that the build of TORCH_INDEX is chosen (a plain index's torch is
# the CUDA one): for the CPU index, a wheel of the pinned version at hand in pip's
# find-links does; for another, only that index is asked (the wheels here may be CPU ones).
if [ "$TORCH_INDEX" = "$CPU_INDEX" ] && pip_download --no-deps --no-index "torch==$torch_version" 2>/dev/null; then
    :
else
    "$PYTHON" -m pip download --quiet --disable-pip-version-check "${target[@]}" -d "$fresh" --no-deps \
        --index-url "$TORCH_INDEX" "torch==$torch_version"
fi
# The project's dependencies (read from pyproject.toml) at the lock's versions, torch's
# included, with this torch wheel; and setuptools, which builds the project in the image.
mapfile -t requirements < <("$PYTHON" -c '
import tomllib
print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' | grep -v '^torch\b')
pip_download -c "$LOCK" "$fresh"/torch-*.whl "${requirements[@]}" "setuptools>=77"

rm -f "$WHEELS"/*.whl "$WHEELS/.key"
mv "$fresh"/*.whl "$WHEELS"/
echo "$key" > "$WHEELS/.key"
echo "docker/wheels: $(ls "$WHEELS"/*.whl | wc -l) wheels for Python $py_version, glibc $glibc," \
     "$machine ($(du -sh "$WHEELS" | cut -f1)), $(basename "$WHEELS"/torch-*.whl)"
