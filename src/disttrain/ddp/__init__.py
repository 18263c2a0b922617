"""The DDP strategy: ring all-reduce inside torch.distributed, ranks started by torch's
elastic agent (`disttrain ddp`) or by torchrun (`python -m disttrain.ddp`).

    disttrain ddp --world-size 2 --dataset mnist --num-epochs 1
    torchrun --standalone --nproc-per-node 2 -m disttrain.ddp --config configs/ddp_mnist.yaml
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m disttrain.ddp --config configs/ddp_mnist.yaml

Modules: `launcher` (checks, elastic agent), `runtime` (backend, device, process group),
`trainer` (the rank's loop), `comm_hooks` (the one place DDP communication hooks are
registered), `precision` (bf16/fp16 on CUDA), `state` and `rng` (checkpoints that resume
exactly), `reduce` (figures over all ranks), `command` (the command lines).
"""

from disttrain.ddp.command import add_arguments, main

__all__ = ["add_arguments", "main"]
