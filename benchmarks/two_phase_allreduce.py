"""Bytes per rank and step time of DDP's int8 collectives as ranks are added: the all-gather
of every rank's payload against the two-phase all-reduce (`compression.ddp_collective:
two_phase`), beside a dense float32 all-reduce, at 2, 4 and 8 gloo ranks on this machine.

Each rank process runs real DDP over one model (a 1000x1000 linear layer: a million
parameters; --quick: 250x250, 2 steps) for a few steps per collective. The bytes are measured: each
rank counts what the collectives delivered to it from the other ranks (the output tensors
of `all_gather` and `all_to_all_single`, less its own part). A dense all-reduce's are not
observable that way and are given as a ring's, 2 (n - 1) / n x 4 bytes a parameter. Step
times share 2 cores among up to 8 ranks: they show the trend, the bytes are the figure.

Target: the two-phase bytes per rank within 15% of each other across the rank counts.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_args, report  # noqa: E402

from disttrain.config import CompressionConfig  # noqa: E402
from disttrain.strategies.ddp import CommStats, build_ddp_hook, register_comm_hook, run_hook  # noqa: E402

COLLECTIVES = ("dense", "gather", "two_phase")


class Received:
    """Counts the bytes the collectives deliver to this rank from the others."""

    def __init__(self) -> None:
        self.bytes = 0
        self._gather, self._to_all = dist.all_gather, dist.all_to_all_single

    def install(self) -> None:
        def all_gather(tensors, tensor, *args, **kwargs):
            delivered = sum(t.numel() * t.element_size() for t in tensors)
            self.bytes += delivered - tensor.numel() * tensor.element_size()
            return self._gather(tensors, tensor, *args, **kwargs)

        def all_to_all_single(output, input, *args, **kwargs):
            own = output.numel() // dist.get_world_size()
            self.bytes += (output.numel() - own) * output.element_size()
            return self._to_all(output, input, *args, **kwargs)

        dist.all_gather, dist.all_to_all_single = all_gather, all_to_all_single


def rank_main(rank: int, world_size: int, port: int, width: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    received = Received()
    received.install()
    results = {}
    for collective in COLLECTIVES:
        torch.manual_seed(0)
        module = nn.Linear(width, width)
        model = DistributedDataParallel(module)
        if collective != "dense":
            section = CompressionConfig(enabled=True, type="quantization", ddp_collective=collective)
            register_comm_hook(model, CommStats(), run_hook,
                               build_ddp_hook(section, module.named_parameters(), seed=0, rank_seed=rank))
        inputs = torch.randn(8, width, generator=torch.Generator().manual_seed(rank))
        times, per_step = [], []
        for step in range(steps + 1):  # the first step builds DDP's buckets: not counted
            dist.barrier()
            before, started = received.bytes, time.perf_counter()
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(inputs), inputs).backward()
            if step:
                times.append(time.perf_counter() - started)
                per_step.append(received.bytes - before)
        params = sum(p.numel() for p in module.parameters())
        ring = 2 * (world_size - 1) / world_size * 4 * params  # a dense ring's, not observable here
        results[collective] = {
            "received_bytes_per_rank": statistics.median(per_step) if collective != "dense" else ring,
            "bytes_measured": collective != "dense", "step_s": statistics.median(times), "parameters": params}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def run(world_size: int, width: int, steps: int, folder: Path) -> dict:
    out = folder / f"n{world_size}"
    out.mkdir(parents=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.start_processes(rank_main, args=(world_size, store.port, width, steps, str(out)), nprocs=world_size,
                       start_method="spawn")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    return {collective: {"received_bytes_per_rank": max(r[collective]["received_bytes_per_rank"]
                                                        for r in ranks),
                         "bytes_measured": ranks[0][collective]["bytes_measured"],
                         "step_s": statistics.median(r[collective]["step_s"] for r in ranks),
                         "parameters": ranks[0][collective]["parameters"]}
            for collective in COLLECTIVES}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import tempfile

    width, steps = (250, 2) if args.quick else (1000, max(3, args.repeats))
    counts = (2, 4, 8)
    with tempfile.TemporaryDirectory() as folder:
        by_ranks = {str(n): run(n, width, steps, Path(folder)) for n in counts}
    two = [by_ranks[str(n)]["two_phase"]["received_bytes_per_rank"] for n in counts]
    spread = max(two) / min(two) - 1
    for n in counts:
        row = by_ranks[str(n)]
        row["gather_over_two_phase_bytes"] = row["gather"]["received_bytes_per_rank"] / \
            row["two_phase"]["received_bytes_per_rank"]
    report("two_phase_allreduce", {"ranks": by_ranks, "two_phase_bytes_spread": spread,
                                   "met": spread <= 0.15, "width": width, "steps": steps},
           args.output, target="two-phase bytes per rank within 15% across 2, 4 and 8 ranks")


if __name__ == "__main__":
    main()
