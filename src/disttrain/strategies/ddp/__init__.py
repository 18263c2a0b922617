"""The DDP strategy: ring all-reduce inside torch.distributed, ranks started by torch's
elastic agent (`disttrain ddp`) or by torchrun (`python -m disttrain.ddp`).

Modules: `launcher` (checks, elastic agent: `STRATEGY`), `runtime` (backend, device,
process group), `rank` (a rank's participant in the training loop), `comm_hooks` (the one
place DDP communication hooks are registered), `precision` (bf16/fp16 on CUDA), `store`
and `rng` (checkpoints that resume exactly), `reduce` (figures over all ranks),
`endpoint` (the rendezvous check); `live/` (live recovery, `ddp.recovery: live`: survivors
re-form without restarting, a restarted rank rejoins; the launcher starts the ranks itself).
"""

from disttrain.strategies.ddp.launcher import STRATEGY

__all__ = ["STRATEGY"]
