"""Step time, compute/communication split and bytes per step of every strategy on three
workloads, as ratios to the baseline timed in the same run.

Workloads, on synthetic data of their real shapes: `simplecnn` (1x28x28 images),
`resnet18` (11.2M parameters, BatchNorm, 3x32x32 images: CIFAR's shape) and `gpt_small`
(10.9M parameters, byte-level tokens, 128 per sample). Strategies: `baseline` (one
process), `ps_sync` (each shard's push leaves during the backward pass: overlap, the
default), `ps_sync_no_overlap` (`--no-overlap`: every push after backward) and
`ps_async` (`disttrain ps`: 2 servers, 2 workers) and `ddp` (`disttrain ddp`, 2 ranks),
and on request (`--strategies`) `ps_sync_overlap` (overlap forced on every step,
`ps.overlap_trial_steps=0`; `ps_sync` is the default: overlap kept only if the first
steps measured it faster) and `torch_ddp` (a plain `DistributedDataParallel` loop over
gloo in 2 processes, no disttrain loop around it, each step timed: its step is not split
into compute and communication, which runs inside backward),
each run as a user runs it, through the `disttrain` command, with one torch thread per
process and the same batch per process.

Every figure comes from the processes' own metrics (`metrics.jsonl`), the first logged
window (warm-up) left out, averaged over the workers: `step_time_s` (`time/step_s`),
`compute_s` (`time/compute_s`), `comm_s` (`time/comm_blocked_s`: the time a step waited
on communication), `overlapped_s` (`time/comm_overlapped_s`: communication in flight
while the step computed; `overlapped_share` is its share of `overlapped_s + comm_s`) and
`bytes_per_step` (per worker: gradient bytes sent plus parameter
bytes received under the PS, bytes handed to all-reduce under DDP). `samples_per_s` is
the processes' batches over the step time, summed over processes. Each figure is the
median over interleaved repeats (every strategy in turn, then again), and
`ratio_to_baseline` divides it by the baseline's of the same model. `where_each_wins` is
computed from these figures, and `ps_vs_ddp` holds, per model, each synchronous PS
variant's samples/s over DDP's (its speed-up over the baseline over DDP's: the same
baseline; `torch_ddp_ratio` over the plain torch DDP loop's) and its overlapped share
(the targets: at least 1.0, or 1.05 against the plain torch DDP loop, and at least half);
`overlap_vs_plain`, per model, each overlapped PS variant's samples/s over
`ps_sync_no_overlap`'s.

--quick keeps the keys and shrinks the models (`training.model_args`: resnet18 of width
8, a 2-layer gpt_small of width 64), the batches and the steps. --repeats defaults to 2
(--quick: 1). --models and --strategies pick a subset (the baseline always runs: the
ratios need it); --steps sets the steps per process of every workload. --set KEY=VALUE
(repeatable) passes a config override to every run (`disttrain`'s own `--set`), before
each strategy's own settings, so `ps_sync_overlap` still forces the overlap: e.g. `--set
ps.overlap_trial_steps=8` lengthens the trial of `ps_sync`. --servers sets the PS runs'
shards (2 by default): `--servers 1 --set ps.payload_transport=grpc` pushes ResNet-18's
45 MB through one shard's gRPC stream, whose pieces leave during backward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from common import parse_args, report
from ps_helpers import exit_rank, file_store, one_thread, role_flags, run_roles, write_result

from disttrain.metrics import read_metrics

STRATEGIES = ("baseline", "ps_sync", "ps_sync_no_overlap", "ps_async", "ddp")
PS_SYNC = ("ps_sync", "ps_sync_overlap", "ps_sync_no_overlap")
OPTIONAL = ("ps_sync_overlap", "torch_ddp")  # run only when --strategies names them
WORKERS = 2          # PS workers and DDP ranks
SERVERS = 2          # PS shards: the first one's push leaves during backward
LOG_INTERVAL = 3     # steps per logged window; the first window is the warm-up left out
TIMEOUT_S = 900
DEFAULT_REPEATS = 2

# Per model: data set, batch per process, steps per process, and the model_args of --quick.
WORKLOADS: dict[str, dict[str, Any]] = {
    "simplecnn": {"dataset": "synthetic", "batch": 64, "steps": 30, "quick_steps": 9,
                  "quick_model_args": None},
    "resnet18": {"dataset": "synthetic:3x32x32", "batch": 16, "steps": 12, "quick_steps": 6,
                 "quick_model_args": {"width": 8}},
    "gpt_small": {"dataset": "synthetic:text", "batch": 8, "steps": 12, "quick_steps": 6,
                  "quick_model_args": {"n_layer": 2, "n_head": 2, "n_embd": 64, "dropout": 0.0}},
}


def command(model: str, strategy: str, folder: Path, quick: bool, steps: int | None = None,
            overrides: Sequence[str] = (), servers: int = SERVERS) -> list[str]:
    """The `disttrain` command line of one run; its logs go under `folder` (`steps`: per
    process, None: the workload's; `overrides`: `KEY=VALUE` config overrides, set before
    the strategy's own, which win over them; `servers`: the PS runs' shards)."""
    workload = WORKLOADS[model]
    steps, batch = steps_and_batch(model, quick, steps)
    processes = 1 if strategy == "baseline" else WORKERS
    samples = processes * steps * batch
    args = [sys.executable, "-m", "disttrain", strategy.split("_")[0],
            "--dataset", workload["dataset"], "--model", model,
            "--num-samples", str(samples), "--max-test-samples", "16",
            "--batch-size", str(batch), "--num-epochs", "1", "--optimizer", "adam",
            "--learning-rate", "0.001", "--seed", "0", "--num-threads", "1",
            "--checkpoint-interval", str(10**9),
            "--log-dir", str(folder / "logs"), "--checkpoint-dir", str(folder / "ckpt"),
            "--set", f"training.log_interval={LOG_INTERVAL}",
            "--set", "training.eval_batch_size=16"]
    for override in overrides:
        args += ["--set", override]
    if model == "gpt_small":
        args += ["--seq-len", "128"]
    if quick and workload["quick_model_args"]:
        args += ["--set", f"training.model_args={json.dumps(workload['quick_model_args'])}"]
    if strategy.startswith("ps"):
        args += ["--workers", str(WORKERS), "--servers", str(servers),
                 "--aggregation-mode", strategy.split("_")[1]]
        if strategy == "ps_sync_no_overlap":
            args += ["--no-overlap"]
        elif strategy == "ps_sync_overlap":
            args += ["--set", "ps.overlap_trial_steps=0"]
    elif strategy == "ddp":
        args += ["--world-size", str(WORKERS)]
    return args


def window_means(path: Path) -> dict[str, float]:
    """Per-step means of one process's logged windows, the first left out, each window
    weighted by the steps it covers.

    Raises:
        RuntimeError: the run logged fewer than two windows (too few steps to measure).
    """
    records = [r for r in read_metrics(path) if "time/step_s" in r]
    if len(records) < 2:
        raise RuntimeError(f"{path}: {len(records)} logged windows; the benchmark needs two or "
                           "more (raise the steps of the workload)")
    weights = [b["step"] - a["step"] for a, b in pairwise(records)]
    records = records[1:]

    def mean(*keys: str) -> float:
        total = sum(w * sum(r.get(k, 0.0) for k in keys) for w, r in zip(weights, records, strict=True))
        return total / sum(weights)

    return {"step_time_s": mean("time/step_s"), "compute_s": mean("time/compute_s"),
            "comm_s": mean("time/comm_blocked_s"), "overlapped_s": mean("time/comm_overlapped_s"),
            "bytes_per_step": mean("comm/bytes_sent", "comm/bytes_received", "comm/bytes_allreduced")}


def measure(model: str, strategy: str, quick: bool, steps: int | None = None,
            overrides: Sequence[str] = (), servers: int = SERVERS) -> dict[str, float]:
    """Run one strategy on one workload; its figures, averaged over its processes.

    Raises:
        RuntimeError: the run failed (the end of its output is included).
    """
    with tempfile.TemporaryDirectory(prefix="bench-workloads-") as tmp:
        folder = Path(tmp)
        done = subprocess.run(command(model, strategy, folder, quick, steps, overrides, servers),
                              capture_output=True, text=True, timeout=TIMEOUT_S,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if done.returncode != 0:
            raise RuntimeError(f"{model} {strategy} failed ({done.returncode}): "
                               f"{(done.stdout + done.stderr)[-3000:]}")
        paths = sorted((folder / "logs").glob("*/metrics.jsonl"))
        per_process = [window_means(p) for p in paths]
    figures = {key: statistics.fmean(p[key] for p in per_process) for key in per_process[0]}
    _, batch = steps_and_batch(model, quick)
    figures["samples_per_s"] = sum(batch / p["step_time_s"] for p in per_process)
    figures["processes"] = len(per_process)
    return figures


def steps_and_batch(model: str, quick: bool, steps: int | None = None) -> tuple[int, int]:
    """Steps and batch per process of one workload (`steps`: None for the workload's)."""
    workload = WORKLOADS[model]
    steps = steps or (workload["quick_steps"] if quick else workload["steps"])
    return steps, workload["batch"] // 2 if quick else workload["batch"]


def torch_ddp_training(model: str, quick: bool, steps: int | None = None) -> dict[str, Any]:
    """The training section of a `torch_ddp` rank: what `command` gives `disttrain` for
    the same workload (data, model, samples, batch, optimizer, seed)."""
    workload = WORKLOADS[model]
    steps, batch = steps_and_batch(model, quick, steps)
    training = {"dataset": workload["dataset"], "model_architecture": model,
                "num_samples": WORKERS * steps * batch, "max_test_samples": 16, "batch_size": batch,
                "num_epochs": 1, "optimizer": "adam", "learning_rate": 0.001, "seed": 0}
    if model == "gpt_small":
        training["seq_len"] = 128
    if quick and workload["quick_model_args"]:
        training["model_args"] = workload["quick_model_args"]
    return training


def torch_ddp_rank(args: argparse.Namespace) -> None:
    """Role: one rank of a plain `DistributedDataParallel` loop over gloo (no disttrain loop,
    metrics or checkpoints) on the config's training section, each step timed; its step
    times go to `args.result` as JSON."""
    import time

    import torch
    import torch.distributed as dist

    from disttrain.config import load_config
    from disttrain.data import ShardedSampler, load_datasets
    from disttrain.training import build_optimizer, forward_backward, init_model

    one_thread()
    training = load_config(args.config).training
    dist.init_process_group("gloo", init_method=args.store, rank=args.rank, world_size=WORKERS)
    train_set, _ = load_datasets(training)
    model = torch.nn.parallel.DistributedDataParallel(init_model(training))
    optimizer = build_optimizer(model.parameters(), training)
    sampler = ShardedSampler(len(train_set), world_size=WORKERS, rank=args.rank, seed=training.seed)
    times = []
    dist.barrier()
    for indices in sampler.batches(training.batch_size):
        started = time.perf_counter()
        inputs, targets = train_set.batch(indices)
        optimizer.zero_grad()
        forward_backward(model, inputs, targets)
        optimizer.step()
        times.append(time.perf_counter() - started)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    write_result(args.result, {"step_times_s": times, "gradient_bytes": gradient_bytes})
    dist.barrier()
    exit_rank()


def measure_torch_ddp(model: str, quick: bool, steps: int | None = None) -> dict[str, float]:
    """A plain torch DDP loop of 2 ranks on the workload, with the figures `measure` gives:
    each rank's mean step past its first LOG_INTERVAL steps (the warm-up window), averaged
    over the ranks. DDP's all-reduce runs inside backward, so its step is not split:
    `compute_s` is the whole step, `comm_s` 0, and the bytes are those handed to
    all-reduce."""
    from disttrain.config import config_from_dict

    training = torch_ddp_training(model, quick, steps)
    with tempfile.TemporaryDirectory(prefix="bench-torch-ddp-") as tmp:
        config = Path(tmp) / "torch_ddp.yaml"
        config_from_dict({"training": training}).save(config)
        ranks = run_roles(__file__, "torch-ddp", WORKERS,
                          ["--config", str(config), "--store", file_store(Path(tmp))], timeout_s=TIMEOUT_S)
    per_rank = []
    for r in ranks:
        timed = r["step_times_s"][LOG_INTERVAL:]
        if not timed:
            raise RuntimeError(f"{model} torch_ddp: {len(r['step_times_s'])} steps; the benchmark needs more "
                               f"than {LOG_INTERVAL} (raise the steps of the workload)")
        per_rank.append(statistics.fmean(timed))
    step = statistics.fmean(per_rank)
    return {"step_time_s": step, "compute_s": step, "comm_s": 0.0, "overlapped_s": 0.0,
            "bytes_per_step": float(ranks[0]["gradient_bytes"]),
            "samples_per_s": sum(training["batch_size"] / s for s in per_rank), "processes": WORKERS}


def summarise(runs: list[dict[str, float]], baseline: dict[str, float] | None) -> dict[str, Any]:
    """Medians over repeats, the communication's share of a step, and the ratios to the
    baseline's medians (None for the baseline's own bytes, which are 0)."""
    keys = ("step_time_s", "compute_s", "comm_s", "overlapped_s", "bytes_per_step", "samples_per_s")
    result: dict[str, Any] = {key: statistics.median(r.get(key, 0.0) for r in runs) for key in keys}
    result["comm_fraction"] = result["comm_s"] / result["step_time_s"]
    communication = result["overlapped_s"] + result["comm_s"]
    result["overlapped_share"] = result["overlapped_s"] / communication if communication > 0 else None
    reference = baseline or result
    result["ratio_to_baseline"] = {key: result[key] / reference[key]
                                   for key in ("step_time_s", "compute_s", "samples_per_s")}
    return result


def where_each_wins(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per model, from the measured figures: the fastest strategy (samples/s), the
    distributed strategies that beat the baseline, the one that waits least on
    communication and the one that moves fewest bytes per step."""
    wins: dict[str, Any] = {}
    for model, strategies in results.items():
        distributed = {s: f for s, f in strategies.items() if s != "baseline"}
        fastest = max(strategies, key=lambda s: strategies[s]["samples_per_s"])
        beats = sorted((s for s, f in distributed.items() if f["ratio_to_baseline"]["samples_per_s"] > 1.0),
                       key=lambda s: -distributed[s]["samples_per_s"])
        least_comm = min(distributed, key=lambda s: distributed[s]["comm_fraction"])
        fewest_bytes = min(distributed, key=lambda s: distributed[s]["bytes_per_step"])
        ratios = ", ".join(f"{s} {f['ratio_to_baseline']['samples_per_s']:.2f}x"
                           for s, f in distributed.items())
        wins[model] = {
            "fastest": fastest, "beat_baseline": beats, "least_comm_fraction": least_comm,
            "fewest_bytes_per_step": fewest_bytes,
            "text": f"{fastest} is fastest; samples/s against the baseline: {ratios}; "
                    f"{least_comm} waits least on communication "
                    f"({distributed[least_comm]['comm_fraction']:.0%} of a step)"}
    return wins


def ps_vs_ddp(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per model: each synchronous PS variant's samples/s over DDP's (`disttrain ddp`:
    `samples_per_s_ratio`; the plain torch DDP loop: `torch_ddp_ratio`), and the share of
    its communication time that overlapped computation."""
    out: dict[str, Any] = {}
    for model, figures in results.items():
        references = [r for r in ("ddp", "torch_ddp") if r in figures]
        if not references:
            continue
        out[model] = {}
        for strategy in (s for s in PS_SYNC if s in figures):
            entry = {"samples_per_s_ratio" if r == "ddp" else "torch_ddp_ratio":
                     figures[strategy]["samples_per_s"] / figures[r]["samples_per_s"] for r in references}
            out[model][strategy] = {**entry, "overlapped_share": figures[strategy]["overlapped_share"]}
    return out


def overlap_vs_plain(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per model: each overlapped synchronous PS variant's samples/s over the plain one's
    (`ps_sync_no_overlap`; the target: at least 1.0)."""
    return {model: {strategy: figures[strategy]["samples_per_s"]
                    / figures["ps_sync_no_overlap"]["samples_per_s"]
                    for strategy in ("ps_sync", "ps_sync_overlap") if strategy in figures}
            for model, figures in results.items() if "ps_sync_no_overlap" in figures}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], extra_args)
    # common.parse_args's default (5 repeats) would take most of an hour here: -1 marks "not given".
    repeats = args.repeats if args.repeats > 0 else (1 if args.quick else DEFAULT_REPEATS)
    models = args.models.split(",") if args.models else list(WORKLOADS)
    strategies = ["baseline", *(s for s in args.strategies.split(",") if s != "baseline")] \
        if args.strategies else list(STRATEGIES)
    unknown = sorted(set(models) - set(WORKLOADS)) + sorted(set(strategies) - set(STRATEGIES + OPTIONAL))
    if unknown:
        raise SystemExit(f"workloads: unknown model(s) or strategy(ies) {', '.join(unknown)} (models: "
                         f"{', '.join(WORKLOADS)}; strategies: {', '.join(STRATEGIES + OPTIONAL)})")
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        model: {s: [] for s in strategies} for model in models}
    for model in models:
        for _ in range(repeats):  # interleaved: drift in the machine's load hits all alike
            for strategy in strategies:
                if strategy == "torch_ddp":
                    runs[model][strategy].append(measure_torch_ddp(model, args.quick, args.steps))
                    continue
                runs[model][strategy].append(measure(model, strategy, args.quick, args.steps, args.set,
                                                     args.servers))
    results: dict[str, dict[str, Any]] = {}
    for model, by_strategy in runs.items():
        baseline = summarise(by_strategy["baseline"], None)
        results[model] = {"baseline": baseline}
        for strategy in strategies[1:]:
            results[model][strategy] = summarise(by_strategy[strategy], baseline)
    report("workloads", {
        "workers": WORKERS, "servers": args.servers, "repeats": repeats, "threads_per_process": 1,
        "overrides": args.set,
        "workloads": {model: {"dataset": w["dataset"],
                              "batch_per_process": w["batch"] // 2 if args.quick else w["batch"],
                              "steps_per_process": args.steps or (w["quick_steps"] if args.quick
                                                                  else w["steps"]),
                              "model_args": w["quick_model_args"] if args.quick else None}
                      for model, w in WORKLOADS.items() if model in models},
        "results": results,
        "where_each_wins": where_each_wins(results),
        "ps_vs_ddp": ps_vs_ddp(results),
        "overlap_vs_plain": overlap_vs_plain(results),
    }, args.output)


def extra_args(parser) -> None:
    parser.set_defaults(repeats=-1)
    parser.add_argument("--models", help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    parser.add_argument("--strategies", help=f"comma-separated subset of {', '.join(STRATEGIES + OPTIONAL)}")
    parser.add_argument("--steps", type=int, help="steps per process of every workload (default: each "
                        "workload's)")
    parser.add_argument("--servers", type=int, default=SERVERS,
                        help=f"the PS runs' shards (default {SERVERS})")
    parser.add_argument("--set", action="append", default=[], type=override, metavar="KEY=VALUE",
                        help="a config override for every run (repeatable), e.g. ps.overlap_trial_steps=8")


def override(text: str) -> str:
    """One `--set` value, checked before any run starts (argparse exits 2 on a bad one)."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip() or "." not in key:
        raise argparse.ArgumentTypeError(f"{text!r} is not section.key=value (e.g. ps.overlap_trial_steps=8)")
    return text


if __name__ == "__main__":
    if "--role" in sys.argv:  # a torch_ddp rank, started by `run_roles`
        roles = argparse.ArgumentParser()
        role_flags(roles)
        torch_ddp_rank(roles.parse_args())
    main()
