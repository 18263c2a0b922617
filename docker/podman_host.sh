#!/usr/bin/env bash
# Set up a Debian host to build and run disttrain's containers with Podman, as root:
# podman, podman-compose, runc and debootstrap from Debian's packages, and the engine
# settings some kernels need (a drop-in of /etc/containers/containers.conf.d/):
#
# - runc as the OCI runtime: crun (Podman's default) refuses to start any container where
#   cgroup v1 controllers are mounted beside a cgroup v2 hierarchy that also holds some
#   ("cgroups in hybrid mode not supported"); runc runs there.
# - default ulimits within this host's hard limits: Podman asks for more open files and
#   processes than the host allows by default, and the kernel refuses the container
#   ("setrlimit RLIMIT_NOFILE: operation not permitted").
#
#   docker/podman_host.sh        # idempotent; prints the drop-in it wrote
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
    echo "docker/podman_host.sh: run as root (it installs packages and writes /etc/containers)" >&2
    exit 2
fi
missing=()
for command in podman podman-compose runc debootstrap; do
    command -v "$command" >/dev/null || missing+=("$command")
done
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        podman podman-compose runc debootstrap containernetworking-plugins uidmap slirp4netns
fi

limit() {  # the host's hard limit of $1 (ulimit's flag), at most 4096
    local hard
    hard=$(ulimit -H "$1")
    if [ "$hard" = unlimited ] || [ "$hard" -gt 4096 ]; then echo 4096; else echo "$hard"; fi
}
nofile=$(limit -n)
nproc=$(limit -u)
conf=/etc/containers/containers.conf.d/50-disttrain-host.conf
mkdir -p "$(dirname "$conf")"
cat > "$conf" <<EOF
# Written by disttrain's docker/podman_host.sh: see that script for why.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
EOF
echo "$conf:"
cat "$conf"
podman --version
podman-compose --version 2>/dev/null | grep -i "podman-compose" || true
