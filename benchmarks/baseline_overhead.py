"""The baseline trainer's samples/s against a plain hand-written PyTorch loop.

Same model (SimpleCNN), same in-memory data, same batch size, optimizer and thread count;
the trainer runs with metrics (JSONL + TensorBoard) and checkpointing on. Target: the
trainer keeps at least 0.95 of the plain loop's samples/s.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from common import median, parse_args, report, time_interleaved

from disttrain.config import config_from_dict
from disttrain.data import load_datasets
from disttrain.strategies.baseline import STRATEGY
from disttrain.training import RunOptions, build_model

TARGET = 0.95


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--threads", type=int, default=2))
    torch.set_num_threads(args.threads)
    num_samples = 2048 if args.quick else 8192
    raw = {"training": {"dataset": "synthetic", "num_samples": num_samples, "batch_size": 64,
                        "num_epochs": 1, "optimizer": "adam", "checkpoint_interval": 50,
                        "log_interval": 10, "max_test_samples": 256},
           "system": {"num_threads": args.threads}}
    config = config_from_dict(raw)
    train_set, _ = load_datasets(config.training)
    workdir = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    trainer_seconds: list[float] = []

    def plain_loop() -> None:
        torch.manual_seed(0)
        model = build_model("simplecnn", train_set.input_shape, 10)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        order = torch.randperm(len(train_set))
        for start in range(0, len(order), 64):
            inputs, targets = train_set.batch(order[start:start + 64])
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()

    def trainer() -> None:
        run = workdir / f"run{len(trainer_seconds)}"
        summary = STRATEGY.run(config.replace(system={"checkpoint_dir": str(run / "ckpt"),
                                                      "log_dir": str(run / "logs")}), RunOptions())
        trainer_seconds.append(summary.train_time_s)

    plain_loop()  # warm-up: first-touch allocations and kernel selection
    times = time_interleaved({"plain": plain_loop, "trainer": trainer}, args.repeats)
    plain_s = median(times["plain"])
    trainer_loop_s = median(trainer_seconds)
    ratio = plain_s / trainer_loop_s
    report("baseline_overhead", {
        "samples_per_run": num_samples,
        "threads": args.threads,
        "plain_samples_per_s": num_samples / plain_s,
        "trainer_samples_per_s": num_samples / trainer_loop_s,
        "ratio": ratio,
        "trainer_wall_s_including_setup_and_eval": median(times["trainer"]),
        "passed": ratio >= TARGET,
    }, args.output, target=f"trainer / plain >= {TARGET}")


if __name__ == "__main__":
    main()
