"""The DDP strategy: ring all-reduce inside torch.distributed, ranks started by torch's
elastic agent (`disttrain ddp`) or by torchrun (`python -m disttrain.ddp`).

Modules: `launcher` (checks, elastic agent: `STRATEGY`), `runtime` (backend, device,
process group), `participant` (the one DDP participant in the training loop: the step,
under a recovery policy), `rank` (restart mode's policy and a rank's run), `comm_hooks`
(the one place DDP communication hooks are registered), `precision` (bf16/fp16 on CUDA),
`store` and `rng` (checkpoints that resume exactly), `reduce` (figures over all ranks),
`endpoint` (the rendezvous check), `preemption` (SIGTERM: the ranks agree on a step and
stop there with its checkpoint); `live/` (live recovery, `ddp.recovery: live`: survivors
re-form without restarting, a restarted rank rejoins; the launcher starts the ranks
itself).
"""

from disttrain.compression.ddp_hooks import build_ddp_hook, run_hook
from disttrain.strategies.ddp.comm_hooks import CommStats, register_comm_hook
from disttrain.strategies.ddp.launcher import STRATEGY
from disttrain.strategies.ddp.preemption import StopAgreement, SyncStopAgreement

# With the strategy, what puts a compression hook on a DDP model of one's own (a benchmark
# of the collectives): the hook of a `compression` section, and its registration; and the
# ranks' agreement on a preemption's stop step (the benchmark of its cost per step).
__all__ = ["STRATEGY", "CommStats", "StopAgreement", "SyncStopAgreement", "build_ddp_hook",
           "register_comm_hook", "run_hook"]
