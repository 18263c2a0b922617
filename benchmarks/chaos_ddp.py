"""The DDP part of the chaos benchmark (imported by chaos.py): a rank SIGKILLed mid-epoch,
under live recovery (`--ddp-recovery live`) and under torch's elastic restart, in one run.

Four `disttrain ddp` runs of 3 ranks on the shipped digits, the same seed: live and
restart, each fault-free and with rank R killed after its step S (R and S drawn from the
chaos seed; S between 10% and 30% of the run's steps). Rank 0 straggles in every run
(`slow:rank=0:factor=F`, or rank 1 when rank 0 is the one killed), so that a run outlasts
the killed rank's new process starting up: under live recovery it then rejoins. The
restart runs checkpoint every `checkpoint_interval` steps, which bounds the work they redo.

Reported per recovery: accuracy against its fault-free run, the time ratio killed /
fault-free, and from the summaries: for live, the seconds to detect the death, re-form the
group, train again and take the rank back, the survivors' process ids (unchanged) and the
ledger (samples applied, lost, twice); for restart, the restarts and the steps redone.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORLD_SIZE, BATCH = 3, 16
QUICK = {"num_epochs": 6, "factor": 10.0, "checkpoint_interval": 20}
FULL = {"num_epochs": 12, "factor": 10.0, "checkpoint_interval": 20}
LIVE_KEYS = ("live_detect_s", "live_reform_s", "live_resume_s", "live_rejoin_s", "num_rejoins",
             "samples_applied", "samples_lost", "samples_applied_twice", "samples_redone")
RESTART_KEYS = ("restarts", "resumed_from_step")


def settings(quick: bool, seed: int, chaos_seed: int) -> dict[str, Any]:
    """What the four runs share, and the kill drawn from `chaos_seed`."""
    mode = QUICK if quick else FULL
    steps = mode["num_epochs"] * steps_per_epoch()
    rng = random.Random(chaos_seed)
    killed = rng.randrange(WORLD_SIZE)
    return {**mode, "seed": seed, "world_size": WORLD_SIZE, "batch_size": BATCH, "steps": steps,
            "killed_rank": killed, "kill_step": rng.randint(int(0.1 * steps), int(0.3 * steps)),
            "straggler": 1 if killed == 0 else 0}


def steps_per_epoch() -> int:
    from disttrain.config import TrainingConfig
    from disttrain.data import load_datasets
    train_set, _ = load_datasets(TrainingConfig(dataset="digits"))
    return len(train_set) // (BATCH * WORLD_SIZE)


def command(run: dict[str, Any], run_dir: Path, recovery: str, kill: bool) -> list[str]:
    faults = [f"slow:rank={run['straggler']}:factor={run['factor']:g}"]
    if kill:
        faults.append(f"kill:rank={run['killed_rank']}:step={run['kill_step']}")
    return [sys.executable, "-m", "disttrain", "ddp", "--world-size", str(WORLD_SIZE), "--dataset", "digits",
            "--ddp-recovery", recovery, "--num-epochs", str(run["num_epochs"]), "--batch-size", str(BATCH),
            "--seed", str(run["seed"]), "--num-threads", "1", "--max-restarts", "1", "--timeout-s", "60",
            "--checkpoint-interval", str(run["checkpoint_interval"]),
            "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.003",
            "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=1",
            "--log-dir", str(run_dir / "logs"), "--checkpoint-dir", str(run_dir / "ckpt"),
            *(f"--inject={fault}" for fault in faults)]


def run_ddp(run: dict[str, Any], work_dir: Path, recovery: str, kill: bool) -> dict[str, Any]:
    """One run; its figures, or how it failed (with its log tails)."""
    name = f"ddp-{recovery}-{'killed' if kill else 'fault-free'}"
    run_dir = work_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    started = time.monotonic()
    result = subprocess.run(command(run, run_dir, recovery, kill), capture_output=True, text=True,
                            timeout=1800)
    (run_dir / "launcher.log").write_text(result.stdout + result.stderr)
    figures: dict[str, Any] = {"returncode": result.returncode,
                               "wall_s": round(time.monotonic() - started, 2)}
    summary_path = run_dir / "logs" / "summary.json"
    if result.returncode != 0 or not summary_path.is_file():
        figures["log_tail"] = (result.stdout + result.stderr).splitlines()[-25:]
        return figures
    summary = json.loads(summary_path.read_text())
    figures.update({key: summary.get(key) for key in ("final_accuracy", "total_time_s", "train_time_s",
                                                       "steps")})
    figures.update({key: summary.get(key) for key in (LIVE_KEYS if recovery == "live" else RESTART_KEYS)})
    if recovery == "live":
        pids = summary["rank_pids"]
        figures["survivors_kept_their_process"] = all(
            len(pids[str(slot)]) == 1 for slot in range(WORLD_SIZE) if not kill or slot != run["killed_rank"])
    else:
        resumed = summary.get("resumed_from_step")
        figures["steps_redone"] = None if resumed is None or not kill else run["kill_step"] - resumed
    return figures


def compare(fault_free: dict[str, Any], killed: dict[str, Any]) -> dict[str, Any]:
    """The killed run against its fault-free one (nulls when either failed)."""
    done = all(r["returncode"] == 0 and r.get("final_accuracy") is not None for r in (fault_free, killed))
    difference = 100 * (killed["final_accuracy"] - fault_free["final_accuracy"]) if done else None
    return {"accuracy_difference_points": round(difference, 2) if done else None,
            "time_ratio": round(killed["total_time_s"] / fault_free["total_time_s"], 3) if done else None,
            "fault_free": fault_free, "killed": killed}


def ddp_chaos(quick: bool, seed: int, chaos_seed: int, work_dir: Path) -> dict[str, Any]:
    """The DDP section of the chaos benchmark's JSON."""
    run = settings(quick, seed, chaos_seed)
    live = compare(run_ddp(run, work_dir, "live", False), run_ddp(run, work_dir, "live", True))
    restart = compare(run_ddp(run, work_dir, "restart", False), run_ddp(run, work_dir, "restart", True))
    killed = live["killed"]
    difference = live["accuracy_difference_points"]
    met = (difference is not None and abs(difference) <= 0.5 and killed.get("samples_lost") == 0
           and killed.get("samples_applied_twice") == 0 and bool(killed.get("survivors_kept_their_process"))
           and (killed.get("live_resume_s") or 1e9) < 10 and (killed.get("num_rejoins") or 0) >= 1)
    return {"settings": run, "live": live, "restart": restart, "met": met,
            "target": "live: accuracy within 0.5 point of its fault-free run, no sample lost or applied "
                      "twice, survivors never restarted, training again within 10 s, the rank rejoined"}
