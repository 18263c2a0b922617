"""One schedule against one real run: start it as a user would, send the timed faults from
outside, wait for it within a bound, check that every process it started was reaped, and
check the invariants; a run that stopped is resumed, fault-free, and must then finish.

Every process of a run carries a tag in its environment (`TAG_ENV`, inherited by every
child and grandchild), so the processes it left behind are found whatever started them.
Timed faults find their target's pid in the coordinator's registry and send it only to a
process that carries the run's tag.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.chaos import invariants
from disttrain.chaos.scenarios import Scenario
from disttrain.chaos.schedule import Schedule, TimedFault, restarts
from disttrain.coordinator.registry import RegistryError, read_status
from disttrain.core.fault_spec import format_fault

logger = logging.getLogger(__name__)

TAG_ENV = "DISTTRAIN_CHAOS_RUN"
TRAINING_SEED = 3  # every run of a scenario trains the same way; the schedule's seed draws its faults
REAP_GRACE_S = 15.0
POLL_S = 0.1


@dataclass
class Launch:
    """What one run did: its exit code, wall time, last line and leftovers."""

    code: int | None
    wall_s: float
    last_line: str
    leftovers: list[int] = field(default_factory=list)  # pids of the run still alive after it ended
    faults_sent: list[str] = field(default_factory=list)

    @property
    def timed_out(self) -> bool:
        return self.code is None


@dataclass
class Reference:
    """The fault-free runs of a scenario: what faulty runs are measured against (the
    accuracies of each, their median wall time, the final model of the first)."""

    accuracies: list[float]
    wall_s: float
    model: dict[str, Any] | None


def tagged_pids(tag: str) -> list[int]:
    """The live processes whose environment carries `tag` (zombies aside)."""
    needle = f"{TAG_ENV}={tag}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes() + b"\0" \
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


class TimedFaults:
    """Sends a schedule's timed faults to the processes of a run from a thread: the clock
    starts once every worker (rank) of the run is alive in the registry."""

    def __init__(self, scenario: Scenario, faults: tuple[TimedFault, ...], log_dir: Path, tag: str):
        self.scenario, self.faults, self.log_dir, self.tag = scenario, faults, log_dir, tag
        self.sent: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-timed-faults", daemon=True)

    def start(self) -> None:
        if self.faults:
            self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _nodes(self) -> list[dict[str, Any]]:
        try:
            return read_status(self.log_dir / "cluster.db").nodes
        except RegistryError:
            return []  # not there yet, or busy: the next poll

    def _run(self) -> None:
        trainers = {"worker", "rank"}
        started = None
        while started is None and not self._done.wait(POLL_S):
            nodes = [n for n in self._nodes() if n["role"] in trainers]
            if len(nodes) >= self.scenario.workers and all(n["state"] == "alive" for n in nodes):
                started = time.monotonic()
        for fault in self.faults:
            if self._done.wait(max(0.0, started + fault.at_s - time.monotonic()) if started else 0.0) \
                    or started is None:
                return
            self._send(fault)

    def _send(self, fault: TimedFault) -> None:
        node_id = f"{fault.role}{fault.index}"
        node = next((n for n in self._nodes() if n["node_id"] == node_id), None)
        pid = node["pid"] if node and node["state"] == "alive" else None
        if not pid or pid not in tagged_pids(self.tag):
            self.sent.append(f"{fault.describe()}: skipped, {node_id} not running")
            return
        try:
            os.kill(pid, signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
        except ProcessLookupError:
            self.sent.append(f"{fault.describe()}: skipped, {node_id} ended")
            return
        self.sent.append(f"{fault.describe()}: sent to pid {pid}")
        if fault.action == "stop":
            threading.Timer(fault.seconds, lambda: _continue(pid)).start()


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def launch(command: list[str], run_dir: Path, timeout_s: float, scenario: Scenario,
           timed: tuple[TimedFault, ...] = ()) -> Launch:
    """Run `command` (output in `run_dir`), sending `timed` faults; kill it past `timeout_s`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG_ENV: tag, "PYTHONUNBUFFERED": "1"}
    stdout, stderr = run_dir / "stdout.txt", run_dir / "stderr.txt"
    started = time.monotonic()
    with open(stdout, "ab") as out, open(stderr, "ab") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
        sender = TimedFaults(scenario, timed, run_dir / "logs", tag)
        sender.start()
        try:
            code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        finally:
            sender.stop()
    wall_s = time.monotonic() - started
    leftovers = _reap(tag)
    return Launch(code, wall_s, _last_line(stderr), leftovers, sender.sent)


