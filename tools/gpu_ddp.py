"""The GPU check's DDP steps, each a few `disttrain ddp` runs at once, as a user runs them:
the NCCL backend against gloo (`ddp_backends`) and mixed precision against float32
(`precision`). `--device cpu` runs their CPU counterparts."""

from __future__ import annotations

import math
from typing import Any

import torch
from gpu_runs import EXACT, Context, compare_parameters, run_all

LOSS_TOLERANCE = 0.1  # relative: bf16, fp16 and compressed runs end within 10% of the reference's loss


DDP_FLAGS = ["ddp", "--dataset", "digits", "--model", "mlp", "--num-epochs", 1, "--max-train-samples", 512,
             "--max-test-samples", 128, "--batch-size", 32, "--optimizer", "sgd", "--learning-rate", 0.05,
             "--seed", 0, "--num-threads", 1, "--checkpoint-interval", 10**9, "--timeout-s", 60]


COMPRESSION_FLAGS = {"quantization": ["--compression-enabled", "--compression-type", "quantization"],
                     "powersgd": ["--compression-enabled", "--compression-type", "powersgd",
                                  "--powersgd-rank", 2]}


def ddp_backends(ctx: Context) -> None:
    """The same DDP run over NCCL and over gloo: final parameters compared (with gradient
    compression, whose quantization may round a GPU's gradient to the next level, the
    final test loss).

    NCCL gives each rank a GPU of its own, so it runs min(2, GPUs) ranks. On one GPU the
    2-rank run is the mixed group `auto` makes (rank 0 on the GPU, rank 1 on the CPU,
    gloo between them), compared with 2 ranks on gloo. `--device cpu`: `auto` (gloo on a
    machine without CUDA) against an explicit gloo.
    """
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    ranks = min(2, gpus) if ctx.cuda else 2
    tested = ["--backend", "nccl" if ctx.cuda else "auto", "--world-size", ranks]
    gloo = ["--backend", "gloo", "--world-size", ranks]
    name = f"{'nccl' if ctx.cuda else 'auto'}_{ranks}_ranks"
    pairs: dict[str, tuple[list, list, str]] = {name: (tested, gloo, "parameters")}
    for scheme, flags in COMPRESSION_FLAGS.items():
        pairs[f"{name}_{scheme}"] = (tested + flags, gloo + flags, "loss")
    if gpus == 1 or not ctx.cuda:
        pairs["mixed_2_ranks" if ctx.cuda else "auto_1_rank"] = (
            ["--backend", "auto", "--world-size", 2 if ctx.cuda else 1],
            ["--backend", "gloo", "--world-size", 2 if ctx.cuda else 1], "parameters")
    ctx.put("gpus", gpus)
    runs = run_all(ctx, {f"{pair}/{side}": DDP_FLAGS + flags for pair, (*both, _) in pairs.items()
                         for side, flags in zip(("under_test", "gloo"), both, strict=True)}, EXACT)
    lines = []
    for pair, (_, _, compare) in pairs.items():
        tested_run, gloo_run = runs[f"{pair}/under_test"], runs[f"{pair}/gloo"]
        entry: dict[str, Any] = {"compared": compare, "under_test": tested_run.figures(),
                                 "gloo": gloo_run.figures()}
        ctx.put(pair, entry)
        if not ctx.check(f"{pair}_ran", tested_run.code == 0 and gloo_run.code == 0,
                         f"exit {tested_run.code} and {gloo_run.code}"):
            lines.append(f"{pair}: did not run")
            continue
        entry["parameters"] = compare_parameters(tested_run.final_model("ddp_final.pt"),
                                                 gloo_run.final_model("ddp_final.pt"))
        losses = tested_run.summary["final_loss"], gloo_run.summary["final_loss"]
        entry["final_losses"] = losses
        ctx.put(pair, entry)
        if compare == "parameters":
            ctx.check(f"{pair}_parameters_match", entry["parameters"]["within_tolerance"],
                      entry["parameters"])
        else:
            ctx.check(f"{pair}_loss_close", abs(losses[0] - losses[1]) <= LOSS_TOLERANCE * losses[1], losses)
        summary = tested_run.summary
        if ctx.cuda:  # rank 0 (whose summary this is) computes on its GPU in every pair
            ctx.check(f"{pair}_on_gpu", summary.get("device") == "cuda:0",
                      f"{summary.get('backend')} on {summary.get('device')}")
        lines.append(f"{pair} ({summary.get('backend')} on {summary.get('device')}): max |diff| "
                     f"{entry['parameters'].get('max_abs_diff', float('nan')):.1e}, loss {losses[0]:.4f} vs "
                     f"{losses[1]:.4f}")
    ctx.put("summary", "; ".join(lines))


