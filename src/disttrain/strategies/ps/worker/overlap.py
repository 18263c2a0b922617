"""Pushes that start during the backward pass: each shard's gradient goes out as soon as
backward has produced all of it, as BytePS and DDP's reducer overlap communication with
the gradients still being computed.

A shard owns one contiguous range of the flat vector, which holds the parameters in the
model's order (`wire.sharding`), and backward produces gradients in about the reverse
order, so the last shard's gradient is complete first and its push (and, in the same
round trip, the pull of the parameters it leads to) travels while backward still
computes the earlier layers.

Buckets finer than a shard: a shard's push whose raw bytes travel in gRPC messages of
several pieces (`PSClient.streams`) opens once backward has written the shard's last
tensor and streams the pieces last first, each once written (`Written`, fed by the
trigger's `progress`), the piece with the shard's first byte once the whole gradient is
written and checked. The shard still takes one whole push (it reads the stream to its
end, then puts the pieces back in order), so the wire's rules, the ledger, duplicates and
retries are unchanged; an aborted push is cancelled before its last piece, and the
shard applies nothing of it. A shard's aggregation still waits for its whole push.

`ShardTrigger` watches each trainable parameter's post-accumulate-grad hook and counts,
per shard, the parameters whose gradient is still to come; the call that completes a
shard launches it. Hooks fire on every backward, but act only while the exchange has
armed the trigger for the gradient of a step (not on a recomputation after a refused
push, nor on a redo, which push the classic way). A parameter that took no gradient in
this backward (unused by the forward pass) never fires its hook: `disarm` returns the
shards still waiting, to be launched once backward is over.

The pushes' intervals give the communication time in flight while the backward pass
still computed (`overlapped_s`); what the step waited for after it is its blocked time,
the same split DDP's buckets report.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from torch import nn

from disttrain.strategies.ps.wire.sharding import ShardPlan, trainable_parameters

logger = logging.getLogger(__name__)


def shards_of_parameters(model: nn.Module, plans: Sequence[ShardPlan]) -> list[list[int]]:
    """For each trainable parameter (in `trainable_parameters` order): the shards holding
    a slice of it (two or more for a tensor split between shards)."""
    return [[shard for shard, _ in places] for places in _places(model, plans)]


def _places(model: nn.Module, plans: Sequence[ShardPlan]) -> list[list[tuple[int, int]]]:
    """For each trainable parameter: (shard, the element of the shard its slice starts at)
    for each shard holding a slice of it."""
    out, offset = [], 0
    for _, param in trainable_parameters(model):
        end = offset + param.numel()
        out.append([(p.shard, max(offset - p.offset, 0)) for p in plans
                    if p.offset < end and offset < p.offset + p.numel])
        offset = end
    return out


class ShardTrigger:
    """Launches each shard once backward has produced its whole gradient.

    Args:
        model: the worker's model (hooks are added to its trainable parameters, for the
            life of the worker).
        plans: the run's shard plans, in shard order.
    Raises:
        ValueError: the plans do not cover the model's parameters (another model).
    """

    def __init__(self, model: nn.Module, plans: Sequence[ShardPlan]):
        places = _places(model, plans)
        self.shards_of = [[shard for shard, _ in where] for where in places]
        self.num_shards = len(plans)
        # Per shard, the element each of its parameters' slices starts at, in order, and
        # per parameter its index among them on each of its shards.
        self.starts: list[list[int]] = [[] for _ in plans]
        self._positions: list[list[int]] = []
        for where in places:
            self._positions.append([len(self.starts[shard]) for shard, _ in where])
            for shard, start in where:
                self.starts[shard].append(start)
        self.needed = [len(starts) for starts in self.starts]
        if any(n == 0 for n in self.needed):
            raise ValueError("a shard holds no parameter of this model; start servers and workers with "
                             "the same model")
        self._left: list[int] = []
        self._done: list[list[bool]] = []
        self._suffix: list[int] = []  # per shard: its slices from this one on are all done
        self._launch: Callable[[int], None] | None = None
        self._progress: Callable[[int, int], None] | None = None
        self._handles = [param.register_post_accumulate_grad_hook(self._hook(i))
                         for i, (_, param) in enumerate(trainable_parameters(model))]

    def arm(self, launch: Callable[[int], None], progress: Callable[[int, int], None] | None = None) -> None:
        """Call `launch(shard)` from the backward pass to come, once per shard, as soon as
        every parameter of the shard has its gradient (on the thread running backward).
        With `progress`, also `progress(shard, start)` each time the shard's elements from
        `start` to its end all have their gradients, and more of them than at the last
        call (before the `launch` of the same shard, which then follows with start 0)."""
        self._left = list(self.needed)
        self._done = [[False] * n for n in self.needed]
        self._suffix = list(self.needed)
        self._launch, self._progress = launch, progress

    def disarm(self) -> list[int]:
        """Stop launching; the shards not launched (some parameter took no gradient, or
        backward did not run), in reverse order, as backward would have launched them."""
        self._launch = self._progress = None
        waiting = [s for s in range(self.num_shards) if self._left and self._left[s] > 0]
        self._left = []
        return waiting[::-1]

    def _hook(self, index: int) -> Callable:
        shards, positions = self.shards_of[index], self._positions[index]

        def hook(_param) -> None:
            launch = self._launch
            if launch is None:
                return
            for s, position in zip(shards, positions, strict=True):
                self._left[s] -= 1
                if self._progress is not None:
                    self._advance(s, position)
                if self._left[s] == 0:
                    launch(s)

        return hook

    def _advance(self, shard: int, position: int) -> None:
        """Note slice `position` of `shard` done; tell `progress` where the done suffix starts
        when it grew."""
        done, suffix = self._done[shard], self._suffix[shard]
        done[position] = True
        while suffix > 0 and done[suffix - 1]:
            suffix -= 1
        if suffix < self._suffix[shard]:
            self._suffix[shard] = suffix
            self._progress(shard, self.starts[shard][suffix])

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def overlapped_s(intervals: Sequence[tuple[float, float]], computed: float) -> float:
    """Seconds of one step's pushes, each (launched, answered), in flight before
    `computed` (the time the backward pass ended): their union, overlaps counted once."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted((a, min(b, computed)) for a, b in intervals if a < computed):
        start = max(start, covered_to)
        if end > start:
            total += end - start
            covered_to = end
    return total


