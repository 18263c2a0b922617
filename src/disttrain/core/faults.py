"""Fault injection at exact points, for tests and drills: `--inject-fault kill@step=30`.

A fault fires in the process whose rank matches (any rank when none is given), on the
given restart attempt only (0 = the first run).

- `kill@step=N`: at step N the process sends itself SIGKILL: no cleanup, no atexit,
  exactly as a machine loss looks to everyone else.
- `slow-eval@seconds=S`: every evaluation takes S seconds longer, so a test can show
  that evaluation stays off the training clock.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# action -> (required field, its type)
ACTIONS = {"kill": ("step", int), "slow-eval": ("seconds", float)}
FIELDS = {"step": int, "seconds": float, "rank": int, "attempt": int}


@dataclass(frozen=True)
class Fault:
    action: str
    step: int = 0
    seconds: float = 0.0
    rank: int | None = None
    attempt: int = 0


def parse_fault(text: str) -> Fault:
    """Parse `ACTION@FIELD=VALUE[,rank=R][,attempt=A]`.

    Raises:
        ValueError: the text does not follow that form.
    """
    action, sep, rest = text.partition("@")
    forms = ", ".join(f"{name}@{field}=N" for name, (field, _) in ACTIONS.items())
    if action not in ACTIONS or not sep:
        raise ValueError(f"--inject-fault {text!r}: expected one of {forms} "
                         "(optionally followed by ,rank=R,attempt=A)")
    values: dict[str, int | float] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        try:
            values[key] = FIELDS[key](value) if eq else None
        except (KeyError, ValueError):
            values[key] = None
        if values[key] is None or values[key] < 0:
            raise ValueError(f"--inject-fault {text!r}: bad part {part!r}")
    required, _ = ACTIONS[action]
    if required not in values:
        raise ValueError(f"--inject-fault {text!r}: {required}=N is required for {action}")
    return Fault(action, **values)


def format_fault(fault: Fault) -> str:
    """The text `parse_fault` reads back as `fault` (to hand faults to child processes)."""
    field, _ = ACTIONS[fault.action]
    parts = [f"{field}={getattr(fault, field)}"]
    if fault.rank is not None:
        parts.append(f"rank={fault.rank}")
    parts.append(f"attempt={fault.attempt}")
    return f"{fault.action}@{','.join(parts)}"


class FaultInjector:
    """Holds the faults meant for this process; the training loop calls `at_step(step)`
    after each step and `at_evaluation()` inside each evaluation."""

    def __init__(self, faults: list[Fault] | tuple[Fault, ...] = (), rank: int = 0, attempt: int = 0):
        self._faults = [f for f in faults
                        if (f.rank is None or f.rank == rank) and f.attempt == attempt]

    def at_step(self, step: int) -> None:
        for fault in self._faults:
            if fault.action == "kill" and fault.step == step:
                logger.warning("injected fault: kill at step %d", step)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    def at_evaluation(self) -> None:
        for fault in self._faults:
            if fault.action == "slow-eval":
                logger.warning("injected fault: evaluation slowed by %gs", fault.seconds)
                time.sleep(fault.seconds)
