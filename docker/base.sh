#!/usr/bin/env bash
# Make the image's base without a registry: a minimal Debian root filesystem with
# python3 (and its venv module), made by debootstrap from Debian's package mirror and
# imported into the engine as a local image. `make image` calls it; it does nothing when
# the image already exists, so only the first build pays for it (about a minute).
#
#   docker/base.sh ENGINE IMAGE [SUITE] [MIRROR]
#   docker/base.sh podman localhost/disttrain-base:bookworm
#
# Needs root (debootstrap makes device nodes and chroots) and debootstrap
# (apt-get install debootstrap). Without either, build on a registry's Python instead:
# make image BASE_IMAGE=python:3.11-slim.
set -euo pipefail

engine=${1:?usage: docker/base.sh ENGINE IMAGE [SUITE] [MIRROR]}
image=${2:?usage: docker/base.sh ENGINE IMAGE [SUITE] [MIRROR]}
suite=${3:-bookworm}
mirror=${4:-http://deb.debian.org/debian}

if "$engine" image inspect "$image" >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "docker/base.sh: debootstrap needs root to make $image; run make image as root, or build on" \
         "a registry's Python: make image BASE_IMAGE=python:3.11-slim" >&2
    exit 2
fi
if ! command -v debootstrap >/dev/null; then
    echo "docker/base.sh: debootstrap is not installed; apt-get install debootstrap, or build on a" \
         "registry's Python: make image BASE_IMAGE=python:3.11-slim" >&2
    exit 2
fi

rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/disttrain-rootfs.XXXXXX")
trap 'rm -rf "$rootfs"' EXIT
echo "debootstrap $suite from $mirror into $rootfs"
# minbase: essential packages and apt only; python3-venv brings ensurepip, so the
# image's own environment gets pip without Debian's python3-pip and its recommends.
debootstrap --variant=minbase --include=python3,python3-venv "$suite" "$rootfs" "$mirror" \
    > "$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"
# What a container never reads: the package cache and lists (apt-get update brings the
# lists back in a derived image), documentation and translations.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
       "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
       "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log
tar --numeric-owner -C "$rootfs" -c . \
    | "$engine" import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' - "$image" >/dev/null
echo "$image: Debian $suite, $("$engine" run --rm "$image" python3 --version)"
