"""A live elastic DDP group's changes sent from outside, as a scheduler sends them
(`LiveChangeSender`): arrivals (a `disttrain ddp ... --join --rdzv-endpoint HOST:PORT`
launcher started with the address the run's launcher logged), planned leaves (SIGTERM to a
member rank, or to an arrival's launcher) and deaths (SIGKILL to a member rank).

Each change is sent once the group trains on the size before it (its newest generation, as
every member logs it, has that many ranks, and that many rank processes of the launch are
alive: none joining or restarting) and a member has reported the change's step. Where the
group could end before a change lands, it is held: its leader is stopped (SIGSTOP; the
others wait for it in their next collective, their liveness beats going on) until the
arrival, or the killed rank started again, has asked to join, then continued. A group of
one left by a death is not held: below its minimum it trains nothing until the rank rejoins.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from disttrain.chaos.elastic import JOIN, KILL, LiveChange
from disttrain.chaos.outside import POLL_S, Sender, members, tagged_pids
from disttrain.core import forking

# What the run's launcher, and every member of a generation, log (`ddp.live`).
JOIN_LINE = re.compile(r"--join --rdzv-endpoint (\S+)`")
GENERATION = re.compile(r"generation (\d+) trains from step \d+ \(epoch \d+, batch \d+\) on (\d+) rank")
ASKS = "slot {slot} asks to join the running group"
HOLD_LIMIT_S = 120.0  # the longest a group is held for a rank to ask to join (then let go)
ARRIVAL_END_S = 60.0  # how long an arrival's launcher may take to end after the run's


@dataclass
class Arrival:
    """A `--join` launcher the sender started: its process, log folder and output."""

    process: subprocess.Popen | forking.ForkedProcess
    log_dir: Path
    output: Path


def rank_pids(tag: str) -> dict[int, int]:
    """slot -> pid of the live rank processes of the launch tagged `tag`, arrivals' included."""
    found = {}
    for pid in tagged_pids(tag):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"disttrain.torchrun" in argv and b"--rank" in argv[:-1]:
            found[int(argv[argv.index(b"--rank") + 1])] = pid
    return found


