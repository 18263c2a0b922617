"""Preemption of a parameter-server worker: SIGTERM (a scheduler reclaiming the machine, or
the launcher forwarding its own) stops every worker at one step, each with its checkpoint
of that step, so the shards' ledgers and every worker's checkpoint agree and `--resume`
goes on (bit-identical in sync mode).

The signal reaches the workers at different points of their steps, and a synchronous step
needs every worker's push: a worker that stopped a step before the others would leave them
waiting for ever (in every mode, at an epoch's end, where all meet to evaluate). So a
worker does not stop where it is told: it agrees with the others.
Its handler notes the step it has committed to finish (the one it is in, or the next if it
passed its last stop point) and, on a thread of its own, arrives at a barrier on shard 0
with it (`PSClient.barrier`: an all-gather). The barrier completes once every worker has
arrived, which needs no step to finish (each arrives from its own handler), and its answer,
the highest step any worker committed to, is the step every worker stops at: each goes on
to it (the others' pushes of it are on their way) and stops at its end, after its push was
applied on every shard, with its checkpoint (`last_block` the shards hold), exiting with
`Preempted` (code 143).

The training loop asks `PreemptionAgreement.is_set` at its stop points (every step's end but
an epoch's last, and every epoch's end but the run's last); with a request pending, the
answer waits for the barrier's. A worker that is never answered (a peer died, or was not
signalled: workers started by hand) stops at its next stop point once
`system.preemption_grace_s` has passed, with a warning; the launcher has killed it by then
when it runs the workers. A second SIGTERM changes nothing: a worker may get one from the
machine's shutdown and one forwarded by the launcher.

In async and SSP mode the workers' steps drift apart: one behind goes on alone to the step
agreed (no push of it waits for the others'), one ahead waits for none at its own.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from collections.abc import Callable

from disttrain.core.errors import DisttrainError
from disttrain.core.processes import emit_event

logger = logging.getLogger(__name__)

PREEMPTING_EVENT = "preempting"  # told to the launcher, which then stops the whole run
GRACE_KEY = "system.preemption_grace_s"


class PreemptionAgreement:
    """The training loop's `stop_requested` of a worker (see the module).

    Args:
        agree: arrives at the run's preemption barrier with the step this worker committed
            to and returns every worker's (blocking; call on a thread of its own).
        current_step: the loop's step (the last one this worker finished).
        grace_s: how long a stop point waits for the answer before stopping anyway.
    """

    def __init__(self, agree: Callable[[int], list[float]], current_step: Callable[[], int], grace_s: float):
        self._agree = agree
        self._current_step = current_step
        self.grace_s = grace_s
        self.requested = threading.Event()
        self.answered = threading.Event()
        self.stop_step: int | None = None  # the step every worker stops at, once answered
        # The step this worker will finish before its next stop point; None before the first.
        self._committed: int | None = None

    def handle(self, signum: int = signal.SIGTERM, frame: object = None) -> None:
        """The SIGTERM handler (on the main thread, between two bytecodes): no I/O here."""
        if self.requested.is_set():
            return
        committed = self._committed if self._committed is not None else self._current_step() + 1
        self.requested.set()
        threading.Thread(target=self._arrive, args=(committed,), name="preemption", daemon=True).start()

    def _arrive(self, committed: int) -> None:
        logger.warning("SIGTERM: stopping at a step every worker agrees on (this one finishes step %d at "
                       "least), with its checkpoint, within %gs (%s)", committed, self.grace_s, GRACE_KEY)
        emit_event(PREEMPTING_EVENT, step=committed)
        try:
            rows = self._agree(committed)
            steps = [int(row[0]) for row in rows if row and math.isfinite(row[0])]  # NaN: reassigned
            self.stop_step = max(steps, default=committed)
            logger.info("every worker stops at step %d", self.stop_step)
        except DisttrainError as e:
            logger.warning("the workers' stop step could not be agreed (%s): stopping at the next stop point",
                           e)
        finally:
            self.answered.set()

    def is_set(self) -> bool:
        """Whether to stop at this stop point (the loop asks once at each, in order)."""
        step = self._current_step()
        # Committed before looking at the flag: a handler running between the two lines
        # then names this step's successor, which this worker does go on to.
        self._committed = step + 1
        if not self.requested.is_set():
            return False
        if not self.answered.wait(self.grace_s):
            logger.warning("no answer from the other workers within %gs of the SIGTERM (%s): stopping at "
                           "step %d", self.grace_s, GRACE_KEY, step)
            return True
        return self.stop_step is None or step >= self.stop_step
