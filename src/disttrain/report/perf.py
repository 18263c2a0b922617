"""The consolidated performance report: the strategies side by side from their run
artifacts, and each worker's or rank's figures with their spread.

Speed-up and scaling efficiency are measured as in a comparison (`figures`): samples/s
over the baseline's, and that per worker. A strategy given only by its per-process
artifacts (no ps.json or ddp.json) is summed from them: samples over the longest
training clock, accuracy (a language model's perplexity) from the process that evaluates.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from disttrain.report.artifacts import BASELINE, DDP, PS
from disttrain.report.figures import scaling_efficiency, speedup
from disttrain.report.runs import finite
from disttrain.report.table import human_bytes, number, percent, seconds

REPORT_KIND = "perf_report"
REPORT_VERSION = 1
PROCESS_FIELDS = ("process", "samples", "train_time_s", "samples_per_s", "step_time_s", "compute_s",
                  "comm_blocked_s", "compression_s", "comm_share", "wire_bytes_per_step", "final_accuracy")


@dataclass
class Artifacts:
    """The artifacts a report is made from (each checked by `artifacts.load_artifact`).

    Attributes:
        sources: artifact kind -> the files it was read from, for the report's `inputs`.
    """

    baseline: dict[str, Any] | None = None
    ps: dict[str, Any] | None = None
    ddp: dict[str, Any] | None = None
    workers: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    sources: dict[str, list[str]] = field(default_factory=dict)


def perf_report(artifacts: Artifacts) -> dict[str, Any]:
    """The report as a JSON-ready dict: version, kind, created, inputs, baseline (its
    samples/s), strategies (one entry each) and processes (per strategy: each worker's or
    rank's figures and their spread)."""
    strategies = [entry for entry in (
        _run_entry(BASELINE, artifacts.baseline, []),
        _run_entry(PS, artifacts.ps, artifacts.workers),
        _run_entry(DDP, artifacts.ddp, artifacts.ranks),
    ) if entry is not None]
    base = next((entry for entry in strategies if entry["kind"] == BASELINE), None)
    for entry in strategies:
        if base is not None and entry["samples_per_s"] is not None:
            entry["speedup"] = speedup(entry["samples_per_s"], base["samples_per_s"])
            entry["scaling_efficiency"] = scaling_efficiency(entry["speedup"], entry["workers"])
    processes = {kind: {"processes": [{name: digest.get(name) for name in PROCESS_FIELDS}
                                      for digest in digests],
                        "spread": spread(digests)}
                 for kind, digests in ((PS, artifacts.workers), (DDP, artifacts.ranks)) if digests}
    return {"version": REPORT_VERSION, "kind": REPORT_KIND,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "inputs": artifacts.sources, "baseline_samples_per_s": base["samples_per_s"] if base else None,
            "strategies": strategies, "processes": processes}


def _run_entry(kind: str, run: dict[str, Any] | None, digests: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A strategy's entry from its run artifact, else summed from its processes' digests."""
    if run is not None:
        return {"name": run["strategy"], "kind": kind, "from": "run", "workers": int(run["world_size"]),
                "final_accuracy": finite(run["final_accuracy"]), "final_loss": finite(run["final_loss"]),
                "total_time_s": finite(run["total_time_s"]), "train_time_s": finite(run["train_time_s"]),
                "samples": int(run["samples_processed"]),
                "samples_per_s": finite(run["throughput_samples_per_s"]),
                "speedup": None, "scaling_efficiency": None,
                "time_to_accuracy_s": run.get("time_to_accuracy_s"),
                "final_perplexity": finite(run.get("final_perplexity")),  # a language model's
                "time_to_perplexity_s": run.get("time_to_perplexity_s"),
                "compression_ratio": finite(run.get("compression_ratio")),
                "recovery_events": int(run.get("num_failures") or 0)}
    if not digests:
        return None
    samples = sum(digest["samples"] for digest in digests)
    train_time_s = max((digest["train_time_s"] or 0.0 for digest in digests), default=0.0)
    evaluating = [digest for digest in digests
                  if digest.get("evaluates") or digest.get("final_accuracy") is not None]
    return {"name": digests[0].get("strategy", kind), "kind": kind, "from": "processes",
            "workers": len(digests),
            "final_accuracy": evaluating[0]["final_accuracy"] if evaluating else None,
            "final_loss": evaluating[0].get("final_loss") if evaluating else None,
            "final_perplexity": evaluating[0].get("final_perplexity") if evaluating else None,
            "total_time_s": None, "train_time_s": train_time_s or None, "samples": int(samples),
            "samples_per_s": samples / train_time_s if train_time_s else None,
            "speedup": None, "scaling_efficiency": None, "time_to_accuracy_s": None,
            "time_to_perplexity_s": None, "compression_ratio": None, "recovery_events": None}


def spread(digests: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How far apart the processes are: the slowest and fastest by samples/s, and the
    smallest and largest of each figure. None when no process has a samples/s."""
    rated = [digest for digest in digests if digest.get("samples_per_s")]
    if not rated:
        return None
    slowest = min(rated, key=lambda digest: digest["samples_per_s"])
    fastest = max(rated, key=lambda digest: digest["samples_per_s"])
    figures: dict[str, Any] = {"slowest": slowest["process"], "fastest": fastest["process"],
                               "fastest_over_slowest": fastest["samples_per_s"] / slowest["samples_per_s"]}
    for name in ("samples_per_s", "step_time_s", "comm_share", "wire_bytes_per_step"):
        values = [digest[name] for digest in digests if digest.get(name) is not None]
        figures[name] = {"min": min(values), "max": max(values)} if values else None
    return figures


def perf_table(report: dict[str, Any]) -> str:
    """The report as the command prints it: the strategies, then each process (a language
    model's perplexity in place of accuracy)."""
    perplexity = any(e.get("final_perplexity") is not None for e in report["strategies"])
    lines = [_aligned([("strategy", "workers", "ppl" if perplexity else "acc", "total", "train", "samples/s",
                        "speed-up", "eff")] + [
        (e["name"], str(e["workers"]),
         number(e.get("final_perplexity"), ".3f") if perplexity else percent(e["final_accuracy"]),
         seconds(e["total_time_s"]),
         seconds(e["train_time_s"]), number(e["samples_per_s"], ".0f"), number(e["speedup"], ".2f", "x"),
         percent(e["scaling_efficiency"], ".0f")) for e in report["strategies"]])]
    for kind, group in report["processes"].items():
        rows = [("process", "samples/s", "step", "comm", "B/step")] + [
            (p["process"], number(p["samples_per_s"], ".0f"), _ms(p["step_time_s"]),
             percent(p["comm_share"], ".0f"), human_bytes(p["wire_bytes_per_step"]))
            for p in group["processes"]]
        lines += ["", f"{kind}:", _aligned(rows)]
        if group["spread"]:
            s = group["spread"]
            lines.append(f"slowest {s['slowest']}, fastest {s['fastest']}: "
                         f"{s['fastest_over_slowest']:.2f}x samples/s apart")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}ms"


def _aligned(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(row, widths, strict=True))).rstrip() for row in rows)
