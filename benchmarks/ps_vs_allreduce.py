"""Communication time of one synchronous PS step, against a gloo `all_reduce` of the same
bytes between as many processes.

A PS step's communication is everything after the gradient exists: push it to the
server, wait for every worker's gradient to be averaged and applied, hold the new
parameters. Each worker steps in one round trip (Step), and, for comparison, with a
push and a pull ("two_calls", how steps went before Step). Target, at 2 workers: PS step
/ all_reduce <= 2 for SimpleCNN (1.7 MB) and a 10 MB MLP, medians of 5 interleaved
repeats. The sweep adds MLPs of 40 and 160 MB and 1, 2 and 4 workers, one repeat each, to
show how the cost grows. With --quick: one repeat of fewer steps, and a sweep of SimpleCNN
at 1 and 2 workers.
"""

from __future__ import annotations

import argparse
import math
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
from disttrain.core import Cluster, tune_allocator
from disttrain.metrics import StepTimer
from disttrain.strategies.ps import (
    Block,
    PSClient,
    RetryPolicy,
    SyncExchange,
    WorkerTensors,
    block_id,
    flat_parameters,
    plan_shards,
    run_layout,
)
from disttrain.training import StepResult, init_model

WARMUP_STEPS = 3
TARGET_SIZES = {"simplecnn": None, "10mb": 10_495_320}
SWEEP_SIZES = {"simplecnn": None, "10mb": 10_495_320, "40mb": 40_000_000, "160mb": 160_000_000}
SWEEP_WORKERS = (1, 2, 4)
QUICK_SWEEP_SIZES = {"simplecnn": None}
QUICK_SWEEP_WORKERS = (1, 2)
VARIANTS = ("one_round_trip", "two_calls")


def hidden_for(nbytes: int) -> int:
    """The hidden width of the 2-layer MNIST MLP whose float32 parameters take about `nbytes`:
    h*h + 796*h + 10 elements (784*h + h*h + 10*h weights, 2*h + 10 biases)."""
    return round((-796 + math.sqrt(796 ** 2 + 4 * (nbytes / 4 - 10))) / 2)


def ps_worker(args: argparse.Namespace) -> None:
    """Role: one sync worker trading a fixed gradient; times each step's communication."""
    config = load_config(args.config)
    model = init_model(config.training)
    flat, grads = flat_parameters(model)
    grads.normal_()
    client = PSClient(args.servers.split(","), plan_shards(model, 1), RetryPolicy(),
                      one_round_trip=args.variant == "one_round_trip")
    client.register(f"worker{args.rank}", args.rank)
    shared = client.shared_buffers()
    if shared is not None:  # as a worker does: the model lives in the shard's segments
        flat, grads = flat_parameters(model, *shared)
        grads.normal_()
    exchange = SyncExchange(client, f"worker{args.rank}", WorkerTensors(flat, grads))
    exchange.start()
    timer, times = StepTimer(), []
    batches = run_layout(config).batches_per_epoch  # the shard takes only this worker's own blocks
    for step in range(1, WARMUP_STEPS + args.steps + 1):
        start = time.perf_counter()
        epoch, index = divmod(step - 1, batches)  # its batch of the step
        block = Block(step, block_id=block_id(epoch, args.rank, index, args.world, batches), epoch=epoch,
                      num_samples=64)
        exchange.step(lambda: StepResult(0.0, 0, 64), block, timer)
        times.append(time.perf_counter() - start)
    client.close()
    write_result(args.result, {"step_s": statistics.median(times[WARMUP_STEPS:]),
                               "nbytes": grads.numel() * 4})


