"""End-to-end training samples/s: the PS with 2 workers, sync and async, against
DistributedDataParallel over gloo with 2 ranks, same model (SimpleCNN), data, batch (64
per worker) and optimizer, one torch thread per process.

The PS run is a real `disttrain ps` cluster (1 server + 2 workers, server included in the
machine's load); its rate is read from worker 0's metrics, past the first logged interval.
The DDP run is a plain `DistributedDataParallel` loop in 2 processes, timed over the same
steps. Process start-up and evaluation are excluded from both. Targets: PS sync / DDP >=
0.95 and PS async / DDP >= 1.0, medians of interleaved repeats.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import parse_args, report
from ps_helpers import exit_rank, file_store, make_config, one_thread, role_flags, run_roles, write_result

from disttrain.config import load_config
from disttrain.data import ShardedSampler, load_datasets
from disttrain.metrics import read_metrics
from disttrain.strategies.ps import STRATEGY
from disttrain.training import RunOptions, build_optimizer, forward_backward, init_model

WARMUP_STEPS = 10
LOG_INTERVAL = 10


def ddp_rank(args: argparse.Namespace) -> None:
    """Role: one DDP rank; times steps WARMUP_STEPS.. to the end."""
    config = load_config(args.config)
    dist.init_process_group("gloo", init_method=args.store, rank=args.rank, world_size=2)
    train_set, _ = load_datasets(config.training)
    model = torch.nn.parallel.DistributedDataParallel(init_model(config.training))
    optimizer = build_optimizer(model.parameters(), config.training)
    sampler = ShardedSampler(len(train_set), world_size=2, rank=args.rank, seed=config.training.seed)
    start, samples = None, 0
    for step, indices in enumerate(sampler.batches(config.training.batch_size)):
        if step == WARMUP_STEPS:
            dist.barrier()
            start = time.perf_counter()
        inputs, targets = train_set.batch(indices)
        optimizer.zero_grad()
        forward_backward(model, inputs, targets)
        optimizer.step()
        if start is not None:
            samples += len(indices)
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    write_result(args.result, {"samples_per_s": 2 * samples / elapsed})


def ps_samples_per_s(metrics_path: Path, num_workers: int) -> float:
    """Cluster samples/s from a worker's logged intervals, the first (warm-up) left out."""
    records = [r for r in read_metrics(metrics_path) if "throughput/samples_per_s" in r][1:]
    samples = [LOG_INTERVAL * 64 for _ in records]
    seconds = sum(s / r["throughput/samples_per_s"] for s, r in zip(samples, records, strict=True))
    return num_workers * sum(samples) / seconds


def measure_ps(steps: int, folder: Path, mode: str = "sync") -> float:
    training = {"max_train_samples": 2 * 64 * (WARMUP_STEPS + steps), "max_test_samples": 100,
                "log_interval": LOG_INTERVAL}
    config = make_config(folder, training=training, num_workers=2, aggregation_mode=mode)
    STRATEGY.run(config, RunOptions())
    return ps_samples_per_s(folder / "logs" / "worker0" / "metrics.jsonl", 2)


def measure_ddp(steps: int, folder: Path) -> float:
    config = make_config(folder, training={"max_train_samples": 2 * 64 * (WARMUP_STEPS + steps)})
    config.save(folder / "ddp.yaml")
    results = run_roles(
        __file__, "ddp", 2, ["--config", str(folder / "ddp.yaml"), "--store", file_store(folder)]
    )
    return results[0]["samples_per_s"]



def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], role_flags)
    one_thread()
    if args.role == "ddp":
        ddp_rank(args)
        exit_rank()
    logging.basicConfig(level=logging.WARNING)
    steps = 30 if args.quick else 200
    measures = {"ddp": measure_ddp, "ps_sync": measure_ps,
                "ps_async": lambda steps, folder: measure_ps(steps, folder, "async")}
    rates: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(1 if args.quick else args.repeats):  # interleaved: drift in load hits all alike
        for name, measure in measures.items():
            with tempfile.TemporaryDirectory() as tmp:
                rates[name].append(measure(steps, Path(tmp)))
    median = {name: statistics.median(values) for name, values in rates.items()}
    report(
        "ps_training",
        {"steps": steps, "ps_samples_per_s": median["ps_sync"], "ps_async_samples_per_s": median["ps_async"],
         "ddp_samples_per_s": median["ddp"], "runs": rates, "ratio": median["ps_sync"] / median["ddp"],
         "async_ratio": median["ps_async"] / median["ddp"]},
        args.output,
        target="ratio (sync) >= 0.95, async_ratio >= 1.0",
    )


if __name__ == "__main__":
    main()
