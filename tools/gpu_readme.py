"""Write the GPU figures of docs/benchmarks.md from a GPU check's JSON (tools/gpu_check.sh's output).

    python tools/gpu_readme.py [benchmarks/results/gpu_check_h200.json]

The figures stand between `<!-- gpu-check:begin -->` and `<!-- gpu-check:end -->` in the
page's "On a GPU" section;
tests/unit/test_gpu_readme.py fails while they differ from `render` of the committed run.
Every figure comes from the JSON: what ran on which machine, each step's status, the
NCCL-against-gloo agreement, the precision runs, the parameter-server wire and the
workloads' samples/s.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from markers import write_block

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "docs" / "benchmarks.md"
RESULT = REPO_ROOT / "benchmarks" / "results" / "gpu_check_h200.json"
BEGIN, END = "<!-- gpu-check:begin -->\n", "<!-- gpu-check:end -->\n"
WIDTH = 90  # the docs' line length
STEP_ORDER = ("gpu_tests", "ddp_backends", "precision", "ps_wire", "workloads")
WORKLOAD_COLUMNS = ("ddp_per_gpu", "baseline", "ddp", "ps_sync", "ps_async")


def _machine(report: dict[str, Any]) -> str:
    host = report["host"]
    device = host["devices"][0]
    return (f"One {device['name']} ({device['memory_gib']} GiB), {host['cpu_count']} CPU cores, torch "
            f"{host['torch']}, CUDA {host['cuda']}, NCCL {host['nccl']}, Python {host['python']}; "
            f"{report['started'][:10]}, {report['total_s']:.0f} s of the check's {report['budget_s']:.0f} s.")


def _failed_checks(step: dict[str, Any]) -> str:
    failed = [name for name, check in step["figures"]["checks"].items() if not check["ok"]]
    return f" (failed: {', '.join(f'`{name}`' for name in failed)})" if failed else ""


def _ddp_backends(step: dict[str, Any]) -> str:
    parts = []
    for pair, entry in step["figures"].items():
        if not isinstance(entry, dict) or "under_test" not in entry:
            continue
        tested, gloo = entry["under_test"], entry["gloo"]
        failed = [f"the {side} run failed (exit {run['exit_code']})"
                  for side, run in (("tested", tested), ("gloo", gloo)) if run.get("exit_code")]
        if failed:
            parts.append(f"`{pair}`: {', '.join(failed)}")
            continue
        same = f"{tested['final_loss']:.4f}" == f"{gloo['final_loss']:.4f}"
        losses = f"{tested['final_loss']:.4f}" + (" both" if same else f" vs {gloo['final_loss']:.4f}")
        parts.append(f"`{pair}` ({tested['backend']} on {tested['device']}, {tested['world_size']} "
                     f"rank{'s' if tested['world_size'] > 1 else ''}, {tested['steps']} steps) "
                     f"{entry['parameters']['max_abs_diff']:.1e}, final loss {losses}")
    return ("max \\|diff\\| of the final parameters against the same run over gloo on the CPU: "
            + "; ".join(parts) + _failed_checks(step))


def _precision(step: dict[str, Any]) -> str:
    figures = step["figures"]
    runs = [name for name in ("fp32", "fp32_loader_worker", "bf16", "fp16") if name in figures]
    steps = figures[runs[0]]["steps"]
    losses = ", ".join(f"{name} {figures[name]['final_loss']:.4f} ({figures[name]['final_accuracy']:.1%}"
                       + (f", mean training loss {figures[name]['mean_train_loss']:.3f}"
                          if "mean_train_loss" in figures[name] else "") + ")"
                       for name in runs if "final_loss" in figures[name])
    scaler = (figures.get("grad_scalers") or {}).get("fp16") or {}
    scale = f"; fp16 loss scale {scaler['scale']:.0f}" if "scale" in scaler else ""
    return f"final test loss (accuracy) after {steps} steps: {losses}{scale}" + _failed_checks(step)


def _ps_wire(step: dict[str, Any]) -> str:
    exchanges = step["figures"]["exchanges"]
    floats = next(e["parameters"] for e in exchanges.values() if isinstance(e, dict))
    exact = all(e["max_abs_diff"] == 0 for e in exchanges.values() if isinstance(e, dict))
    rate = {name: f"{exchange['gb_per_s']:.2f}" for name, exchange in exchanges.items()
            if isinstance(exchange, dict)}
    return (f"{floats:,} floats pushed and pulled{' exactly' if exact else ''}: gRPC "
            f"{rate['grpc_cuda']} GB/s from CUDA tensors, {rate['grpc_cpu']} from CPU ones; shared memory "
            f"(`auto`) {rate['auto_cuda']} and {rate['auto_cpu']}")


def _gpu_tests(step: dict[str, Any]) -> str:
    counts = step["figures"]["counts"]
    return f"{counts['passed']} of {sum(counts.values())} tests marked gpu passed"


DESCRIBE = {"gpu_tests": _gpu_tests, "ddp_backends": _ddp_backends, "precision": _precision,
            "ps_wire": _ps_wire}


def _workloads(step: dict[str, Any], num_gpus: int) -> list[str]:
    results = step["figures"]["results"]
    lines = ["| model | plain loop on the GPU | large batch | " + " | ".join(WORKLOAD_COLUMNS) + " |",
             "|---" * (3 + len(WORKLOAD_COLUMNS)) + "|"]
    for model, result in results.items():
        plain, large = result["plain"], result["plain_large_batch"]
        ratios = [f"{s['ratio_to_plain']:.2f}x" if "ratio_to_plain" in s else s.get("status", "-")
                  for s in (result["strategies"].get(name, {}) for name in WORKLOAD_COLUMNS)]
        lines.append(f"| {model} | {plain['samples_per_s']:.0f}/s (batch {plain['batch']}) | "
                     f"{large['samples_per_s']:.0f}/s (batch {large['batch']}) | {' | '.join(ratios)} |")
    strategies = next(iter(results.values()))["strategies"]
    per_gpu, ddp = strategies.get("ddp_per_gpu", {}), strategies.get("ddp", {})
    note = step["figures"].get("note", "")
    text = (f"Each strategy's samples/s over the plain loop's at the same batch. ddp_per_gpu: "
            f"{per_gpu.get('processes')} rank over {per_gpu.get('backend')} on "
            f"{per_gpu.get('rank0_device')}; "
            f"ddp: {ddp.get('processes')} ranks as `auto` chose them, over {ddp.get('backend')}, rank 0 on "
            f"{ddp.get('rank0_device')}")
    if ddp.get("processes", 0) > num_gpus:
        text += f" and {ddp['processes'] - num_gpus} on the CPU ({num_gpus} GPU for {ddp['processes']} ranks)"
    text += f". {note[:1].upper()}{note[1:]}." if note else "."
    return [*lines, "", *textwrap.wrap(text, WIDTH)]


def render(report: dict[str, Any]) -> str:
    """The page's GPU figures (markdown) from a GPU check's JSON."""
    lines = [*textwrap.wrap(_machine(report), WIDTH), "", "| step | status | figures |", "|---|---|---|"]
    for name in STEP_ORDER:
        step = report["steps"].get(name)
        if step is None:
            continue
        describe = DESCRIBE.get(name)
        text = describe(step) if describe and step.get("figures") else step.get("summary", "")
        lines.append(f"| {name} | {step['status']} | {'below' if name == 'workloads' else text} |")
    if "workloads" in report["steps"]:
        lines += ["", *_workloads(report["steps"]["workloads"], report["host"].get("device_count", 0))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result = Path(argv[0]) if argv else RESULT
    if not write_block(PAGE, BEGIN, END, render(json.loads(result.read_text()))):
        return 1
    print(f"wrote the GPU figures of {result} into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
