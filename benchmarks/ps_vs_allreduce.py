"""Communication time of one synchronous PS step with 2 workers, against a gloo
`all_reduce` of the same bytes between 2 processes.

A PS step's communication is everything after the gradient exists: push it to the
server, wait for both workers' gradients to be averaged and applied, pull the new
parameters. Measured for SimpleCNN (1.7 MB) and a 10 MB MLP. Target: PS time /
all_reduce time <= 2 for each size.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import parse_args, report
from ps_helpers import (
    exit_rank,
    file_store,
    make_config,
    one_thread,
    role_flags,
    run_roles,
    servers,
    write_result,
)

from disttrain.config import load_config
from disttrain.core.processes import Cluster
from disttrain.metrics.window import StepTimer
from disttrain.strategies.ps.client import PSClient, RetryPolicy
from disttrain.strategies.ps.exchange import Block, SyncExchange
from disttrain.strategies.ps.sharding import flat_parameters, plan_shards
from disttrain.strategies.ps.wire import tune_allocator
from disttrain.training.engine import StepResult
from disttrain.training.models import init_model

WARMUP_STEPS = 5


def ps_worker(args: argparse.Namespace) -> None:
    """Role: one sync worker pushing a fixed gradient; times each step's communication."""
    config = load_config(args.config)
    model = init_model(config.training)
    flat, grads = flat_parameters(model)
    grads.normal_()
    client = PSClient(args.servers.split(","), plan_shards(model, 1), RetryPolicy())
    client.register(f"worker{args.rank}", args.rank)
    exchange = SyncExchange(client, f"worker{args.rank}", flat, grads, 0)
    exchange.start()
    timer, times = StepTimer(), []
    for step in range(1, WARMUP_STEPS + args.steps + 1):
        start = time.perf_counter()
        block = Block(step, block_id=step * 2 + args.rank, epoch=0, num_samples=64)
        exchange.step(lambda: StepResult(0.0, 0, 64), block, timer)
        times.append(time.perf_counter() - start)
    client.close()
    write_result(
        args.result, {"step_s": statistics.median(times[WARMUP_STEPS:]), "nbytes": grads.numel() * 4}
    )


def gloo_rank(args: argparse.Namespace) -> None:
    """Role: one gloo rank timing all_reduce of `nbytes`."""
    dist.init_process_group("gloo", init_method=args.store, rank=args.rank, world_size=2)
    tensor = torch.randn(args.nbytes // 4)
    times = []
    for _ in range(WARMUP_STEPS + args.steps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    write_result(args.result, {"step_s": statistics.median(times[WARMUP_STEPS:])})


def measure(model_name: str, steps: int, folder: Path) -> dict:
    # The input shape of mnist only; no data is read.
    config = make_config(folder, model=model_name, training={"dataset": "mnist"}, num_workers=2,
                         aggregation_mode="sync")
    with Cluster(folder / "logs") as cluster:
        addresses = servers(cluster, config, folder)
        ps = run_roles(
            __file__,
            "ps-worker",
            2,
            [
                "--config",
                str(folder / "config.yaml"),
                "--servers",
                ",".join(addresses),
                "--steps",
                str(steps),
            ],
        )
    nbytes = ps[0]["nbytes"]
    gloo = run_roles(
        __file__, "gloo", 2, ["--store", file_store(folder), "--nbytes", str(nbytes), "--steps", str(steps)]
    )
    ps_s, gloo_s = ps[0]["step_s"], gloo[0]["step_s"]
    return {"bytes": nbytes, "ps_step_comm_s": ps_s, "gloo_all_reduce_s": gloo_s, "ratio": ps_s / gloo_s}



def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], role_flags)
    one_thread()
    tune_allocator()
    if args.role == "ps-worker":
        return ps_worker(args)
    if args.role == "gloo":
        gloo_rank(args)
        exit_rank()
    steps = 10 if args.quick else 50
    results = {}
    for name, model in (("simplecnn", "simplecnn"), ("10mb", "mlp")):
        with tempfile.TemporaryDirectory() as tmp:
            results[name] = measure(model, steps, Path(tmp))
    report(
        "ps_vs_allreduce",
        {**results, "ratio": max(r["ratio"] for r in results.values())},
        args.output,
        target="ratio <= 2 (PS step communication / gloo all_reduce)",
    )


if __name__ == "__main__":
    main()