PRECISION_FLAGS = ["ddp", "--dataset", "digits", "--model", "simplecnn", "--num-epochs", 1,
                   "--max-train-samples", 1024, "--max-test-samples", 256, "--batch-size", 32,
                   "--optimizer", "sgd", "--learning-rate", 0.05, "--seed", 0, "--num-threads", 1,
                   "--checkpoint-interval", 16, "--world-size", 1, "--timeout-s", 60]


def precision(ctx: Context) -> None:
    """fp16 (autocast and GradScaler) and bf16 against float32, one DDP rank on the device;
    float32 with a loader worker too (batches in pinned memory on CUDA) against without.
    `--device cpu`: gloo, and fp16 must be refused in one line (its loss scaling is CUDA's)."""
    backend = ["--backend", "nccl" if ctx.cuda else "gloo"]
    modes = {"fp32": ["--precision", "none"],
             "fp32_loader_worker": ["--precision", "none", "--loader-workers", 1],
             "bf16": ["--precision", "bf16"], "fp16": ["--precision", "fp16"]}
    runs = run_all(ctx, {name: PRECISION_FLAGS + backend + flags for name, flags in modes.items()}, EXACT)
    for name, run in runs.items():
        ctx.put(name, run.figures())
    if not ctx.cuda:
        refusal = runs.pop("fp16").output.strip().splitlines()
        ctx.check("fp16_refused_on_cpu", len(refusal) == 1 and "fp16" in refusal[0] and "CUDA" in refusal[0],
                  refusal[-3:])
    ran = {name: run for name, run in runs.items()
           if ctx.check(f"{name}_ran", run.code == 0, f"exit {run.code}")}
    if "fp32" not in ran:
        ctx.put("summary", "the float32 run failed: nothing to compare with")
        return
    reference = ran["fp32"].summary["final_loss"]
    for name, run in ran.items():
        loss = run.summary["final_loss"]
        ctx.check(f"{name}_loss_close", math.isfinite(loss) and abs(loss - reference) <= LOSS_TOLERANCE
                  * reference, {"final_loss": loss, "fp32_final_loss": reference})
        if ctx.cuda:
            ctx.check(f"{name}_on_gpu", run.summary.get("device") == "cuda:0", run.summary.get("device"))
    if "fp32_loader_worker" in ran:
        same = compare_parameters(ran["fp32_loader_worker"].final_model("ddp_final.pt"),
                                  ran["fp32"].final_model("ddp_final.pt"))
        ctx.check("loader_worker_same_parameters", same["within_tolerance"], same)
    scalers = {name: ran[name].last_checkpoint().get("grad_scaler")
               for name in ("fp16", "bf16") if name in ran}
    ctx.put("grad_scalers", scalers)
    if "fp16" in scalers:
        scale = (scalers["fp16"] or {}).get("scale")
        ctx.check("fp16_scaler_in_checkpoint", scale is not None and math.isfinite(scale) and scale > 0,
                  scalers["fp16"])
    if "bf16" in scalers:
        ctx.check("bf16_no_scaler", not scalers["bf16"], scalers["bf16"])
    losses = ", ".join(f"{name} {run.summary['final_loss']:.4f}" for name, run in ran.items())
    ctx.put("summary", f"final test loss {losses}" + (f"; fp16 loss scale {scalers['fp16'].get('scale')}"
                                                      if scalers.get("fp16") else ""))
