"""Two workers of unequal speed: equal batches against batches in proportion to speed.

Worker (rank) 1 is slowed 3x by the fault harness (`slow:...:factor=3`: every step takes
three times as long). The ideal is the sum of each worker's solo speed, measured here as
a baseline run of one process, plain and slowed the same way. Then, on the same data:
DDP and the synchronous parameter server, each with equal batches (`--balance none`)
and in proportion to measured speed (`--balance proportional`). Reported for each: samples/s, its ratio to the
ideal, the epoch time, the final accuracy, and the samples trained (each exactly once).
Target: proportional reaches at least 0.85 of the ideal, where equal batches reach about
0.5. Data: MNIST, 1 epoch, when at hand; otherwise (and with --quick) digits, 2 epochs.

Then a straggler that appears mid-run: process 1 is slowed 3x from a third of the run to
two thirds (`slow:...:step=S:until=U`), with equal batches and with `--balance auto`
(re-planned every `--balance-interval` steps). From the metrics of process 0: the run's
samples/s before, during (and during, once re-planned) and after the slowdown, and the
steps from the slowdown (and from the recovery) to the re-plan.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import parse_args, report
from ps_helpers import data_dir

FACTOR = 3
GLOBAL_BATCH = 128  # the default batch of 64, times two processes
MIDRUN = {  # process 1 slowed between steps S and U (set from the run's length)
    "ps_sync_midrun_none": ["ps", "--workers", "2"],
    "ps_sync_midrun_auto": ["ps", "--workers", "2", "--balance", "auto"],
    "ddp_midrun_none": ["ddp", "--world-size", "2"],
    "ddp_midrun_auto": ["ddp", "--world-size", "2", "--balance", "auto"],
}
RUNS = {
    "solo_fast": ["baseline"],
    "solo_slow": ["baseline", "--inject", f"slow:worker=0:factor={FACTOR}"],
    "ddp_none": ["ddp", "--world-size", "2", "--inject", f"slow:rank=1:factor={FACTOR}"],
    "ddp_proportional": ["ddp", "--world-size", "2", "--balance", "proportional",
                         "--inject", f"slow:rank=1:factor={FACTOR}"],
    "ps_sync_none": ["ps", "--workers", "2", "--inject", f"slow:worker=1:factor={FACTOR}"],
    "ps_sync_proportional": ["ps", "--workers", "2", "--balance", "proportional",
                             "--inject", f"slow:worker=1:factor={FACTOR}"],
}


def run(name: str, data: list[str], epochs: int, folder: Path, args: list[str] | None = None) -> dict:
    command = [sys.executable, "-m", "disttrain", *(args or RUNS[name]), *data, "--num-epochs", str(epochs),
               "--num-threads", "1", "--log-dir", str(folder / "logs"),
               "--checkpoint-dir", str(folder / "ckpt")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((folder / "logs" / "summary.json").read_text())
    figures = {"samples_per_s": round(summary["throughput_samples_per_s"], 1),
               "epoch_time_s": round(summary["train_time_s"] / epochs, 3),
               "final_accuracy": round(summary["final_accuracy"], 4),
               "samples_trained": summary["samples_processed"]}
    if "samples_lost" in summary:
        figures["samples_lost"] = summary["samples_lost"]
    logs = [done.stderr, *(log.read_text() for log in (folder / "logs").glob("*.log"))]
    plan = [ln for text in logs for ln in text.splitlines() if " speeds " in ln and "batches" in ln]
    if plan:
        figures["plan"] = plan[-1][plan[-1].index("speeds"):]
    if "balance_plans" in summary:
        figures["plans"] = summary["balance_plans"]
    return figures


def phases(folder: Path, first: int, last: int, plans: list, steps_per_epoch: int) -> dict:
    """Samples/s of the run (global batches per second, from process 0's metrics windows)
    before step `first`, from it to `last`, from the first re-plan after `first` to `last`,
    and after `last`; and the steps from `first` and from `last` to the re-plans after them."""
    metrics = next(folder.glob("logs/*0/metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    points = [(r["step"], r["progress/train_time_s"]) for r in rows if "loss/train" in r]
    starts = [e * steps_per_epoch + i for e, i, _ in plans[1:]]
    replanned = next((s for s in starts if s >= first), None)
    recovered = next((s for s in starts if s >= last), None)

    def rate(lo: float, hi: float) -> float | None:
        inside = [(s, t) for s, t in points if lo <= s <= hi]
        if len(inside) < 2 or inside[-1][1] <= inside[0][1]:
            return None
        return round((inside[-1][0] - inside[0][0]) * GLOBAL_BATCH / (inside[-1][1] - inside[0][1]), 1)

    return {"before": rate(0, first), "during": rate(first, last),
            "during_replanned": rate(replanned, last) if replanned is not None else None,
            "after": rate(last, points[-1][0]), "slowed_from_step": first, "recovered_at_step": last,
            "replan_steps_after_slowdown": None if replanned is None else replanned - first,
            "replan_steps_after_recovery": None if recovered is None else recovered - last}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    found = None if args.quick else data_dir()
    data = ["--dataset", "mnist", "--data-dir", str(found)] if found else ["--dataset", "digits"]
    epochs = 1 if found else 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            folder = Path(tmp) / name
            results[name] = run(name, data, epochs, folder)
            print(f"{name:<18} {results[name]}", file=sys.stderr, flush=True)
        steps = results["ddp_none"]["samples_trained"] // GLOBAL_BATCH  # of the whole run
        first, last = steps // 3, 2 * steps // 3
        for name, command in MIDRUN.items():
            role = "worker" if command[0] == "ps" else "rank"
            folder = Path(tmp) / name
            results[name] = run(name, data, epochs, folder, [
                *command, "--inject", f"slow:{role}=1:factor={FACTOR}:step={first}:until={last}"])
            results[name]["phases"] = phases(folder, first, last, results[name].get("plans", [[0, 0]]),
                                             steps // epochs)
            results[name].pop("plans", None)  # the phases say what the plans did
            print(f"{name:<18} {results[name]['phases']}", file=sys.stderr, flush=True)
    ideal = results["solo_fast"]["samples_per_s"] + results["solo_slow"]["samples_per_s"]
    # What two equal, unslowed processes reach of twice one's solo speed on this machine
    # (the mid-run runs' first third): the most any split of the work can give here.
    for kind in ("ddp", "ps_sync"):
        before = results[f"{kind}_midrun_none"]["phases"]["before"]
        efficiency = round(before / (2 * results["solo_fast"]["samples_per_s"]), 3) if before else None
        for plan in ("none", "proportional"):
            figures = results[f"{kind}_{plan}"]
            figures["vs_ideal"] = round(figures["samples_per_s"] / ideal, 3)
            figures["equal_processes_vs_twice_solo"] = efficiency
            # null where the run was too short to measure that efficiency (--quick on digits)
            at_efficiency = round(figures["vs_ideal"] / efficiency, 3) if efficiency else None
            figures["vs_ideal_at_that_efficiency"] = at_efficiency
    report("heterogeneous", {"data": " ".join(data), "epochs": epochs, "slow_factor": FACTOR,
                             "ideal_samples_per_s": round(ideal, 1), "runs": results,
                             "ratio": max(results["ddp_proportional"]["vs_ideal"],
                                          results["ps_sync_proportional"]["vs_ideal"])},
           args.output, target="proportional >= 0.85 of the ideal (equal batches: about 0.5)")


if __name__ == "__main__":
    main()
