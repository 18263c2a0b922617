"""Chaos benchmark of fault tolerance: the parameter server (faults vs none) and DDP (a
rank killed, live recovery vs torch's restart).

PS: one `disttrain ps` run fault-free, then the same run (same seed) under random faults.
DDP (`--strategies` holding ddp; the JSON's `ddp`, null without): see chaos_ddp.py.

Under chaos, once every worker has joined, a fault comes every `--fault-every` seconds
(0.5x-1.5x, seeded by `--chaos-seed`): a random live process of the run, found in the
coordinator's registry (<log_dir>/cluster.db, read-only), is SIGKILLed or SIGSTOPped (it
should be declared failed after `heartbeat_timeout` and restarted; one still stopped 3
timeouts later is sent SIGCONT and reported). No fault once a worker is done or past 90%
of the fault-free run's steps (registry heartbeats, or the workers' metrics.jsonl while
the coordinator is down), so the run can end; never the launcher.

Data: MNIST: `--data-dir FOLDER`, FOLDER holding `mnist/` with the four IDX `.gz` files
(e.g. `--data-dir ../shared/data`), else $DISTTRAIN_DATA_DIR, ./data, ../shared/data.
Without MNIST it says so and runs `--quick`: digits, 4 epochs, batch 1 (digits trains in
seconds: long enough for the faults to come while it trains), short heartbeats, a fault
every ~2 s, at most 4 faults: about half a minute.

Target: accuracy within 1 point of the fault-free run, no sample lost. Reported too: the
time ratio chaos / fault-free, the faults, each failure's detection and recovery seconds
(mean, max), findings. A chaos run that fails is reported with its log tails; exit 1.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_ddp import ddp_chaos
from common import parse_args, report

from disttrain.coordinator import RegistryError, read_status

REPO_ROOT = Path(__file__).resolve().parents[1]
KINDS = ("kill-worker", "stop-worker", "kill-server", "stop-server", "kill-coordinator", "stop-coordinator")
TICK_S = 0.25
STOP_PAST_PROGRESS = 0.9  # no fault in the last 10% of the steps
MAX_ACCURACY_DROP_POINTS = 1.0
SUMMARY_KEYS = ("final_accuracy", "total_time_s", "samples_applied", "samples_redone", "samples_lost",
                "num_failures", "failures", "max_round_wait_s")
# Flags passed to `disttrain ps` as they are: (type, default; None: the mode's or the config's).
PASSED = {"--num-epochs": (int, None), "--workers": (int, 2), "--servers": (int, 1),
          "--aggregation-mode": (str, "sync"), "--batch-size": (int, None), "--seed": (int, 42),
          "--max-restarts": (int, 10), "--heartbeat-interval": (float, None),
          "--heartbeat-timeout": (float, None)}
QUICK = {"num_epochs": 4, "batch_size": 1, "fault_every": 2.0, "max_faults": 4, "heartbeat_interval": 0.5,
         "heartbeat_timeout": 2.0}
FULL = {"num_epochs": 2, "batch_size": 64, "fault_every": 20.0, "max_faults": None}


def has_mnist(folder: Path | str | None) -> bool:
    return bool(folder) and (Path(folder) / "mnist" / "train-images-idx3-ubyte.gz").is_file()


def flags(parser) -> None:
    parser.add_argument("--data-dir", type=Path, help="folder holding mnist/ (its four IDX .gz files), "
                        "e.g. ../shared/data (default: $DISTTRAIN_DATA_DIR, ./data, ../shared/data)")
    for flag, (type_, default) in PASSED.items():
        key = flag[2:].replace("-", "_")
        mode = f"{FULL.get(key, 'the config')}; quick: {QUICK[key]}" if key in QUICK else default
        parser.add_argument(flag, type=type_, default=default, help=f"to disttrain ps (default {mode})")
    parser.add_argument("--fault-every", type=float, help="seconds between faults (default 20; quick 2)")
    parser.add_argument("--chaos-seed", type=int, default=0)
    parser.add_argument("--faults", default="kill-worker,stop-worker,kill-server,kill-coordinator",
                        help=f"comma-separated kinds among {', '.join(KINDS)}")
    parser.add_argument("--max-faults", type=int, help="default: no limit (quick: 4)")
    parser.add_argument("--strategies", default="ps,ddp",
                        help="comma-separated: ps (random faults in a PS run), ddp (a rank killed, live "
                             "recovery against restart; the JSON's `ddp`)")
    parser.add_argument("--work-dir", type=Path, help="the runs' logs and checkpoints, replaced each "
                        "time (default: chaos/ beside --output, else runs/bench/chaos)")


def resolve(args) -> None:
    """Fill the defaults of the mode in `args`; fall back to --quick without MNIST."""
    places = [args.data_dir] if args.data_dir else [os.environ.get("DISTTRAIN_DATA_DIR"),
                                                    REPO_ROOT / "data", REPO_ROOT.parent / "shared" / "data"]
    args.data_dir = next((Path(p) for p in places if has_mnist(p)), args.data_dir)
    if not args.quick and not has_mnist(args.data_dir):
        print(f"note: no MNIST at {args.data_dir or 'the default places'}; for the full benchmark pass "
              "--data-dir FOLDER holding mnist/ (e.g. ../shared/data). Running --quick.", file=sys.stderr)
        args.quick = True
    args.dataset = "digits" if args.quick else "mnist"
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.work_dir is None:  # `make bench-quick` keeps its runs apart from `make bench`'s
        args.work_dir = (args.output.parent if args.output else REPO_ROOT / "runs" / "bench") / "chaos"
    args.kinds = [k for k in args.faults.split(",") if k]
    if not args.kinds or set(args.kinds) - set(KINDS):
        raise SystemExit(f"--faults {args.faults!r}: choose among {', '.join(KINDS)}")
    args.strategies = [s for s in args.strategies.split(",") if s]
    if not args.strategies or set(args.strategies) - {"ps", "ddp"}:
        raise SystemExit(f"--strategies {','.join(args.strategies)!r}: choose among ps, ddp")


def ps_command(args, run_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "disttrain", "ps", "--dataset", args.dataset, "--num-threads", "1",
               "--log-dir", str(run_dir / "logs"), "--checkpoint-dir", str(run_dir / "ckpt")]
    if not args.quick:
        command += ["--data-dir", str(args.data_dir)]
    for flag in PASSED:
        if (value := getattr(args, flag[2:].replace("-", "_"))) is not None:
            command += [flag, str(value)]
    return command


def worker_step(log_dir: Path) -> int:
    """The furthest step any worker has logged (metrics.jsonl, flushed at checkpoints)."""
    lines = [ln for p in log_dir.glob("worker*/metrics.jsonl") for ln in p.read_text().splitlines()[-2:]]
    return max((json.loads(ln).get("step", 0) for ln in lines if ln.endswith("}")), default=0)


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def running_child(pid: int, launcher: int) -> bool:
    """Whether `pid` is a live, not stopped child of this run's launcher (never another)."""
    state = proc_state(pid)
    return state is not None and state[1] == launcher and state[0] not in "TtZX"


