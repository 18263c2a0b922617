"""DDP communication hooks: the one place a hook is registered on the model.

DDP hands each gradient bucket, once its gradients are ready, to a communication hook
that must return a future of the averaged bucket. `register_comm_hook` wraps whichever
hook the run uses (plain all-reduce, or a gradient-compression hook from
`compression.ddp_hooks` passed as `hook`/`hook_state`) in a timing layer that records,
per step, how many bytes of gradients the buckets held and each bucket's [launch, done]
interval. The backward pass has computed its last gradient when the last bucket is
launched; communication after that point blocks the step (`blocked_s`), communication
before it overlaps computation (`overlapped_s`, the rest of the intervals' union,
overlaps counted once).

On CUDA the done time is when the backend completes the future on the host, so the
figure there is the host-side view of the NCCL work.
"""

# No `from __future__ import annotations` here: DDP inspects the hook's annotations and
# accepts only the real `dist.GradBucket` and `Future[Tensor]` objects, not strings.
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class CommSample:
    """Communication of the steps since the last drain."""

    blocked_s: float = 0.0
    overlapped_s: float = 0.0
    num_bytes: int = 0
    num_buckets: int = 0

    def scalars(self) -> dict[str, float]:
        """A DDP step's communication figures, the same keys in both recovery modes (see
        `metrics.keys`): `time/comm_blocked_s`, `time/comm_overlapped_s` and
        `comm/bytes_allreduced`."""
        return {"time/comm_blocked_s": self.blocked_s, "time/comm_overlapped_s": self.overlapped_s,
                "comm/bytes_allreduced": self.num_bytes}


def split_intervals(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(blocked, overlapped) seconds of one step's bucket intervals: blocked is what runs
    after the last launch, overlapped the rest of the union."""
    if not intervals:
        return 0.0, 0.0
    last_launch = max(start for start, _ in intervals)
    blocked = max(0.0, max(end for _, end in intervals) - last_launch)
    return blocked, max(0.0, union_length(intervals) - blocked)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by `intervals` (start, end), overlaps counted once."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= covered_to:
            continue
        total += end - max(start, covered_to)
        covered_to = end
    return total


class CommStats:
    """Collects what the timing hook saw. Thread-safe: DDP launches hooks from the
    autograd thread and the backend completes futures on its own thread."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._bytes = 0
        self._buckets = 0

    def record(self, start: float, end: float, num_bytes: int) -> None:
        with self._lock:
            self._intervals.append((start, end))
            self._bytes += num_bytes
            self._buckets += 1

    def drain(self) -> CommSample:
        """What was recorded since the last drain; call after each step (all futures done)."""
        with self._lock:
            blocked, overlapped = split_intervals(self._intervals)
            sample = CommSample(blocked, overlapped, self._bytes, self._buckets)
            self._intervals, self._bytes, self._buckets = [], 0, 0
        return sample


@dataclass
class _TimedState:
    inner_state: Any
    inner_hook: CommHook
    stats: CommStats


def _timed_hook(state: "_TimedState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    num_bytes = buffer.numel() * buffer.element_size()
    start = state.stats.clock()

    def done(future: torch.futures.Future) -> torch.Tensor:
        state.stats.record(start, state.stats.clock(), num_bytes)
        return future.value()

    return state.inner_hook(state.inner_state, bucket).then(done)


def register_comm_hook(model: DistributedDataParallel, stats: CommStats,
                       hook: CommHook = allreduce_hook, hook_state: Any = None) -> None:
    """Register `hook` on `model`, timed into `stats`. Call once, before the first forward.

    Args:
        hook: a DDP communication hook `(state, bucket) -> Future[Tensor]` returning the
            bucket averaged over ranks; the default is the plain all-reduce average.
        hook_state: its state (for `allreduce_hook`, the process group; None = world).
    """
    model.register_comm_hook(_TimedState(hook_state, hook, stats), _timed_hook)