class PushAbandoned(Exception):
    """A push streamed during backward was stopped before it was whole (backward failed);
    its shard read none of it as a push."""


class Written:
    """How much of one shard's gradient backward has written, for the push that streams it
    last piece first while backward still computes (`service.gradient_frames_from_end`).

    Backward advances the written suffix (`advance`); the piece holding the shard's first
    byte goes only once `release` says the whole gradient is written and checked. `abort`
    stops the push: the call of each attempt (`attempt`) is cancelled before its frames
    end, so the shard never reads the push whole and applies nothing of it.
    """

    def __init__(self, nbytes: int):
        self._cond = threading.Condition()
        self._from = nbytes  # the bytes from here to the end are written
        self._released = False
        self._attempt: object | None = None  # the call now carrying the push
        self._cancel: Callable[[], object] | None = None
        self._cancelled = False
        self.error: BaseException | None = None

    def advance(self, start: int) -> None:
        """The bytes from `start` to the end are written (on backward's thread)."""
        with self._cond:
            if start < self._from:
                self._from = start
                self._cond.notify_all()

    def release(self) -> None:
        """Every byte is written and the gradient checked: the first piece may go."""
        with self._cond:
            self._from, self._released = 0, True
            self._cond.notify_all()

    @property
    def released(self) -> bool:
        return self._released

    def abort(self, error: BaseException) -> None:
        """Stop the push with `error` (raised to its sender in place of the call's failure)."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._cancel_now()

    def attempt(self) -> Callable[[int], bool]:
        """A new call's `ready(start)` for its frames: True once the piece starting at byte
        `start` may be read; False once the push is aborted and this call cancelled, or
        the call is not the newest (its frames must end without that piece).

        Raises:
            BaseException: the push was aborted already (its error).
        """
        token = object()
        with self._cond:
            if self.error is not None:
                raise self.error
            self._attempt, self._cancel, self._cancelled = token, None, False

        def ready(start: int) -> bool:
            with self._cond:
                while True:
                    if self._attempt is not token or (self.error is not None and self._cancelled):
                        return False
                    if self.error is None and (self._released or 0 < start and self._from <= start):
                        return True
                    self._cond.wait()

        return ready

    def on_abort(self, cancel: Callable[[], object]) -> None:
        """How to cancel the newest attempt's call (at once when aborted already)."""
        with self._cond:
            self._cancel = cancel
            if self.error is not None:
                self._cancel_now()

    def _cancel_now(self) -> None:
        if self._cancel is not None and not self._cancelled:
            self._cancel()
            self._cancelled = True
        self._cond.notify_all()
