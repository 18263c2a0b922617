"""The GPU check's workloads step: ResNet-18 and gpt_small samples/s under each strategy,
against a plain single-GPU loop timed in the same run.

The strategies run as the workloads benchmark runs them (benchmarks/workloads.py: its
command lines, batches and per-window figures from each process's metrics; its steps for
the GPU run, its quick mode's for the runs that compute on the CPU):

    ddp_per_gpu   `disttrain ddp` with one rank per GPU over NCCL
    baseline      `disttrain baseline`
    ddp           `disttrain ddp --world-size 2` as a user runs it (backend auto: on a
                  machine of one GPU, rank 0 on the GPU and rank 1 on the CPU, over gloo)
    ps_sync, ps_async   `disttrain ps`, 2 servers and 2 workers

The plain loop is the reference: the same model and batch, data already on the GPU, a
forward, backward and Adam step per iteration, timed between synchronisations. It is
also timed at a 16 times larger batch, for what the GPU does when the batch fills it.
Each strategy's samples/s is divided by the plain loop's of the same batch.

When the step's time is short, strategies are left out (recorded as not run) in the
reverse of the order above. `--device cpu` runs all of it on the CPU at the benchmark's
quick sizes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import workloads as bench  # noqa: E402 (benchmarks/ is no package: found through the path above)

from disttrain.config import config_from_dict  # noqa: E402
from disttrain.data import load_datasets  # noqa: E402
from disttrain.training import init_model  # noqa: E402

MODELS = ("resnet18", "gpt_small")
STRATEGIES = ("ddp_per_gpu", "baseline", "ddp", "ps_sync", "ps_async")
PLAIN_WARMUP, PLAIN_STEPS = 3, 20
LARGE_BATCH = 16  # times the workload's batch
MIN_RUN_S = 25.0  # a strategy with less time left than this is not started
RUN_CAP_S = 120.0


def sizes(model: str, quick: bool) -> tuple[int, dict[str, Any]]:
    """The benchmark's batch per process and model_args for `model`."""
    workload = bench.WORKLOADS[model]
    return (workload["batch"] // 2 if quick else workload["batch"]), \
        (workload["quick_model_args"] or {}) if quick else {}


def plain_loop(model_name: str, device: torch.device, batch: int, model_args: dict[str, Any]
               ) -> dict[str, Any]:
    """samples/s of a plain PyTorch loop over one batch resident on `device`."""
    workload = bench.WORKLOADS[model_name]
    training = config_from_dict({"training": {
        "dataset": workload["dataset"], "model_architecture": model_name, "model_args": model_args,
        "num_samples": batch, "max_test_samples": 16, "seq_len": 128, "seed": 0}}).training
    torch.manual_seed(0)
    model = init_model(training).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_set, _ = load_datasets(training)
    inputs, targets = (t.to(device) for t in train_set.batch(torch.arange(batch) % len(train_set)))
    model.train()
    for step in range(PLAIN_WARMUP + PLAIN_STEPS):
        if step == PLAIN_WARMUP:
            _synchronize(device)
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        optimizer.step()
    _synchronize(device)
    step_time_s = (time.perf_counter() - started) / PLAIN_STEPS
    return {"device": str(device), "batch": batch, "steps_timed": PLAIN_STEPS, "step_time_s": step_time_s,
            "samples_per_s": batch / step_time_s}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _replace(args: list[str], flag: str, value: Any) -> list[str]:
    index = args.index(flag)
    return [*args[:index + 1], str(value), *args[index + 2:]]


def steps_per_process(model: str, strategy: str, quick: bool) -> int:
    """The benchmark's steps, but its quick count (two logged windows, the first the
    warm-up) for the strategies that compute on the CPU on a CUDA machine: a minute there
    would otherwise go to a few CPU-bound figures."""
    workload = bench.WORKLOADS[model]
    return workload["steps"] if strategy == "ddp_per_gpu" and not quick else workload["quick_steps"]


def command(model: str, strategy: str, folder: Path, quick: bool, gpus: int) -> list[str]:
    """The benchmark's command line of `strategy` with `steps_per_process` steps;
    ddp_per_gpu's is its ddp one with one rank per GPU over NCCL (on the CPU: one rank, gloo)."""
    batch, _ = sizes(model, quick)
    steps = steps_per_process(model, strategy, quick)
    if strategy == "ddp_per_gpu":
        processes = max(gpus, 1)
        args = _replace(bench.command(model, "ddp", folder, quick), "--world-size", processes)
        args += ["--backend", "nccl" if gpus else "gloo"]
    else:
        processes = 1 if strategy == "baseline" else bench.WORKERS
        args = bench.command(model, strategy, folder, quick)
    return _replace(args, "--num-samples", processes * steps * batch)


def measure(model: str, strategy: str, folder: Path, quick: bool, gpus: int, timeout_s: float
            ) -> dict[str, Any]:
    """Run one strategy as the benchmark does; its figures averaged over its processes."""
    started = time.monotonic()
    try:
        done = subprocess.run(command(model, strategy, folder, quick, gpus), capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"status": "timed_out", "wall_s": round(time.monotonic() - started, 1)}
    wall_s = round(time.monotonic() - started, 1)
    if done.returncode != 0:
        return {"status": "failed", "exit_code": done.returncode, "wall_s": wall_s,
                "output_tail": (done.stdout + done.stderr)[-1500:]}
    try:
        per_process = [bench.window_means(p) for p in sorted((folder / "logs").glob("*/metrics.jsonl"))]
    except RuntimeError as e:  # too few logged windows
        return {"status": "failed", "wall_s": wall_s, "output_tail": str(e)}
    if not per_process:
        return {"status": "failed", "wall_s": wall_s, "output_tail": "no process logged metrics"}
    batch, _ = sizes(model, quick)
    figures: dict[str, Any] = {key: statistics.fmean(p[key] for p in per_process) for key in per_process[0]}
    figures.update(status="passed", wall_s=wall_s, processes=len(per_process),
                   steps_per_process=steps_per_process(model, strategy, quick),
                   samples_per_s=sum(batch / p["step_time_s"] for p in per_process))
    summary = folder / "logs" / "summary.json"
    if summary.is_file() and strategy.startswith("ddp"):
        recorded = json.loads(summary.read_text())
        figures.update(backend=recorded.get("backend"), rank0_device=recorded.get("device"))
    return figures


def run_workloads(ctx) -> None:
    """The step: plain loops first, then each strategy on both models, as time allows."""
    quick, device = not ctx.cuda, torch.device("cuda" if ctx.cuda else "cpu")
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    if not ctx.cuda:
        torch.set_num_threads(1)  # as each of the benchmark's processes
    results: dict[str, Any] = {model: {"strategies": {}} for model in MODELS}
    ctx.put("note", "baseline and the parameter server's workers compute on the CPU (they have no "
                    "device setting); DDP ranks compute on their GPU")
    for model in MODELS:
        batch, model_args = sizes(model, quick)
        for name, size in (("plain", batch), ("plain_large_batch", batch * (LARGE_BATCH if ctx.cuda else 2))):
            try:
                results[model][name] = plain_loop(model, device, size, model_args)
            except Exception as e:  # recorded: the strategies still run (an out-of-memory, say)
                results[model][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            ctx.check(f"{model}_{name}", "error" not in results[model][name], results[model][name])
        ctx.put("results", results)
    for strategy in STRATEGIES:
        for model in MODELS:
            entry = results[model]["strategies"]
            left = ctx.left_s() - 5
            if left < MIN_RUN_S:
                entry[strategy] = {"status": "not_run", "reason": f"{left:.0f}s left in the step"}
            else:
                entry[strategy] = measure(model, strategy, ctx.work / f"{model}-{strategy}", quick, gpus,
                                          min(RUN_CAP_S, left))
                plain = results[model]["plain"].get("samples_per_s")
                if entry[strategy]["status"] == "passed" and plain:
                    entry[strategy]["ratio_to_plain"] = entry[strategy]["samples_per_s"] / plain
            ctx.put("results", results)
            ctx.check(f"{model}_{strategy}", entry[strategy]["status"] in ("passed", "not_run"),
                      entry[strategy].get("output_tail", entry[strategy]["status"]))
    ctx.put("summary", "; ".join(describe(model, r) for model, r in results.items()))


def describe(model: str, results: dict[str, Any]) -> str:
    """`resnet18: plain 5000/s (large batch 40000/s), ddp_per_gpu 0.80x, baseline 0.01x, ...`"""
    nan = float("nan")
    ratios = ", ".join(f"{name} {f['ratio_to_plain']:.2f}x" if "ratio_to_plain" in f
                       else f"{name} {f['status']}"
                       for name, f in results["strategies"].items())
    return (f"{model}: plain {results['plain'].get('samples_per_s', nan):.0f}/s (large batch "
            f"{results['plain_large_batch'].get('samples_per_s', nan):.0f}/s), {ratios}")
