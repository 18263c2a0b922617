#!/usr/bin/env bash
# Prepare the compose cluster's run folder (docker-compose.yml): checkpoints/ and logs/
# (the shared volumes) and config/ (mounted read-only, for a config of your own), owned by
# the containers' user, and the run's credentials in secrets/ (mode 700, files mode 600),
# one env file per node, each holding only what that node needs (README, "An identity
# per node"):
#
#   secrets/disttrain.env   the run's secret: the coordinator and the shard server, which
#                           check every caller's token (the operator's too, e.g. status)
#   secrets/worker0.env     worker0's own node token: it calls in its own name only
#   secrets/worker1.env     worker1's
#
# The secret is made once and kept (a cluster started again with --resume goes on with
# it); the node tokens are made from it by `disttrain token node`, run in the image, so
# the host needs no disttrain. `make cluster-up` calls it.
#
#   docker/cluster_env.sh ENGINE IMAGE UID [RUN_DIR]     # RUN_DIR: $DISTTRAIN_RUN_DIR or runs/cluster
set -euo pipefail

engine=${1:?usage: docker/cluster_env.sh ENGINE IMAGE UID [RUN_DIR]}
image=${2:?usage: docker/cluster_env.sh ENGINE IMAGE UID [RUN_DIR]}
uid=${3:?usage: docker/cluster_env.sh ENGINE IMAGE UID [RUN_DIR]}
cd "$(dirname "$0")/.."
run=${4:-${DISTTRAIN_RUN_DIR:-runs/cluster}}
workers=(worker0 worker1)  # the --worker-id of docker-compose.yml's workers

mkdir -p "$run/checkpoints" "$run/logs" "$run/config"
if [ "$(id -u)" = 0 ] && [ "$uid" != 0 ]; then
    chown "$uid" "$run/checkpoints" "$run/logs"
fi
umask 077
mkdir -p "$run/secrets"
chmod 700 "$run/secrets"

disttrain() {  # `disttrain ARGS` in the image, DISTTRAIN_TOKEN passed from this environment
    "$engine" run --rm --network none -e DISTTRAIN_TOKEN "$image" "$@"
}

if [ ! -s "$run/secrets/disttrain.env" ]; then
    secret=$(DISTTRAIN_TOKEN= disttrain token new)
    echo "DISTTRAIN_TOKEN=$secret" > "$run/secrets/disttrain.env"
fi
secret=$(sed -n 's/^DISTTRAIN_TOKEN=//p' "$run/secrets/disttrain.env")
for worker in "${workers[@]}"; do
    token=$(DISTTRAIN_TOKEN=$secret disttrain token node "$worker")
    echo "DISTTRAIN_TOKEN=$token" > "$run/secrets/$worker.env"
done
echo "$run: credentials in $run/secrets/ (the secret: coordinator, parameter_server;" \
     "a node token each: ${workers[*]}), checkpoints and logs owned by uid $uid"
