"""The training clock, and the window of steps between two metric records.

One clock for every strategy: `TrainClock` runs while a process trains and is paused
around evaluation and checkpoint writes, so every throughput figure (a window's, the
run's) divides samples by the same kind of seconds.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from disttrain.metrics.time_to_target import perplexity_of


class TrainClock:
    """Seconds of training. Starts stopped; `start()` it when the first step begins.

    Args:
        elapsed_s: training time already done (restored from a checkpoint).
        now: the time source (tests pass a fake one).
    """

    def __init__(self, elapsed_s: float = 0.0, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self._elapsed = elapsed_s
        self._since: float | None = None

    def start(self) -> None:
        if self._since is None:
            self._since = self._now()

    def stop(self) -> None:
        if self._since is not None:
            self._elapsed += self._now() - self._since
            self._since = None

    def elapsed(self) -> float:
        running = 0.0 if self._since is None else self._now() - self._since
        return self._elapsed + running

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop the clock for the block (evaluation, checkpoint writes); restart it after."""
        was_running = self._since is not None
        self.stop()
        try:
            yield
        finally:
            if was_running:
                self.start()


class StepTimer:
    """Wall time per named phase inside steps; `drain()` returns `time/<phase>_s` totals
    (keys of the metrics vocabulary, e.g. phase `comm_blocked`) and resets."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self._totals[name] += self._now() - start

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` to phase `name`, measured elsewhere (time that ran beside the
        step's own thread, e.g. communication in flight while it computed)."""
        self._totals[name] += seconds

    def drain(self) -> dict[str, float]:
        out = {f"time/{name}_s": total for name, total in self._totals.items()}
        self._totals.clear()
        return out


class MetricsWindow:
    """Sums over the steps since the last record; `scalars()` turns them into the
    window's figures. Every strategy's window is this one, so they all sum alike.

    Args:
        clock_s: the training clock's reading when the window opens.
        perplexity: a language model's window: report `perplexity/train` (exp of the mean
            token loss) instead of `accuracy/train`.
    """

    def __init__(self, clock_s: float, perplexity: bool = False):
        self.opened_s = clock_s
        self.perplexity = perplexity
        self.loss_sum = 0.0
        self.num_correct = 0
        self.num_samples = 0
        self.num_steps = 0
        self.step_sums: dict[str, float] = defaultdict(float)

    def add(self, loss: float, num_correct: int, num_samples: int,
            step_scalars: dict[str, float] | None = None) -> None:
        """Count one step: its mean loss over `num_samples`, and its own per-step figures
        (metric keys, summed here and averaged per step in `scalars`)."""
        self.loss_sum += loss * num_samples
        self.num_correct += num_correct
        self.num_samples += num_samples
        self.num_steps += 1
        for key, value in (step_scalars or {}).items():
            self.step_sums[key] += value

    def scalars(self, clock_s: float) -> dict[str, float]:
        """The window's figures at training-clock reading `clock_s`."""
        seconds = max(clock_s - self.opened_s, 1e-9)
        samples, steps = max(self.num_samples, 1), max(self.num_steps, 1)
        per_step = {key: total / steps for key, total in self.step_sums.items()}
        step_s = seconds / steps
        if self.step_sums.get("compression/bytes_sent"):  # a ratio of the window's sums
            per_step["compression/ratio"] = (self.step_sums["compression/bytes_dense"]
                                             / self.step_sums["compression/bytes_sent"])
        loss = self.loss_sum / samples
        quality = ({"perplexity/train": perplexity_of(loss)} if self.perplexity
                   else {"accuracy/train": self.num_correct / samples})
        return {
            "loss/train": loss,
            **quality,
            "throughput/samples_per_s": self.num_samples / seconds,
            "time/step_s": step_s,
            "time/compute_s": max(step_s - per_step.get("time/comm_blocked_s", 0.0), 0.0),
            **per_step,
        }