def _reap(tag: str) -> list[int]:
    """The run's processes still alive `REAP_GRACE_S` after it ended (killed then)."""
    deadline = time.monotonic() + REAP_GRACE_S
    while (alive := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(POLL_S)  # polling the process table: no event tells of another tree's exits
    for pid in alive:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


def _summary(log_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((log_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def reference(scenario: Scenario, work_dir: Path) -> Reference:
    """Run `scenario` without faults, `scenario.references` times (the results kept in
    `work_dir` for later calls): an asynchronous mode's runs differ by the order pushes
    arrive in, so what a faulty run is measured against is the spread of several.

    Raises:
        RuntimeError: a fault-free run itself failed (its last line is named).
    """
    runs = []
    for number in range(scenario.references):
        run_dir = work_dir / "reference" / scenario.name / str(number)
        saved = run_dir / "reference.json"
        if not saved.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            done = launch(scenario.command_line(run_dir / "logs", run_dir / "ckpt", TRAINING_SEED), run_dir,
                          600.0, scenario)
            summary = _summary(run_dir / "logs")
            if done.code != 0 or summary is None:
                raise RuntimeError(f"the fault-free run of {scenario.name} failed (exit {done.code}): "
                                   f"{done.last_line}; see {run_dir}")
            saved.write_text(json.dumps({"accuracy": summary.get("final_accuracy"), "wall_s": done.wall_s}))
        runs.append(json.loads(saved.read_text()))
    _, model = invariants.check_final_model(scenario, work_dir / "reference" / scenario.name / "0" / "ckpt")
    return Reference([r["accuracy"] for r in runs if r["accuracy"] is not None],
                     statistics.median(r["wall_s"] for r in runs), model)


def bound_s(scenario: Scenario, schedule: Schedule, ref: Reference) -> float:
    """How long a run of `schedule` may take before it counts as hung."""
    waits = sum(f.seconds for f in schedule.faults) + sum(t.at_s for t in schedule.timed[-1:])
    return 60.0 + 6 * ref.wall_s + 3 * waits + 10.0 * (len(schedule.faults) + len(schedule.timed))


def run_schedule(scenario: Scenario, schedule: Schedule, work_dir: Path, ref: Reference,
                 keep: bool = False) -> dict[str, Any]:
    """Run `schedule` and check every invariant; the result as a JSON-ready dict (its
    `violations` empty when every invariant held). The run's folder is removed unless it
    broke an invariant or `keep`."""
    run_dir = work_dir / scenario.name / f"seed{schedule.seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    log_dir, checkpoint_dir = run_dir / "logs", run_dir / "ckpt"
    command = scenario.command_line(log_dir, checkpoint_dir, TRAINING_SEED)
    inject = [f"--inject={format_fault(f)}" for f in schedule.faults]
    limit = bound_s(scenario, schedule, ref)
    done = launch(command + inject, run_dir, limit, scenario, schedule.timed)
    result: dict[str, Any] = {
        "scenario": scenario.name, "seed": schedule.seed, "patterns": list(schedule.patterns),
        "schedule": schedule.lines(), "exit_code": done.code, "wall_s": round(done.wall_s, 2),
        "slowdown": round(done.wall_s / ref.wall_s, 2), "last_line": done.last_line,
        "timed_faults_sent": done.faults_sent, "resumed": False}
    violations = _process_violations(done, limit)
    if done.code is not None and done.code != 0 and not violations:
        violations += invariants.check_exit(done.code, done.last_line, False)
        if not violations:  # stopped with its reason: the command it names must finish the run
            result["resumed"] = True
            done = launch(command + ["--resume"], run_dir,
                          bound_s(scenario, Schedule(scenario.name, 0, ()), ref), scenario)
            violations += [f"resumed: {v}" for v in _process_violations(done, limit)]
    summary = _summary(log_dir)
    if done.code == 0:
        violations += invariants.check_exit(0, done.last_line, summary is not None)
        violations += _state_violations(scenario, schedule, run_dir, ref, summary)
    result.update(outcome=_outcome(result, violations), violations=violations,
                  accuracy=summary.get("final_accuracy") if summary else None,
                  num_failures=summary.get("num_failures") if summary else None,
                  longest_recovery_s=_longest_recovery(summary))
    if not violations and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _process_violations(done: Launch, limit: float) -> list[str]:
    problems = []
    if done.timed_out:
        problems.append(f"neither finished nor stopped within {limit:.0f}s (killed); its last line: "
                        f"{done.last_line!r}")
    if done.leftovers:
        problems.append(f"{len(done.leftovers)} process(es) of the run still alive {REAP_GRACE_S:g}s after "
                        f"it ended (pids {done.leftovers})")
    return problems


def _state_violations(scenario: Scenario, schedule: Schedule, run_dir: Path, ref: Reference,
                      summary: dict[str, Any] | None) -> list[str]:
    checkpoint_dir = run_dir / "ckpt"
    if scenario.command == "ps":
        reassigned = invariants.reassigned_workers(run_dir / "logs") if scenario.reassign else set()
        problems = invariants.check_ps_ledgers(scenario, checkpoint_dir, reassigned)
        problems += invariants.check_final_model(scenario, checkpoint_dir)[0]
    else:
        touched = {f.index for f in schedule.faults
                   if f.role == "rank" and restarts(f.action, f.seconds, scenario)}
        touched |= {t.index for t in schedule.timed}
        problems = invariants.check_ddp(scenario, checkpoint_dir, run_dir / "logs", ref.model, touched)
    accuracy = summary.get("final_accuracy") if summary else None
    return problems + invariants.check_accuracy(accuracy, ref.accuracies)


def _outcome(result: dict[str, Any], violations: list[str]) -> str:
    if violations:
        return "violated"
    return "stopped-then-resumed" if result["resumed"] else "finished"


def _longest_recovery(summary: dict[str, Any] | None) -> float | None:
    """The longest time from a failure to the run training again: a restarted process
    back at work (the coordinator's recovery records), or a live group's survivors
    training again (`live_resume_s`)."""
    summary = summary or {}
    times = [f.get("recover_s") for f in summary.get("failures", [])] + [summary.get("live_resume_s")]
    times = [t for t in times if t]
    return max(times) if times else None