class LiveChangeSender(Sender):
    """Sends a live elastic group's `changes` one after the other from a thread (see the
    module docstring); `arrival_command(log_dir, endpoint)`: the command of an arrival."""

    def __init__(self, changes: tuple[LiveChange, ...], arrival_command: Callable[[Path, str], list[str]],
                 run_dir: Path, tag: str, env: dict[str, str]):
        super().__init__("chaos-live-changes", bool(changes))
        self.changes, self.arrival_command, self.run_dir, self.tag, self.env = \
            changes, arrival_command, run_dir, tag, env
        self.sent: list[str] = []  # what was sent, to which pid, at which step
        self.arrivals: dict[int, Arrival] = {}  # by the slot its rank takes
        self.arrival_codes: dict[int, int | None] = {}  # each arrival's exit code (None: killed)

    def stop(self) -> None:
        """Stop sending, then wait for the arrivals' launchers to end (killed past `ARRIVAL_END_S`)."""
        super().stop()
        for slot, arrival in self.arrivals.items():
            try:
                self.arrival_codes[slot] = arrival.process.wait(timeout=ARRIVAL_END_S)
            except subprocess.TimeoutExpired:
                arrival.process.kill()
                arrival.process.wait()
                self.arrival_codes[slot] = None

    def _run(self) -> None:
        needed = 0  # the generation the group must have reached before the next change
        for change in self.changes:
            while True:
                if self._done.wait(POLL_S):
                    return
                generation, size = self._newest()
                reached = max((n["step"] or 0 for n in members(self.run_dir / "logs", self.tag).values()),
                              default=-1)
                if generation >= needed and size == change.before == len(rank_pids(self.tag)) \
                        and reached >= change.step and self._endpoint():
                    break
            what = self._send(change)
            if what is None:
                return
            sizes = change.describe().rsplit(", ", 1)[1].removesuffix(" (from outside)")
            self.sent.append(f"resize at step {change.step}: {what} at step {reached}, {sizes}")
            needed = generation + len(change.sizes)

    def _send(self, change: LiveChange) -> str | None:
        """Send `change`; what was sent to which pid (None: the rank or launcher was gone)."""
        pids = rank_pids(self.tag)
        if change.action == JOIN:
            with _Hold(pids[min(pids)]):
                arrival = self._arrive(change.slot)
                self._wait_for(lambda: _count(arrival.log_dir / f"rank{change.slot}.log", change.slot) > 0
                               or arrival.process.poll() is not None)
            return f"arrival started (pid {arrival.process.pid})"
        if change.action == KILL:
            asked = _count(self._log_of(change.slot), change.slot)
            generation, _ = self._newest()
            if not _signal(pids.get(change.slot), signal.SIGKILL):
                return None
            if change.size - 1 > 1:  # the survivors train on: held until it asks to join again
                self._wait_for(lambda: self._newest()[0] > generation)
                survivors = {slot: pid for slot, pid in rank_pids(self.tag).items() if slot != change.slot}
                with _Hold(survivors[min(survivors)]):
                    self._wait_for(lambda: _count(self._log_of(change.slot), change.slot) > asked)
            return f"SIGKILL to rank {change.slot} (pid {pids[change.slot]})"
        if change.to_launcher:
            process = self.arrivals[change.slot].process
            return f"SIGTERM to the launcher of slot {change.slot} (pid {process.pid})" \
                if _signal(process.pid, signal.SIGTERM) else None
        return f"SIGTERM to rank {change.slot} (pid {pids.get(change.slot)})" \
            if _signal(pids.get(change.slot), signal.SIGTERM) else None

    def _arrive(self, slot: int) -> Arrival:
        folder = self.run_dir / f"arrival-slot{slot}"
        folder.mkdir(parents=True, exist_ok=True)
        output = folder / "output.txt"
        with output.open("ab") as sink:
            process = forking.start(self.arrival_command(folder / "logs", self._endpoint() or ""), self.env,
                                    sink.fileno(), sink.fileno())
        self.arrivals[slot] = Arrival(process, folder / "logs", output)
        return self.arrivals[slot]

    def _wait_for(self, condition: Callable[[], bool]) -> None:
        """Until `condition` holds, the sender is stopped, or `HOLD_LIMIT_S` passed."""
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not condition() and time.monotonic() < deadline and not self._done.wait(POLL_S):
            pass

    def _endpoint(self) -> str | None:
        """The run's store address for arrivals, from its launcher's log."""
        for name in ("stderr.txt", "stdout.txt"):
            try:
                found = JOIN_LINE.search((self.run_dir / name).read_text(errors="replace"))
            except OSError:
                continue
            if found:
                return found.group(1)
        return None

    def _log_dirs(self) -> list[Path]:
        return [self.run_dir / "logs", *(arrival.log_dir for arrival in self.arrivals.values())]

    def _log_of(self, slot: int) -> Path:
        arrival = self.arrivals.get(slot)
        return (arrival.log_dir if arrival else self.run_dir / "logs") / f"rank{slot}.log"

    def _newest(self) -> tuple[int, int]:
        """(generation, size) of the group's newest generation any member has logged; (-1, 0)
        before the first."""
        newest = (-1, 0)
        for folder in self._log_dirs():
            for log in folder.glob("rank*.log"):
                try:
                    text = log.read_text(errors="replace")
                except OSError:
                    continue
                newest = max([newest, *((int(g), int(n)) for g, n in GENERATION.findall(text))])
        return newest


class _Hold:
    """Stops process `pid` (SIGSTOP) for the `with` block, and continues it after."""

    def __init__(self, pid: int):
        self.pid = pid

    def __enter__(self) -> _Hold:
        _signal(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        _signal(self.pid, signal.SIGCONT)


def _signal(pid: int | None, signum: int) -> bool:
    """Whether `signum` reached process `pid` (not when there is none, or it ended)."""
    if pid is None:
        return False
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


def _count(log: Path, slot: int) -> int:
    """How many times slot `slot` asked to join the group, by its log."""
    try:
        return log.read_text(errors="replace").count(ASKS.format(slot=slot))
    except OSError:
        return 0
