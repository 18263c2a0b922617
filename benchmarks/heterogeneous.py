"""Two workers of unequal speed: equal batches against batches in proportion to speed.

Worker (rank) 1 is slowed 3x by the fault harness (`slow:...:factor=3`: every step takes
three times as long). The ideal is the sum of each worker's solo speed, measured here as
a baseline run of one process, plain and slowed the same way. Then, on the same data:
DDP and the synchronous parameter server, each with equal batches (`--balance none`)
and in proportion to measured speed (`--balance proportional`). Reported for each: samples/s, its ratio to the
ideal, the epoch time, the final accuracy, and the samples trained (each exactly once).
Target: proportional reaches at least 0.85 of the ideal, where equal batches reach about
0.5. Data: MNIST, 1 epoch, when at hand; otherwise (and with --quick) digits, 4 epochs.
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


def run(name: str, data: list[str], epochs: int, folder: Path) -> dict:
    command = [sys.executable, "-m", "disttrain", *RUNS[name], *data, "--num-epochs", str(epochs),
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
    return figures


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    found = None if args.quick else data_dir()
    data = ["--dataset", "mnist", "--data-dir", str(found)] if found else ["--dataset", "digits"]
    epochs = 1 if found else 4
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            folder = Path(tmp) / name
            results[name] = run(name, data, epochs, folder)
            print(f"{name:<18} {results[name]}", file=sys.stderr, flush=True)
    ideal = results["solo_fast"]["samples_per_s"] + results["solo_slow"]["samples_per_s"]
    for name in ("ddp_none", "ddp_proportional", "ps_sync_none", "ps_sync_proportional"):
        results[name]["vs_ideal"] = round(results[name]["samples_per_s"] / ideal, 3)
    report("heterogeneous", {"data": " ".join(data), "epochs": epochs, "slow_factor": FACTOR,
                             "ideal_samples_per_s": round(ideal, 1), "runs": results,
                             "ratio": max(results["ddp_proportional"]["vs_ideal"],
                                          results["ps_sync_proportional"]["vs_ideal"])},
           args.output, target="proportional >= 0.85 of the ideal (equal batches: about 0.5)")


if __name__ == "__main__":
    main()