def coordinator_pids(launcher: int) -> list[int]:
    """The launcher's children running `disttrain coordinator` (it is not in the registry)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and running_child(int(entry.name), launcher) \
                    and (entry / "cmdline").read_bytes().split(b"\0")[3:4] == [b"coordinator"]:
                pids.append(int(entry.name))
        except OSError:
            continue  # it ended meanwhile
    return pids


@dataclass
class Chaos:
    """Injects faults into one run from a thread; `faults` records what it did."""

    rng: random.Random
    kinds: list[str]
    fault_every_s: float
    hang_s: float
    total_steps: int
    max_faults: int | None
    faults: list[dict[str, Any]] = field(default_factory=list)
    _hung: list[tuple[float, int, dict]] = field(default_factory=list)

    def run(self, launcher: subprocess.Popen, log_dir: Path, started: float) -> None:
        next_at, finishing = float("inf"), False
        while launcher.poll() is None:
            time.sleep(TICK_S)  # polling the registry, not synchronising with the run
            now = time.monotonic()
            self._release_hung(launcher.pid, now)
            try:
                nodes = read_status(log_dir / "cluster.db").nodes
            except RegistryError:
                continue  # being created, or busy: next tick
            workers = [n for n in nodes if n["role"] == "worker"]
            steps = max([worker_step(log_dir), *(n["step"] or 0 for n in workers)])  # either may lag
            finishing = finishing or any(n["state"] == "done" for n in workers) \
                or steps >= STOP_PAST_PROGRESS * self.total_steps \
                or (self.max_faults is not None and len(self.faults) >= self.max_faults)
            if finishing:
                continue
            if next_at == float("inf") and workers and all(n["state"] == "alive" for n in workers):
                next_at = now + self._gap()  # the clock starts once every worker has joined
            if now >= next_at and self._inject(launcher.pid, nodes, now - started, steps):
                next_at = now + self._gap()
        self._release_hung(launcher.pid, float("inf"))

    def _gap(self) -> float:
        return self.fault_every_s * self.rng.uniform(0.5, 1.5)

    def _inject(self, launcher: int, nodes: list[dict], elapsed_s: float, steps: int) -> bool:
        targets = {"coordinator": [("coordinator", pid) for pid in coordinator_pids(launcher)]}
        for n in nodes:
            if n["state"] == "alive" and n["pid"] and running_child(n["pid"], launcher):
                targets.setdefault(n["role"], []).append((n["node_id"], n["pid"]))
        options = {kind: sorted(targets[kind.split("-")[1]]) for kind in self.kinds
                   if targets.get(kind.split("-")[1])}
        if not options:
            return False
        kind = self.rng.choice(sorted(options))
        (process, pid), action = self.rng.choice(options[kind]), kind.split("-")[0]
        try:
            os.kill(pid, signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        except ProcessLookupError:
            return False  # it ended since the look: pick again at the next tick
        # Every record has the same keys (null where they do not apply): the JSON's shape
        # does not depend on which faults the dice chose (tools/bench_shapes.py).
        record = {"time_s": round(elapsed_s, 2), "kind": kind, "process": process, "pid": pid,
                  "worker_step": steps, "resumed_by_benchmark": False if action == "stop" else None}
        if action == "stop":
            self._hung.append((time.monotonic() + self.hang_s, pid, record))
        self.faults.append(record)
        print(f"chaos: {record}", file=sys.stderr, flush=True)
        return True

    def _release_hung(self, launcher: int, now: float) -> None:
        for due, pid, record in [h for h in self._hung if now >= h[0]]:
            self._hung.remove((due, pid, record))
            if proc_state(pid) == ("T", launcher):  # the run did not kill it: let it go on
                os.kill(pid, signal.SIGCONT)
                record["resumed_by_benchmark"] = True


def run_ps(args, name: str, chaos: Chaos | None = None, timeout_s: float = 3600) -> dict[str, Any]:
    """One `disttrain ps` run in <work-dir>/<name>; its summary, or how it failed."""
    run_dir = args.work_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    started = time.monotonic()
    with (run_dir / "launcher.log").open("w") as out:
        launcher = subprocess.Popen(ps_command(args, run_dir), stdout=out, stderr=subprocess.STDOUT)
        inject = chaos.run if chaos is not None else lambda *_: None
        thread = threading.Thread(target=inject, args=(launcher, run_dir / "logs", started))
        try:
            thread.start()
            launcher.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"{name}: still running after {timeout_s:.0f} s, killed", file=sys.stderr)
        finally:
            launcher.kill()  # a no-op once it ended; its children die with it
            thread.join()
    code = launcher.wait()
    result: dict[str, Any] = {"returncode": code, "wall_s": round(time.monotonic() - started, 2),
                              "log_dir": str(run_dir / "logs")}
    summary_path = run_dir / "logs" / "summary.json"
    if code != 0 or not summary_path.is_file():
        result["log_tails"] = tails(run_dir)
    if summary_path.is_file():  # worker 0 writes it, even when the run fails after
        summary = json.loads(summary_path.read_text())
        result.update({key: summary.get(key) for key in SUMMARY_KEYS}, steps=worker_step(run_dir / "logs"),
                      heartbeat_timeout_s=summary["config"]["coordinator"]["heartbeat_timeout"])
    return result


def tails(run_dir: Path, num_lines: int = 25) -> dict[str, list[str]]:
    """The last lines of the launcher's output and of each process's log (<name>.log)."""
    logs = [run_dir / "launcher.log", *sorted((run_dir / "logs").glob("*.log"))]
    return {p.name: p.read_text(errors="replace").splitlines()[-num_lines:] for p in logs if p.is_file()}


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "max": None}
    return {"mean": round(statistics.mean(values), 3), "max": round(max(values), 3)}


def findings(chaos_run: dict, faults: list[dict]) -> list[str]:
    """What went wrong under chaos, in words."""
    if chaos_run["returncode"] != 0 or "final_accuracy" not in chaos_run:
        return [f"the chaos run failed (exit {chaos_run['returncode']}) after {len(faults)} fault(s); "
                f"last fault: {faults[-1] if faults else None}; see chaos.log_tails"]
    found = [f"{chaos_run['samples_lost']} samples lost"] if chaos_run["samples_lost"] else []
    for process in sorted({f["process"] for f in faults + chaos_run["failures"]}):
        failed = [f["reason"] for f in chaos_run["failures"] if f["process"] == process]
        if len(failed) != (injected := sum(f["process"] == process for f in faults)):
            found.append(f"{process}: {injected} fault(s) injected, {len(failed)} failure(s): {failed}")
    return found + [f"{f['process']} stopped at {f['time_s']} s was never declared failed and killed; "
                    "the benchmark resumed it" for f in faults if f.get("resumed_by_benchmark")]


def ps_chaos(args) -> tuple[dict[str, Any], bool]:
    """The parameter server's part of the JSON, and whether its chaos run finished."""
    fault_free = run_ps(args, "fault-free")
    if fault_free["returncode"] != 0 or "final_accuracy" not in fault_free:
        raise SystemExit(f"the fault-free run failed: {fault_free}")
    chaos = Chaos(random.Random(args.chaos_seed), args.kinds, args.fault_every, max_faults=args.max_faults,
                  hang_s=3 * fault_free["heartbeat_timeout_s"], total_steps=fault_free["steps"])
    chaos_run = run_ps(args, "chaos", chaos, timeout_s=max(600.0, 10 * fault_free["wall_s"]))
    done = chaos_run["returncode"] == 0 and "final_accuracy" in chaos_run
    difference = 100 * (chaos_run["final_accuracy"] - fault_free["final_accuracy"]) if done else None
    failures = chaos_run.get("failures") or []
    return {
        "dataset": args.dataset, "quick": args.quick,
        "settings": {k: getattr(args, k) for k in (*QUICK, *(f[2:].replace("-", "_") for f in PASSED),
                                                    "chaos_seed", "kinds")},
        "accuracy_difference_points": round(difference, 2) if done else None,
        "samples_lost": chaos_run.get("samples_lost"),
        "time_ratio": round(chaos_run["total_time_s"] / fault_free["total_time_s"], 3) if done else None,
        "met": done and abs(difference) <= MAX_ACCURACY_DROP_POINTS and chaos_run["samples_lost"] == 0,
        "num_faults": len(chaos.faults), "faults": chaos.faults,
        "recovery": {key: spread([f[key] for f in failures if key in f])
                     for key in ("detect_s", "recover_s", "restart_s")},
        "findings": findings(chaos_run, chaos.faults), "fault_free": fault_free, "chaos": chaos_run,
    }, done


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], flags)
    resolve(args)
    result, done = ps_chaos(args) if "ps" in args.strategies else ({"quick": args.quick}, True)
    result["ddp"] = (ddp_chaos(args.quick, args.seed, args.chaos_seed, args.work_dir)
                     if "ddp" in args.strategies else None)
    report("chaos", result, args.output, target=f"PS: accuracy within {MAX_ACCURACY_DROP_POINTS} point of "
                                                "the fault-free run; 0 samples lost (DDP: see ddp.target)")
    ddp_done = result["ddp"] is None or all(
        run["returncode"] == 0 for part in ("live", "restart") for run in (result["ddp"][part]["fault_free"],
                                                                         result["ddp"][part]["killed"]))
    if not done or not ddp_done:
        sys.exit(1)


if __name__ == "__main__":
    main()
