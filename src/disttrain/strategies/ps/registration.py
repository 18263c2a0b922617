"""A worker's registration with one shard: its identity, its rank, the shard's layout,
and shared-memory segments when (and only when) it connects from this host."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from disttrain.core.addresses import peer_is_local
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps import wire

if TYPE_CHECKING:
    from disttrain.strategies.ps.shard import ShardState

logger = logging.getLogger(__name__)


def admit(state: ShardState, request: pb.RegisterRequest, peer: str) -> pb.WorkerAssignment:
    """Register `request`'s worker, which connects from gRPC peer `peer`.

    Raises:
        InvalidIdentity, IdentityTaken, UnknownGeneration, PushRefused: see `ShardState.register`.
    """
    rank, version, session = state.register(request.worker_id, request.requested_rank, request.key,
                                             request.generation)
    plan, rules = state.plan, state.rules
    logger.info("worker %s (%s pid %d, from %s) registered as rank %d", request.worker_id,
                request.hostname[:64], request.pid, peer, rank)
    assignment = pb.WorkerAssignment(
        rank=rank, world_size=rules.world_size, worker_id=request.worker_id, shard=plan.shard,
        num_shards=plan.num_shards, aggregation_mode=rules.mode, staleness=rules.staleness_bound,
        version=version, layout=wire.slice_specs(plan), dtype=plan.dtype,
        incarnation=state.incarnation, session=session)
    # Segments only for a peer on this host: a remote worker could never map them, and
    # would leave them behind in /dev/shm until this shard stops.
    if request.shared_memory and peer_is_local(peer):
        pair = state.segments.offer(request.worker_id)
        if pair is not None:
            assignment.shared_memory.gradient_path = str(pair.gradient.path)
            assignment.shared_memory.parameter_path = str(pair.parameter.path)
            assignment.shared_memory.nonce = pair.gradient.nonce
    else:
        state.segments.drop(request.worker_id)
    return assignment
