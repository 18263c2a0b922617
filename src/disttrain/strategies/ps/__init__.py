"""The parameter-server strategy over gRPC: sharded servers, workers, sync/SSP/async rules.

Four parts, each a folder, each depending only on the ones after it:

- `run/`: the processes of a run. `launcher` (the whole run on one machine: `STRATEGY`,
  `disttrain ps`), `server` (the `ps-server` process), `worker` (the `ps-worker`
  process), `finalize` (the end of a run on worker 0), `recovery` (failures for the
  summary), `progress` (one display for the cluster), `link` (a process's tie to the
  coordinator).
- `worker/`: a worker's side. `client` (every shard at once), `shard_client` (one shard:
  registration, session, pushes, pulls, steps), `retry` (deadlines, back-off), `step_stream`
  (one kept-open Step call), `exchange` (each mode's step), `participant` (the worker's
  part in the training loop), `blocks` (which samples a data block holds).
- `server/`: a shard's side. `shard` (one shard's state, composing the pure rules),
  `servicer` (the thin gRPC servicer and its server), the pure rules `aggregation` (sync,
  SSP, async; what they save and undo), `decisions` (what they read and decide), `members`
  (worker keys and sessions, the run's membership, each worker's steps in order), `ledger`
  (the data blocks: whose each is, which are applied), `barriers`; and `validation`,
  `update` (the weighted sum of the gradients and the optimizer step, refused when
  non-finite), `limits` (what one client may cost a server), `segments` (shared
  memory per worker).
- `wire/`: what both sides share. `codec` (tensors <-> bytes), `service` (the service's
  methods and messages), `sharding` (who owns which slices), `payloads` (compressed
  gradients), `shared_memory` (same-machine payload segments).

Its face, for scripts and users (the parts import each other's modules, not this face):
the strategy; the processes (`start_servers`) or a shard in this process (`build_state`,
`ShardServer`); a worker's clients (`PSClient`, `RetryPolicy`) and its synchronous step
(`SyncExchange` on its `WorkerTensors`, `Block`); the run's data blocks, which a shard takes from their owners
only (`run_layout`, `block_id`); the slicing of parameters across shards (`plan_shards`,
`ShardPlan`, `TensorSlice`, `flat_parameters`). The wire format itself is `wire`'s face.
"""

from disttrain.strategies.ps.run.launcher import STRATEGY, start_servers
from disttrain.strategies.ps.run.layout import run_layout
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire.sharding import ShardPlan, TensorSlice, flat_parameters, plan_shards
from disttrain.strategies.ps.worker.blocks import block_id
from disttrain.strategies.ps.worker.client import PSClient
from disttrain.strategies.ps.worker.exchange import Block, SyncExchange, WorkerTensors
from disttrain.strategies.ps.worker.retry import RetryPolicy

__all__ = ["STRATEGY", "Block", "PSClient", "RetryPolicy", "ShardPlan", "ShardServer", "SyncExchange",
           "TensorSlice", "WorkerTensors", "block_id", "build_state", "flat_parameters", "plan_shards",
           "run_layout", "start_servers"]
