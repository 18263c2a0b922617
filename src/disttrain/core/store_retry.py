"""Checkpoint store operations retried with back-off, and the one line when they fail for good.

A checkpoint store (a local folder, a `file://` or `s3://` URL, any fsspec store) can fail
for a while: the network to it cut, its server restarting, its disk full until someone
frees space. Every write, read, listing and removal of checkpoints goes through `retried`:
an error of the store (an `OSError`, which is what `object_store` turns a backend's own
errors into) is tried again with exponential back-off and jitter for the process's retry
window (`system.checkpoint_retry_s`, set once at the start with `set_window`), the first
failure logged in one line. Past the window, `CheckpointStoreError` says in one line which
store, what failed and why, the newest complete checkpoint there, and to continue with
`--resume`. Any other error (an object `torch.save` cannot pickle) is raised at once.

The newest complete checkpoint is what this process last saw of the folder: the listing
that chose where the run starts, then each checkpoint it wrote or pruned (`remember`,
`completed`, `incomplete`). A store that has failed cannot be asked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import tenacity

from disttrain.core.errors import CheckpointStoreError

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_WINDOW_S = 60.0
FIRST_WAIT_S = 0.25
LONGEST_WAIT_S = 10.0


class _ProcessSettings:
    """How long this process retries a failing store, and the complete checkpoints (their
    steps) it knows of in each folder (a folder it never listed nor wrote is absent)."""

    def __init__(self) -> None:
        self.window_s = DEFAULT_WINDOW_S
        self.complete: dict[str, set[int]] = {}
        self.lock = threading.Lock()


_SETTINGS = _ProcessSettings()


def set_window(seconds: float) -> None:
    """Retry a failing store for `seconds` (0: try once) in this process; call at its start.

    Raises:
        ValueError: `seconds` is negative.
    """
    if seconds < 0:
        raise ValueError(f"the checkpoint store's retry window must be >= 0 seconds (got {seconds})")
    _SETTINGS.window_s = float(seconds)


def window_s() -> float:
    """This process's retry window, in seconds."""
    return _SETTINGS.window_s


def _key(folder: str | Path) -> str:
    return str(folder).rstrip("/")


def remember(folder: str | Path, steps: Iterable[int]) -> None:
    """Note that `folder` holds complete checkpoints of `steps` (a listing of it)."""
    with _SETTINGS.lock:
        _SETTINGS.complete[_key(folder)] = set(steps)


def completed(folder: str | Path, step: int) -> None:
    """Note that the checkpoint of `step` in `folder` is complete (written)."""
    with _SETTINGS.lock:
        _SETTINGS.complete.setdefault(_key(folder), set()).add(step)


def incomplete(folder: str | Path, step: int) -> None:
    """Note that the checkpoint of `step` in `folder` is no longer complete (being
    overwritten, or pruned)."""
    with _SETTINGS.lock:
        _SETTINGS.complete.get(_key(folder), set()).discard(step)


def newest_checkpoint(folder: str | Path) -> str:
    """What this process knows of `folder`'s newest complete checkpoint, as words: that of
    `folder` itself, else the newest of the folders under it (a parameter-server run's root
    holds `worker<R>/` and `server<S>/`)."""
    key = _key(folder)
    with _SETTINGS.lock:
        if key in _SETTINGS.complete:
            steps = _SETTINGS.complete[key]
            return (f"the newest complete checkpoint there is step {max(steps)}" if steps
                    else "no checkpoint is complete there yet")
        below = [(max(steps), sub) for sub, steps in _SETTINGS.complete.items()
                 if sub.startswith(key + "/") and steps]
    if below:
        step, sub = max(below)
        return f"the newest complete checkpoint is step {step}, in {sub}"
    return "no checkpoint of this process is known to be complete there"


def is_store_error(error: BaseException) -> bool:
    """An error of the store itself (`object_store` turns a backend's own into `OSError`)."""
    return isinstance(error, OSError)


def is_transient(error: BaseException) -> bool:
    """A store error that may clear by itself: a connection refused or cut, a timeout. The
    others (no such bucket or folder, access refused, no credentials, a full or read-only
    disk) need someone to act."""
    cause = error.__cause__ if error.__cause__ is not None else error
    if isinstance(cause, (ConnectionError, TimeoutError)):
        return True
    names = [kind.__name__ for kind in type(cause).__mro__]
    return any("Connect" in name or "Timeout" in name for name in names)


def describe(error: BaseException) -> str:
    """`error` in a few words on one line: its type and the first line of its message."""
    text = " ".join(str(error).split())
    name = type(error).__name__
    if not text:
        return name
    # A backend's error turned into an OSError already starts with its own type.
    named = {name} | ({type(error.__cause__).__name__} if error.__cause__ is not None else set())
    return text[:300] if any(text.startswith(n) for n in named) else f"{name}: {text[:300]}"


def retried(call: Callable[[], T], store: str | Path, doing: str,
            retry_if: Callable[[BaseException], bool] = is_store_error, window: float | None = None,
            kind: str = "checkpoint store") -> T:
    """`call()`, tried again with back-off while it raises an error `retry_if` accepts.

    Args:
        store: the folder or URL the call works on (named in the messages).
        kind: what the store holds, as the log lines name it ("data set store"...).
        doing: what the call does, e.g. "writing checkpoint_step00000010.pt".
        window: seconds to go on trying (default: this process's window, `set_window`).

    Raises:
        CheckpointStoreError: the errors went on past the window (chained to the last).
        Whatever `call` raises that `retry_if` does not accept, at once.
    """
    window = window_s() if window is None else window
    started = time.monotonic()

    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception()
        wait = state.next_action.sleep if state.next_action else 0.0
        if state.attempt_number == 1:
            logger.warning("%s %s: %s failed (%s); retrying with back-off for up to %.0fs", kind,
                           store, doing, describe(error), window)
        else:
            logger.info("%s %s: %s failed again, attempt %d (%s); next in %.1fs", kind, store,
                        doing, state.attempt_number, describe(error), wait)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(retry_if),
        wait=tenacity.wait_exponential(multiplier=FIRST_WAIT_S,
                                       max=min(LONGEST_WAIT_S, max(FIRST_WAIT_S, window / 4)))
        + tenacity.wait_random(0, FIRST_WAIT_S),
        stop=tenacity.stop_before_delay(window) if window > 0 else tenacity.stop_after_attempt(1),
        before_sleep=before_sleep, reraise=True)
    attempts = 0

    def counted() -> T:
        nonlocal attempts
        attempts += 1
        return call()

    try:
        result = retrying(counted)
    except Exception as error:
        if not retry_if(error):
            raise
        elapsed_s = time.monotonic() - started
        raise CheckpointStoreError(
            f"{kind} {store}: {doing} failed for {elapsed_s:.0f}s ({attempts} attempt(s), "
            f"system.checkpoint_retry_s={window:g}): {describe(error)}; {newest_checkpoint(store)}; "
            "once the store works again, run the same command with --resume") from error
    if attempts > 1:
        logger.info("%s %s: %s succeeded at attempt %d, after %.1fs", kind, store, doing, attempts,
                    time.monotonic() - started)
    return result
