"""What each strategy's model reaches on real data: one MNIST epoch, SimpleCNN, the defaults.

The baseline, the parameter server (sync, ssp with staleness 2, async; 2 workers) and DDP
(2 ranks on gloo) each train one epoch of MNIST from the same config, then `disttrain
evaluate` reads each final model file. Reported per run: the final test accuracy, its
target, the time to each accuracy threshold, the samples processed, and whether the model
file gives the summary's accuracy. Targets: 98% for the baseline and DDP (the step of one
process on the whole batch), 97% for the parameter server's modes (SSP and async apply
stale gradients). "ratio" is the smallest accuracy / target over the runs (>= 1: every
target met). Data: MNIST when at hand; otherwise the shipped digits for 10 epochs (with
--quick: 3), where the targets are reported but are not MNIST's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import parse_args, report
from ps_helpers import data_dir

RUNS = {  # name: (command and its flags, the accuracy it must reach)
    "baseline": (["baseline"], 0.98),
    "ps_sync": (["ps", "--workers", "2", "--aggregation-mode", "sync"], 0.97),
    "ps_ssp": (["ps", "--workers", "2", "--aggregation-mode", "ssp", "--staleness", "2"], 0.97),
    "ps_async": (["ps", "--workers", "2", "--aggregation-mode", "async"], 0.97),
    "ddp": (["ddp", "--world-size", "2"], 0.98),
}
FINAL_MODEL = {"baseline": "baseline_final.pt", "ddp": "ddp_final.pt", "ps": "parameter_server_final.pt"}
DIGITS_EPOCHS = 10
QUICK_EPOCHS = 3


def run(name: str, data: list[str], epochs: int, folder: Path) -> dict:
    args, target = RUNS[name]
    command = [sys.executable, "-m", "disttrain", *args, *data, "--num-epochs", str(epochs),
               "--log-dir", str(folder / "logs"), "--checkpoint-dir", str(folder / "ckpt")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((folder / "logs" / "summary.json").read_text())
    model_file = folder / "ckpt" / FINAL_MODEL[args[0]]
    evaluated = subprocess.run([sys.executable, "-m", "disttrain", "evaluate", *data, str(model_file)],
                               capture_output=True, text=True, timeout=600)
    found = re.search(r"Test Accuracy: ([0-9.]+)%", evaluated.stdout)
    if evaluated.returncode != 0 or found is None:
        raise SystemExit(f"evaluate {model_file} failed:\n{evaluated.stderr[-3000:]}")
    accuracy = summary["final_accuracy"]
    return {"final_accuracy": round(accuracy, 4), "target": target,
            "meets_target": accuracy >= target,
            "evaluate_matches_summary": found.group(1) == f"{accuracy * 100:.2f}",
            "time_to_accuracy_s": summary["time_to_accuracy_s"],
            "train_time_s": round(summary["train_time_s"], 2),
            "samples_processed": summary["samples_processed"]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    found = None if args.quick else data_dir()
    if found is not None:
        data, epochs = ["--dataset", "mnist", "--data-dir", str(found)], 1
    else:
        data, epochs = ["--dataset", "digits"], QUICK_EPOCHS if args.quick else DIGITS_EPOCHS
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, data, epochs, Path(tmp) / name) for name in RUNS}
    report("accuracy", {"data": " ".join(data[:2]), "epochs": epochs, "runs": results,
                        "ratio": round(min(r["final_accuracy"] / r["target"] for r in results.values()), 4)},
           args.output, target="ratio >= 1 (every strategy's final accuracy at its target, MNIST)")


if __name__ == "__main__":
    main()
