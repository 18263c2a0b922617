"""Fault injection at exact points, for tests and drills: `--inject-fault kill@step=30`.

A fault fires in the process whose rank matches (any rank when none is given), on the
given restart attempt only (0 = the first run), when it reaches `step`. `kill` sends the
process SIGKILL: no cleanup, no atexit, exactly as a machine loss looks to everyone else.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ACTIONS = ("kill",)


@dataclass(frozen=True)
class Fault:
    action: str
    step: int
    rank: int | None = None
    attempt: int = 0


def parse_fault(text: str) -> Fault:
    """Parse `ACTION@step=N[,rank=R][,attempt=A]`.

    Raises:
        ValueError: the text does not follow that form.
    """
    action, sep, rest = text.partition("@")
    if action not in ACTIONS or not sep:
        raise ValueError(f"--inject-fault {text!r}: expected ACTION@step=N[,rank=R][,attempt=A] "
                         f"with ACTION one of {', '.join(ACTIONS)}")
    fields: dict[str, int] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        if key not in ("step", "rank", "attempt") or not eq or not value.strip().isdigit():
            raise ValueError(f"--inject-fault {text!r}: bad part {part!r}")
        fields[key] = int(value)
    if "step" not in fields:
        raise ValueError(f"--inject-fault {text!r}: step=N is required")
    return Fault(action, **fields)


class FaultInjector:
    """Holds the faults meant for this process; call `at_step(step)` after each step."""

    def __init__(self, faults: list[Fault] | tuple[Fault, ...] = (), rank: int = 0, attempt: int = 0):
        self._faults = [f for f in faults
                        if (f.rank is None or f.rank == rank) and f.attempt == attempt]

    def at_step(self, step: int) -> None:
        for fault in self._faults:
            if fault.step == step:
                logger.warning("injected fault: %s at step %d", fault.action, step)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os.kill(os.getpid(), signal.SIGKILL)
