"""The GPU check's DDP steps, each a few `disttrain ddp` runs at once, as a user runs them:
the NCCL backend against gloo (`ddp_backends`) and mixed precision against float32
(`precision`). `--device cpu` runs their CPU counterparts."""

from __future__ import annotations

import math
from typing import Any

import torch
from gpu_runs import EXACT, Context, Run, compare_parameters, run_all

LOSS_TOLERANCE = 0.1  # relative: a compressed run ends within 10% of the same run's loss on gloo


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


# Mixed precision is judged by the whole run, not by one early loss. The first GPU run
# compared the final test loss after 32 steps within 10%: bf16 0.853 and fp16 0.848 against
# float32's 1.032 failed it. After 32 steps SimpleCNN is half-way down its steep fall
# (about 0.1 of loss a step), where that loss is a matter of chance: the same float32 run
# with its dropout masks alone drawn anew ends anywhere from 0.79 to 0.97 (seven draws, on
# the CPU), with other seeds from 0.79 to 1.43. And PyTorch's CUDA dropout kernel hands
# each thread 16 bytes (8 elements of a 2-byte tensor, 4 of a float32 one), so from one
# seed autocast and float32 draw different masks (bf16 and fp16 draw the same ones, and
# agreed to 0.7%). Over 128 steps, the mean of every step's training loss (the curve as a
# whole) varied by at most 12% and the final test accuracy by 6.3 points over seeds, mask
# draws and bf16 or float32 (22 runs on the CPU); a broken mixed-precision path (fp16
# gradients applied unscaled, a loss that does not fall) is off by far more.
PRECISION_EPOCHS = 4  # 128 steps of 32 samples
CURVE_TOLERANCE = 0.2  # relative, on the mean training loss over every step
ACCURACY_BAND = 0.1  # absolute, on the final test accuracy

PRECISION_FLAGS = ["ddp", "--dataset", "digits", "--model", "simplecnn", "--num-epochs", PRECISION_EPOCHS,
                   "--max-train-samples", 1024, "--max-test-samples", 256, "--batch-size", 32,
                   "--optimizer", "sgd", "--learning-rate", 0.05, "--seed", 0, "--num-threads", 1,
                   "--checkpoint-interval", 32, "--world-size", 1, "--timeout-s", 60,
                   "--set", "training.log_interval=1"]


def precision_figures(run: Run) -> dict[str, Any]:
    """A run's curve and end: the mean of every step's training loss, the means of its four
    quarters (the curve's shape), and the final test loss and accuracy."""
    losses = run.training_losses()
    quarter = max(len(losses) // 4, 1)
    summary = run.summary
    return {"mean_train_loss": sum(losses) / len(losses) if losses else math.nan,
            "train_loss_by_quarter": [sum(part) / len(part) for i in range(0, len(losses), quarter)
                                      if (part := losses[i:i + quarter])],
            "final_loss": summary.get("final_loss", math.nan),
            "final_accuracy": summary.get("final_accuracy", math.nan)}


def compare_precision(run: dict[str, Any], reference: dict[str, Any]) -> dict[str, tuple[bool, dict]]:
    """`run`'s `precision_figures` against float32's: the mean training loss within
    CURVE_TOLERANCE, the final test accuracy within ACCURACY_BAND, every figure finite.
    Returns each check's (ok, detail)."""
    curve, reference_curve = run["mean_train_loss"], reference["mean_train_loss"]
    accuracy, reference_accuracy = run["final_accuracy"], reference["final_accuracy"]
    finite = all(math.isfinite(run[key]) and math.isfinite(reference[key])
                 for key in ("mean_train_loss", "final_loss", "final_accuracy"))
    return {
        "curve_close": (finite and abs(curve - reference_curve) <= CURVE_TOLERANCE * reference_curve,
                        {"mean_train_loss": curve, "fp32_mean_train_loss": reference_curve,
                         "tolerance": CURVE_TOLERANCE}),
        "accuracy_close": (finite and abs(accuracy - reference_accuracy) <= ACCURACY_BAND,
                           {"final_accuracy": accuracy, "fp32_final_accuracy": reference_accuracy,
                            "final_loss": run["final_loss"], "fp32_final_loss": reference["final_loss"],
                            "band": ACCURACY_BAND}),
    }


def precision(ctx: Context) -> None:
    """fp16 (autocast and GradScaler) and bf16 against float32, one DDP rank on the device,
    each run's training curve and final accuracy compared (see CURVE_TOLERANCE); float32
    with a loader worker too (batches in pinned memory on CUDA), whose final parameters
    must equal float32's. `--device cpu`: gloo, and fp16 must be refused in one line (its
    loss scaling is CUDA's)."""
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
    figures = {name: precision_figures(run) for name, run in ran.items()}
    for name, run in ran.items():
        ctx.put(name, {**run.figures(), **figures[name]})
        if name != "fp32":
            for check, (ok, detail) in compare_precision(figures[name], figures["fp32"]).items():
                ctx.check(f"{name}_{check}", ok, detail)
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
    steps = ran["fp32"].summary.get("steps")
    curves = ", ".join(f"{name} {f['mean_train_loss']:.3f}" for name, f in figures.items())
    ends = ", ".join(f"{name} {f['final_loss']:.4f} ({f['final_accuracy']:.1%})"
                     for name, f in figures.items())
    ctx.put("summary", f"mean train loss over {steps} steps {curves}; final test loss {ends}"
                       + (f"; fp16 loss scale {scalers['fp16'].get('scale')}" if scalers.get("fp16") else ""))