def gloo_rank(args: argparse.Namespace) -> None:
    """Role: one gloo rank timing all_reduce of `nbytes`."""
    dist.init_process_group("gloo", init_method=args.store, rank=args.rank, world_size=args.world)
    tensor = torch.randn(args.nbytes // 4)
    times = []
    for _ in range(WARMUP_STEPS + args.steps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    write_result(args.result, {"step_s": statistics.median(times[WARMUP_STEPS:])})


def ps_step_s(nbytes: int | None, workers: int, steps: int, variant: str, folder: Path) -> tuple[float, int]:
    """(median sync step communication of worker 0, the model's bytes)."""
    model = "simplecnn" if nbytes is None else "mlp"
    training = {"dataset": "mnist", "num_epochs": 1000}  # the input shape only; no data is read
    if nbytes is not None:
        training["mlp_hidden_size"] = hidden_for(nbytes)
    config = make_config(folder, model=model, training=training, num_workers=workers,
                         aggregation_mode="sync")
    with Cluster(folder / "logs") as cluster:
        addresses = servers(cluster, config, folder)
        results = run_roles(__file__, "ps-worker", workers, [
            "--config", str(folder / "config.yaml"), "--servers", ",".join(addresses), "--steps", str(steps),
            "--world", str(workers), "--variant", variant])
    return results[0]["step_s"], results[0]["nbytes"]


def gloo_s(nbytes: int, workers: int, steps: int, folder: Path) -> float:
    results = run_roles(__file__, "gloo", workers, ["--store", file_store(folder), "--nbytes", str(nbytes),
                                                    "--steps", str(steps), "--world", str(workers)])
    return results[0]["step_s"]


def measure_once(nbytes: int | None, workers: int, steps: int, variants=VARIANTS) -> dict:
    times: dict = {}
    for variant in variants:
        with tempfile.TemporaryDirectory() as tmp:
            times[variant], size = ps_step_s(nbytes, workers, steps, variant, Path(tmp))
    with tempfile.TemporaryDirectory() as tmp:
        times["gloo"] = gloo_s(size, workers, steps, Path(tmp))
    return {"bytes": size, **times}


def target(repeats: int, steps: int) -> dict:
    """Each size at 2 workers, `repeats` times, the sizes and variants interleaved."""
    runs: dict[str, list[dict]] = {name: [] for name in TARGET_SIZES}
    for _ in range(repeats):
        for name, nbytes in TARGET_SIZES.items():
            runs[name].append(measure_once(nbytes, 2, steps))
    out = {}
    for name, rows in runs.items():
        med = {key: statistics.median(row[key] for row in rows) for key in ("gloo", *VARIANTS)}
        out[name] = {"bytes": rows[0]["bytes"], "repeats": len(rows),
                     "ps_step_comm_s": med["one_round_trip"], "ps_two_calls_s": med["two_calls"],
                     "gloo_all_reduce_s": med["gloo"], "ratio": med["one_round_trip"] / med["gloo"],
                     "two_calls_ratio": med["two_calls"] / med["gloo"],
                     "ratios_per_repeat": [round(r["one_round_trip"] / r["gloo"], 3) for r in rows]}
    return out


def sweep(steps: int, sizes: dict[str, int | None] = SWEEP_SIZES,
          worker_counts: tuple[int, ...] = SWEEP_WORKERS) -> list[dict]:
    rows = []
    for workers in worker_counts:
        for name, nbytes in sizes.items():
            row = measure_once(nbytes, workers, steps if nbytes is None or nbytes < 50e6 else 3,
                               variants=("one_round_trip",))
            ratio = row["one_round_trip"] / row["gloo"] if workers > 1 else None
            rows.append({"model": name, "bytes": row["bytes"], "workers": workers,
                         "ps_step_comm_s": row["one_round_trip"], "gloo_all_reduce_s": row["gloo"],
                         "ratio": ratio})
    return rows


def extra(parser: argparse.ArgumentParser) -> None:
    role_flags(parser)
    parser.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="one_round_trip", help=argparse.SUPPRESS)


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], extra)
    one_thread()
    tune_allocator()
    if args.role == "ps-worker":
        return ps_worker(args)
    if args.role == "gloo":
        gloo_rank(args)
        exit_rank()
    steps = 10 if args.quick else 40
    results = target(args.repeats, steps)
    results["sweep"] = sweep(3, QUICK_SWEEP_SIZES, QUICK_SWEEP_WORKERS) if args.quick else sweep(10)
    report("ps_vs_allreduce", {**results, "ratio": max(results[n]["ratio"] for n in TARGET_SIZES)},
           args.output, target="ratio <= 2 (PS sync step communication / gloo all_reduce, 2 workers)")


if __name__ == "__main__":
    main()
