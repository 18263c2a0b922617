"""DDP with 2 ranks x 1 thread against two baselines timed in the same run.

Three ways of training SimpleCNN (28x28 inputs, batch 64 per process, Adam, 1 torch
thread per process, the same number of steps per process), interleaved A B C A B C:

- `independent`: 2 single-thread processes, each training its own model on its half of
  the data with no communication (the machine's limit for 2 workers);
- `plain_ddp`: a hand-written torch DDP loop (gloo, default buckets), 2 ranks;
- `trainer`: `disttrain ddp --world-size 2`, as a user runs it (elastic launcher, sharded
  sampler, timing comm hook, JSONL + TensorBoard metrics).

Each variant's samples/s is all samples over the slowest process's training-loop time
(from its first step to the end of its last, setup and evaluation excluded), the way the
trainer's summary counts it. A ratio is the median over repeats of the ratio within one
repeat. Targets: trainer / independent >= 0.9 and trainer / plain_ddp >= 0.97.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from common import median, parse_args, report, time_interleaved
from torch.nn.parallel import DistributedDataParallel

from disttrain.config import config_from_dict
from disttrain.data import load_datasets
from disttrain.training import build_model

WORLD_SIZE = 2
BATCH_SIZE = 64
SEED = 0
TARGET_VS_INDEPENDENT = 0.9
TARGET_VS_PLAIN_DDP = 0.97


def training_config(steps: int):
    return config_from_dict({"training": {
        "dataset": "synthetic", "num_samples": WORLD_SIZE * steps * BATCH_SIZE,
        "batch_size": BATCH_SIZE, "num_epochs": 1, "optimizer": "adam", "learning_rate": 1e-3,
        "seed": SEED, "max_test_samples": 256}, "system": {"num_threads": 1}})


def _loop(rank: int, steps: int, communicate: bool, start_together, result_dir: str) -> None:
    """One process of `independent` (communicate=False) or `plain_ddp` (True)."""
    torch.set_num_threads(1)
    training = training_config(steps).training
    train_set, _ = load_datasets(training)
    torch.manual_seed(SEED)
    model = build_model("simplecnn", train_set.input_shape, train_set.num_classes)
    if communicate:
        dist.init_process_group("gloo", init_method=f"file://{result_dir}/store", rank=rank,
                                world_size=WORLD_SIZE)
        model = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    shard = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(SEED))[rank::WORLD_SIZE]
    start_together.wait()
    started = time.perf_counter()
    for step in range(steps):
        inputs, targets = train_set.batch(shard[step * BATCH_SIZE:(step + 1) * BATCH_SIZE])
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    seconds = time.perf_counter() - started
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps({"seconds": seconds}))
    if communicate:
        dist.barrier()
        dist.destroy_process_group()


def spawned(steps: int, communicate: bool) -> float:
    """Run the hand-written variant in 2 fresh processes; return global samples/s."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as folder:
        mp.start_processes(_loop, args=(steps, communicate, context.Barrier(WORLD_SIZE), folder),
                           nprocs=WORLD_SIZE, start_method="spawn")
        seconds = max(json.loads(Path(folder, f"rank{r}.json").read_text())["seconds"]
                      for r in range(WORLD_SIZE))
    return WORLD_SIZE * steps * BATCH_SIZE / seconds


def trainer(steps: int) -> float:
    """Run `disttrain ddp`; return the global samples/s of its summary."""
    config = training_config(steps)
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as folder:
        training = config.training
        command = [sys.executable, "-m", "disttrain", "ddp", "--world-size", str(WORLD_SIZE),
                   "--dataset", "synthetic", "--num-samples", str(training.num_samples),
                   "--max-test-samples", str(training.max_test_samples),
                   "--batch-size", str(BATCH_SIZE), "--num-epochs", "1", "--optimizer", "adam",
                   "--learning-rate", "0.001", "--seed", str(SEED), "--num-threads", "1",
                   "--log-dir", f"{folder}/logs",
                   "--checkpoint-dir", f"{folder}/ckpt", "--summary-json", f"{folder}/summary.json"]
        subprocess.run(command, check=True, capture_output=True, timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
        summary = json.loads(Path(folder, "summary.json").read_text())
    if summary["samples_processed"] != WORLD_SIZE * steps * BATCH_SIZE:
        raise RuntimeError(f"trainer processed {summary['samples_processed']} samples")
    return summary["throughput_samples_per_s"]


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median over repeats of numerator / denominator measured in the same repeat."""
    return median([a / b for a, b in zip(numerators, denominators, strict=True)])


def main() -> None:
    args = parse_args(__doc__.splitlines()[0],
                      lambda p: p.add_argument("--steps", type=int, default=150,
                                               help="training steps per process"))
    steps = 30 if args.quick else args.steps
    rates: dict[str, list[float]] = {"independent": [], "plain_ddp": [], "trainer": []}
    variants = {
        "independent": lambda: rates["independent"].append(spawned(steps, communicate=False)),
        "plain_ddp": lambda: rates["plain_ddp"].append(spawned(steps, communicate=True)),
        "trainer": lambda: rates["trainer"].append(trainer(steps)),
    }
    wall = time_interleaved(variants, args.repeats)
    samples_per_s = {name: median(values) for name, values in rates.items()}
    # Ratios of the runs of one repeat (seconds apart), then their median: load that drifts
    # over minutes on a shared machine hits both sides of each ratio alike.
    vs_independent = paired_ratio(rates["trainer"], rates["independent"])
    vs_plain = paired_ratio(rates["trainer"], rates["plain_ddp"])
    report("ddp_scaling", {
        "world_size": WORLD_SIZE, "threads_per_process": 1, "batch_size": BATCH_SIZE,
        "steps_per_process": steps, "repeats": args.repeats,
        "samples_per_s": samples_per_s,
        "samples_per_s_each_repeat": rates,
        "wall_s_median_including_startup": {name: median(v) for name, v in wall.items()},
        "trainer_vs_independent": vs_independent,
        "trainer_vs_plain_ddp": vs_plain,
        "plain_ddp_vs_independent": paired_ratio(rates["plain_ddp"], rates["independent"]),
        "ratio_of_medians": {
            "trainer_vs_independent": samples_per_s["trainer"] / samples_per_s["independent"],
            "trainer_vs_plain_ddp": samples_per_s["trainer"] / samples_per_s["plain_ddp"]},
        "passed": vs_independent >= TARGET_VS_INDEPENDENT and vs_plain >= TARGET_VS_PLAIN_DDP,
    }, args.output, target=f"trainer / independent >= {TARGET_VS_INDEPENDENT}, "
                           f"trainer / plain_ddp >= {TARGET_VS_PLAIN_DDP}")


if __name__ == "__main__":
    main()
