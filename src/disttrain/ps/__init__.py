"""The parameter-server strategy over gRPC: sharded servers, workers, sync/SSP/async rules.

codec (tensors <-> wire bytes), wire (the service's methods), sharding (who owns which
slices), aggregation (pure rules), validation, shard (one shard's state), server (the
servicer), client (retries, fan-out), exchange (a worker's per-mode step), worker,
finalize (end of run), cluster (the local launcher command).
"""
