"""The restart budget of one supervised process: it tells a crash loop from a hostile world.

A process that dies after making progress is not crash-looping, whatever killed it: it
is restarted without spending its budget, and the budget is whole again. One that dies
before making any progress spends one restart; after `max_restarts` of those in a row the
run stops. So a run goes on as long as it makes progress, under any rate of kills, and a
process that cannot get anywhere still stops it within a bound. `max_restarts` 0 turns
restarts off: every failure stops the run.

A user's error is never retried as a fault. An error the process declares not recoverable
by a restart (`DisttrainError.recoverable` False: a bad config, data or checkpoint, a
diverged run) stops the run at once. An error the code did not expect (an exception from
a user's model, or a bug) may be a fault once; the same error at the same point on the
fresh start that follows is a bug, and stops the run at once too.

Progress is measured against the furthest point any earlier start of the process reached
(a worker's or rank's step, a shard's version, the furthest step a coordinator heard of,
a restarted DDP group's newest checkpoint), not against where this start resumed: a
process that resumes from its step-200 checkpoint and dies at step 215 every time has
made no progress on its second start, though it took 15 steps.

Pure: the supervisor tells it each start and each exit with the clock's reading, and what
the process reported (the furthest point it reached, the error it failed with); tests
step it by hand.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from disttrain.core import errors


@dataclass(frozen=True)
class ErrorReport:
    """The error a process reported on its way out.

    Attributes:
        kind: the exception's class name.
        message: its first line.
        recoverable: what the error says of itself: False, a restart would fail the same
            way (a user's error); True, a fault a restart may mend; None, not said (an
            exception the code did not expect).
    """

    kind: str
    message: str
    recoverable: bool | None = None

    def describe(self) -> str:
        return f"{self.kind}: {self.message}"


def error_class(kind: str) -> type[errors.DisttrainError] | None:
    """The project's error class named `kind` (`core.errors`), None for any other name: what
    a process's error report is read back as (whether a restart may mend it, its exit code)."""
    found = getattr(errors, kind, None)
    return found if isinstance(found, type) and issubclass(found, errors.DisttrainError) else None


class Decision(enum.Enum):
    RESTART = "restart"  # it made progress: restarted without spending the budget
    RESTART_SPENDING = "restart, spending"  # no progress: one restart of the budget spent
    STOP_CRASH_LOOP = "stop: crash loop"  # no progress, and the budget is spent
    STOP_USER_ERROR = "stop: user's error"  # it failed with an error a restart cannot mend
    STOP_REPEATED_ERROR = "stop: the same error again"  # the same unexpected error at the same point


def progressed(reached: int | None, furthest_before: int | None) -> bool:
    """True when `reached` lies past `furthest_before` (anything lies past nothing)."""
    return reached is not None and (furthest_before is None or reached > furthest_before)


