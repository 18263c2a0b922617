"""The parameter-server strategy over gRPC: sharded servers, workers, sync/SSP/async rules.

codec (tensors <-> wire bytes), wire (the service's methods), sharding (who owns which
slices), aggregation and rules_state (pure rules, what they save and undo), barriers
(pure), combine (the weighted sum), validation, limits (what one client may cost a
server), identity (worker keys and sessions), registration, refusals (status codes),
update (the optimizer step, refused when non-finite), shard (one shard's state), server
(the servicer, the `ps-server` role), client (retries, fan-out), exchange (a worker's
per-mode step), worker (the `ps-worker` role), finalize (end of run), launcher (the
whole run on one machine: `STRATEGY`).
"""

from disttrain.strategies.ps.launcher import STRATEGY

__all__ = ["STRATEGY"]
