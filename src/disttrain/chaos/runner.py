"""One schedule against one real run: start it as a user would, send the timed faults from
outside, wait for it within a bound, check that every process it started was reaped, and
check the invariants; a run that stopped is resumed, fault-free, and must then finish.

A schedule with preemptions runs as a chain of launches: each launch is sent its
preemption (`outside.PreemptionSender`), must stop with exit code 143 and a last line
naming `--resume`, and is resumed with `--resume` on the number of workers (ranks) the
preemption drew; the invariants are checked once the chain has finished, over what every
launch left on disk (the ledgers carry every launch's samples).

An elastic run's changes of size are sent to its one launch (`outside.ResizeSender`); the
sizes it went through are read from its launcher's log (each change says the size it
starts again on), and the invariants checked against the size it ended on. A live elastic
DDP group's arrivals, leaves and deaths (`arrivals.LiveChangeSender`) start `--join`
launchers beside the run's, which must end exit 0 with it; the sizes it trained at are its
summary's (`live_world_sizes`).

Every process of a run carries a tag in its environment (`outside.TAG_ENV`, inherited by
every child and grandchild), so the processes it left behind are found whatever started
them. Timed faults find their target's pid in the coordinator's registry and send it only
to a process that carries the launch's tag.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.chaos import invariants
from disttrain.chaos.arrivals import LiveChangeSender
from disttrain.chaos.elastic import KILL, LiveChange, Resize, live_sizes
from disttrain.chaos.outside import POLL_S, TAG_ENV, PreemptionSender, ResizeSender, TimedFaults, tagged_pids
from disttrain.chaos.scenarios import Scenario
from disttrain.chaos.schedule import Preemption, Schedule, TimedFault, restarts
from disttrain.core import forking
from disttrain.core.fault_spec import Fault, format_fault

logger = logging.getLogger(__name__)

TRAINING_SEED = 3  # every run of a scenario trains the same way; the schedule's seed draws its faults
REAP_GRACE_S = 15.0


@dataclass
class Launch:
    """What one run did: its exit code, wall time, last line and leftovers."""

    code: int | None
    wall_s: float
    last_line: str
    leftovers: list[int] = field(default_factory=list)  # pids of the run still alive after it ended
    faults_sent: list[str] = field(default_factory=list)
    preempted: str | None = None  # the preemption sent to it (what, to which pid, at which step)
    resizes_sent: list[str] = field(default_factory=list)
    resized_to: list[int] = field(default_factory=list)  # an elastic run's sizes after each change
    arrival_codes: dict[int, int | None] = field(default_factory=dict)  # a live group's arrivals' exits

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


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


@dataclass(frozen=True)
class FromOutside:
    """What one launch is sent from outside while it runs: `timed` faults, a `preemption`,
    `resizes` and `live_changes` (none: a fault-free launch)."""

    timed: tuple[TimedFault, ...] = ()
    preemption: Preemption | None = None
    resizes: tuple[Resize, ...] = ()
    live_changes: tuple[LiveChange, ...] = ()


def launch(command: list[str], run_dir: Path, timeout_s: float, scenario: Scenario,
           outside: FromOutside = FromOutside()) -> Launch:
    """Run `command` (output in `run_dir`), sending it what comes from `outside`; kill it
    past `timeout_s`."""
    timed, preemption, resizes, live_changes = (outside.timed, outside.preemption, outside.resizes,
                                                outside.live_changes)
    run_dir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG_ENV: tag, "PYTHONUNBUFFERED": "1"}
    stdout, stderr = run_dir / "stdout.txt", run_dir / "stderr.txt"
    started = time.monotonic()
    offset = stderr.stat().st_size if stderr.exists() else 0
    with open(stdout, "ab") as out, open(stderr, "ab") as err:
        process = forking.start(command, env, out.fileno(), err.fileno())
        sender = TimedFaults(scenario, timed, run_dir / "logs", tag)
        preempter = PreemptionSender(preemption, process.pid, run_dir / "logs", tag)
        resizer = ResizeSender(resizes, process.pid, run_dir / "logs", tag)
        changer = LiveChangeSender(live_changes, lambda logs, at: arrival_command(scenario, run_dir, logs,
                                                                                      at),
                                   run_dir, tag, env)
        senders = (sender, preempter, resizer, changer)
        for each in senders:
            each.start()
        try:
            code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        finally:
            for each in senders:
                each.stop()
    wall_s = time.monotonic() - started
    leftovers = _reap(tag)
    with open(stderr, "rb") as err:
        err.seek(offset)
        said = err.read().decode(errors="replace")
    return Launch(code, wall_s, _last_line(stderr), leftovers, sender.sent, preempter.sent,
                  resizer.sent + changer.sent, [int(size) for size in RESIZED.findall(said)],
                  changer.arrival_codes)


def arrival_command(scenario: Scenario, run_dir: Path, log_dir: Path, endpoint: str) -> list[str]:
    """The command of an arrival into a live elastic run of `scenario` in `run_dir` (its
    settings, its checkpoint folder, its own `log_dir`; no fault of the run's)."""
    line = scenario.command_line(log_dir, run_dir / "ckpt", TRAINING_SEED)
    line = [part for part in line if not part.startswith("--inject")]
    return line + ["--join", "--rdzv-endpoint", endpoint]


# What an elastic run's launcher says at each change of size (`ps.run.launcher`).
RESIZED = re.compile(r"starting it again on (\d+) workers from them")


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
    return 60.0 + 6 * ref.wall_s + 3 * waits + 10.0 * (len(schedule.faults) + len(schedule.timed)) \
        + 30.0 * len(schedule.resizes) + 60.0 * len(schedule.live_changes)


def run_schedule(scenario: Scenario, schedule: Schedule, work_dir: Path, ref: Reference,
                 keep: bool = False) -> dict[str, Any]:
    """Run `schedule` and check every invariant; the result as a JSON-ready dict (its
    `violations` empty when every invariant held). The run's folder is removed unless it
    broke an invariant or `keep`."""
    run_dir = work_dir / scenario.name / f"seed{schedule.seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    chain = _Chain(scenario, schedule, run_dir, ref)
    first = chain.run()
    result: dict[str, Any] = {
        "scenario": scenario.name, "seed": schedule.seed, "patterns": list(schedule.patterns),
        "schedule": schedule.lines(), "exit_code": chain.last.code, "wall_s": round(chain.wall_s, 2),
        "slowdown": round(chain.wall_s / ref.wall_s, 2), "last_line": chain.last.last_line,
        "timed_faults_sent": first.faults_sent, "resumed": chain.resumed,
        "preemptions_sent": chain.preemptions_sent, "launches": chain.launches}
    if schedule.resizes:
        result.update(resizes_sent=first.resizes_sent, sizes=chain.sizes)
    violations = chain.violations
    summary = _summary(run_dir / "logs")
    if schedule.live_changes:
        result.update(resizes_sent=first.resizes_sent, sizes=(summary or {}).get("live_world_sizes"),
                      arrival_exit_codes=first.arrival_codes)
    if not violations and chain.last.code == 0:
        violations += invariants.check_exit(0, chain.last.last_line, summary is not None)
        violations += _state_violations(scenario, schedule, run_dir, ref, summary, chain.sizes)
        if schedule.live_changes:
            violations += live_size_violations(scenario, schedule, len(first.resizes_sent), result["sizes"])
    result.update(outcome=_outcome(result, violations), violations=violations,
                  accuracy=summary.get("final_accuracy") if summary else None,
                  num_failures=summary.get("num_failures") if summary else None,
                  longest_recovery_s=_longest_recovery(summary))
    if not violations and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


PREEMPTED_EXIT = 143  # 128 + SIGTERM: what a preempted launcher exits with


class _Chain:
    """The launches of one schedule: the first with its faults; each one preempted (or
    stopped with a reason) resumed with `--resume`, on the size its preemption drew."""

    def __init__(self, scenario: Scenario, schedule: Schedule, run_dir: Path, ref: Reference):
        self.scenario, self.schedule, self.run_dir, self.ref = scenario, schedule, run_dir, ref
        self.sizes = [scenario.workers]  # the workers (ranks) of each launch
        self.launches: list[dict[str, Any]] = []
        self.violations: list[str] = []
        self.preemptions_sent: list[str] = []
        self.resumed = False  # stopped with a reason (not a preemption) and resumed
        self.wall_s = 0.0
        self.last: Launch

    def run(self) -> Launch:
        """Run the launches until one finishes or breaks an invariant; the first launch."""
        scenario, schedule = self.scenario, self.schedule
        pending = list(schedule.preemptions)
        inject = [f"--inject={format_fault(f)}" for f in schedule.faults]
        timed, resume, first = schedule.timed, False, None
        for number in range(len(pending) + 2):  # each preemption, a stop with a reason, the end
            preemption = pending[0] if pending else None
            command = scenario.command_line(self.run_dir / "logs", self.run_dir / "ckpt", TRAINING_SEED,
                                            self.sizes[-1]) + (["--resume"] if resume else inject)
            if schedule.preemptions:
                command += slowed_flags(scenario, () if resume else schedule.faults)
            limit = bound_s(scenario, schedule if number == 0 else Schedule(scenario.name, 0, ()), self.ref)
            outside = (FromOutside(preemption=preemption) if resume else
                       FromOutside(timed, preemption, schedule.resizes, schedule.live_changes))
            self.last = done = launch(command, self.run_dir, limit, scenario, outside)
            first = first or done
            self.wall_s += done.wall_s
            if done.preempted is not None:  # a run may also end within the grace, exit 0
                self.preemptions_sent.append(done.preempted)
            self.launches.append({"workers": self.sizes[-1], "exit_code": done.code,
                                  "wall_s": round(done.wall_s, 2), "last_line": done.last_line,
                                  "preempted": done.preempted})
            if schedule.resizes:
                self.launches[-1]["resized_to"] = done.resized_to
            self.sizes += done.resized_to
            prefix = f"launch {number + 1}: " if schedule.preemptions or number else ""
            problems = _process_violations(done, limit) + resize_violations(done, resume, schedule) \
                + arrival_violations(done)
            if not problems and done.code not in (0, None):
                problems = self._stopped(done, preemption, pending)
            if problems or done.code == 0:
                self.violations += [prefix + problem for problem in problems]
                return first
            resume = True
        self.violations.append(f"not finished after {len(self.launches)} launches; the last said "
                               f"{self.last.last_line!r}")
        return first

    def _stopped(self, done: Launch, preemption: Preemption | None, pending: list[Preemption]) -> list[str]:
        """A launch that stopped: preempted (exit 143, resumed on the drawn size), or with a
        reason (resumed once, fault-free); what it broke, if anything."""
        problems = invariants.check_exit(done.code, done.last_line, False)
        if done.preempted is not None:
            assert preemption is not None
            pending.pop(0)
            if done.code != PREEMPTED_EXIT:
                problems.insert(0, f"preempted ({done.preempted}) but exited {done.code}, not "
                                   f"{PREEMPTED_EXIT}: {done.last_line!r}")
            self.sizes.append(preemption.size)
        elif self.resumed:
            problems.append(f"stopped a second time (exit {done.code}) without a preemption: "
                            f"{done.last_line!r}")
        else:
            self.resumed = True
            # A `--resume` of an elastic run goes on on MIN workers.
            self.sizes.append(self.scenario.workers if self.scenario.max_workers else self.sizes[-1])
        return problems


def slowed_flags(scenario: Scenario, faults: tuple[Fault, ...]) -> list[str]:
    """The `--inject` flags that slow every member of a preempted launch by the scenario's
    `preempted_slowdown`, on its first start and on each start a fault of `faults` brings
    about (a restart by a kill from outside, unplanned, runs at full speed: a preemption
    then may find the run ended first, which is no violation)."""
    if scenario.preempted_slowdown == 1.0:
        return []
    role, factor = scenario.member_role, scenario.preempted_slowdown
    attempts = {0} | {f.attempt + 1 for f in faults
                      if f.role == role and restarts(f.action, f.seconds, scenario)}
    return [f"--inject={format_fault(Fault('slow', role=role, factor=factor, attempt=attempt))}"
            for attempt in sorted(attempts)]


def resize_violations(done: Launch, resumed: bool, schedule: Schedule) -> list[str]:
    """An elastic launch changed size once for each change sent to it, and to the size it
    asked for; the last change may come after the run's last step (it ends first, on the
    size before: no violation)."""
    if resumed or not schedule.resizes or done.code != 0:
        return []
    wanted = [resize.size for resize in schedule.resizes[:len(done.resizes_sent)]]
    if done.resized_to == wanted or (done.resized_to == wanted[:-1] and len(wanted) == len(schedule.resizes)):
        return []
    return [f"sent {len(done.resizes_sent)} change(s) of size ({', '.join(done.resizes_sent) or 'none'}), "
            f"and the run went to {done.resized_to or 'no other size'}, not {wanted}"]


def arrival_violations(done: Launch) -> list[str]:
    """Every arrival's launcher of a live elastic run ended exit 0 (its rank left, or the
    run ended), within `arrivals.ARRIVAL_END_S` of the run's."""
    return [f"the arrival's launcher of slot {slot} " + ("did not end after the run (killed)" if code is None
                                                          else f"exited {code}, not 0")
            for slot, code in sorted(done.arrival_codes.items()) if code != 0]


def live_size_violations(scenario: Scenario, schedule: Schedule, sent: int, sizes: list[int] | None
                         ) -> list[str]:
    """A live elastic group trained at the sizes its first `sent` changes lead to, in order
    (its summary's `live_world_sizes`); the last change may come after the run's last step
    boundary (the run ends first: without it, or a killed rank's rejoining)."""
    wanted = live_sizes(scenario.workers, schedule.live_changes[:sent])
    before = live_sizes(scenario.workers, schedule.live_changes[:sent - 1]) if sent else wanted
    ended_first = [before, wanted[:-1]]
    if sizes == wanted or sizes in ended_first:
        return []
    return [f"sent {sent} change(s) of the group, which trained at sizes {sizes}, not {wanted}"]


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
                      summary: dict[str, Any] | None, sizes: list[int]) -> list[str]:
    """The invariants of what the run (every launch of it) left on disk; `sizes`: the
    workers (ranks) of each launch."""
    checkpoint_dir = run_dir / "ckpt"
    resized = len(set(sizes)) > 1
    if scenario.command == "ps":
        reassigned = invariants.reassigned_workers(run_dir / "logs") if scenario.reassign else set()
        problems = invariants.check_ps_ledgers(scenario, checkpoint_dir, reassigned, workers=sizes[-1],
                                               end_step=scenario.total_steps if len(sizes) > 1 else None)
        final, model = invariants.check_final_model(scenario, checkpoint_dir)
        problems += final
        if scenario.exact_resume and len(sizes) > 1 and not resized and not schedule.faults \
                and not schedule.timed:
            problems += invariants.check_identical(model, ref.model, "a sync run preempted and resumed")
    else:
        touched = {f.index for f in schedule.faults
                   if f.role == "rank" and restarts(f.action, f.seconds, scenario)}
        touched |= {t.index for t in schedule.timed}
        killed = {c.slot for c in schedule.live_changes if c.action == KILL}
        expect = invariants.DdpExpectation(frozenset(touched), exact=scenario.exact and not resized,
                                           registry=not schedule.live_changes)
        problems = invariants.check_ddp(scenario, checkpoint_dir, run_dir / "logs", ref.model, expect)
        if schedule.live_changes:
            problems += invariants.check_live_end(scenario, summary, killed)
        if resized:
            problems += invariants.check_ddp_end(scenario, checkpoint_dir, summary, sizes[-1])
    accuracy = summary.get("final_accuracy") if summary else None
    return problems + invariants.check_accuracy(accuracy, ref.accuracies, scenario.accuracy_gap)


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