@dataclass(frozen=True)
class Verdict:
    """What to do after one exit, and why.

    Attributes:
        decision: restart (spending or not) or stop.
        uptime_s: how long the start that ended ran.
        reached: the furthest point it reached (None: none at all).
        furthest_before: the furthest point of the starts before it (None: none).
        spent: restarts spent in a row without progress, this exit's included.
        max_restarts: the budget.
        error: the error it failed with, when it reported one.
    """

    decision: Decision
    uptime_s: float
    reached: int | None
    furthest_before: int | None
    spent: int
    max_restarts: int
    error: ErrorReport | None = None

    @property
    def restart(self) -> bool:
        return self.decision in (Decision.RESTART, Decision.RESTART_SPENDING)

    @property
    def progressed(self) -> bool:
        return progressed(self.reached, self.furthest_before)

    def progress_phrase(self, point: str = "step") -> str:
        """Where it got, against where the starts before it had got (`point`: what the
        points are, e.g. "step")."""
        if self.progressed:
            past = "" if self.furthest_before is None else f", past {point} {self.furthest_before}"
            return f"after reaching {point} {self.reached}{past}"
        if self.furthest_before is None:
            return "before making any progress"
        return f"without progress (never past {point} {self.furthest_before}, its furthest)"

    def restart_line(self, name: str, reason: str, budget_key: str, point: str = "step") -> str:
        """The log line of a restart, saying whether it spent the budget."""
        head = f"{name} {reason} {self.uptime_s:.1f}s after its start, {self.progress_phrase(point)}"
        if self.decision is Decision.RESTART:
            return (f"{head}: restarting it without spending its restart budget (it made progress; "
                    f"{budget_key}={self.max_restarts} counts restarts in a row without progress)")
        return (f"{head}: restarting it, restart {self.spent} of at most {self.max_restarts} in a row "
                f"without progress ({budget_key})")

    def stop_line(self, name: str, reason: str, budget_key: str, given_up: bool = False,
                  point: str = "step") -> str:
        """Why the run stops (or, `given_up`, goes on without the process): the process, the
        cause and what to do."""
        if self.decision is Decision.STOP_USER_ERROR:
            assert self.error is not None
            if "--resume" in self.error.message:  # the error says already how to go on (a store's line)
                return f"{name}: {self.error.message} (not restarted: a restart would fail the same way)"
            return (f"{name}: {self.error.message} (not restarted: a restart would fail the same way); fix "
                    "it, then run the same command with --resume")
        if self.decision is Decision.STOP_REPEATED_ERROR:
            assert self.error is not None
            where = "before its first step" if self.reached is None else f"after {point} {self.reached}"
            return (f"{name} failed with the same error {where} on a fresh start, so it is a bug, not a "
                    f"fault (not restarted again): {self.error.describe()}; fix it, then run the same "
                    "command with --resume")
        assert self.decision is Decision.STOP_CRASH_LOOP
        cause = reason if self.error is None else f"{reason} ({self.error.describe()})"
        if self.max_restarts == 0:
            head = f"{name} {cause}, and restarts are off ({budget_key}=0)"
        else:
            head = (f"{name} {cause} {self.progress_phrase(point)}, {self.spent + 1} time(s) in a row "
                    f"({budget_key}={self.max_restarts}): a crash loop")
        if given_up:
            return f"{head}; not started again"
        more = "" if self.max_restarts == 0 else f" (or raise {budget_key} if the machine is this hostile)"
        return (f"{head}; the cluster was stopped. Find the cause in its log, then continue with the "
                f"same command and --resume{more}")


@dataclass
class RestartBudget:
    """The restarts of one process (see the module's docstring).

    Call `started(now)` at each start, `exited(now, reached, error)` at each failure (an
    exit with code 0 is not a failure); a `restart` verdict means the caller starts it
    again, and calls `started` then.

    Args:
        max_restarts: restarts without progress allowed in a row; 0: none at all.
    """

    max_restarts: int
    furthest: int | None = None  # the furthest point any start reached
    spent: int = 0  # restarts spent in a row without progress
    started_at: float = 0.0
    # The unexpected error the previous start failed with, and its point.
    last_error: tuple[ErrorReport, int | None] | None = None

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, not {self.max_restarts}")

    def started(self, now: float) -> None:
        self.started_at = now

    def exited(self, now: float, reached: int | None, error: ErrorReport | None = None) -> Verdict:
        """Judge one failure.

        Args:
            now: the clock's reading (the same clock as `started`'s).
            reached: the furthest point the start that ended reported (None: none).
            error: the error it reported on its way out (None: none; killed by a signal,
                or it did not say).
        """
        before = self.furthest
        moved = progressed(reached, before)
        if moved:
            self.furthest = reached
        previous = self.last_error
        unexpected = error is not None and error.recoverable is None
        self.last_error = (error, reached) if unexpected else None
        if error is not None and error.recoverable is False:
            decision = Decision.STOP_USER_ERROR
        elif unexpected and previous == (error, reached):
            decision = Decision.STOP_REPEATED_ERROR
        elif self.max_restarts == 0:
            decision = Decision.STOP_CRASH_LOOP
        elif moved:
            self.spent = 0
            decision = Decision.RESTART
        elif self.spent < self.max_restarts:
            self.spent += 1
            decision = Decision.RESTART_SPENDING
        else:
            decision = Decision.STOP_CRASH_LOOP
        return Verdict(decision, max(0.0, now - self.started_at), reached, before, self.spent,
                       self.max_restarts, error)
