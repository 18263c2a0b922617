"""Deadlines and retries of every call a worker makes to a shard.

Every RPC carries a deadline (`RetryPolicy.timeout_s`, from `ps.rpc_timeout_s`);
transient failures (server not up yet or restarting, deadline passed, a lost reply, a
broken step stream) are retried with exponential backoff and jitter, so that the retries
of many workers spread out instead of arriving together. Retrying a push is safe: the
server acknowledges a (worker, step) it already took as a duplicate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import tenacity

from disttrain.strategies.ps.worker.step_stream import StreamBroken

logger = logging.getLogger(__name__)

TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


@dataclass(frozen=True)
class RetryPolicy:
    """Deadline of each attempt, and how often and how patiently to retry. The default
    rides out a server's restart (tens of seconds of UNAVAILABLE).

    The wait before retry n (from 1) is `initial_backoff_s * 2 ** (n - 1)`, at most
    `max_backoff_s`, plus a uniform jitter in [0, `initial_backoff_s`). `sleep` waits out
    each backoff (a test passes a recorder, to read the waits without waiting them).
    """

    timeout_s: float = 60.0
    max_attempts: int = 30
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 3.0
    sleep: Callable[[float], None] = time.sleep
    max_total_s: float | None = None  # no retry starts once this long has passed (None: no bound)


class ReplyLost(ConnectionError):
    """An injected fault: the server took the push but its reply never came back."""


def is_transient(error: BaseException) -> bool:
    return isinstance(error, ReplyLost | StreamBroken) or \
        isinstance(error, grpc.RpcError) and error.code() in TRANSIENT


def describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)


def with_retries(policy: RetryPolicy, what: str, fn: Callable[[], object]):
    """`fn()` until it answers, retried while it fails transiently (see `RetryPolicy`).

    Raises:
        The last error, once it is not transient or the attempts are spent.
    """
    def log_retry(state: tenacity.RetryCallState) -> None:
        logger.warning("%s failed (%s); retry %d in %.2fs", what, describe(state.outcome.exception()),
                       state.attempt_number, state.upcoming_sleep)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=tenacity.wait_exponential(multiplier=policy.initial_backoff_s, max=policy.max_backoff_s)
        + tenacity.wait_random(0, policy.initial_backoff_s),  # jitter: retries of many workers spread out
        stop=tenacity.stop_after_attempt(policy.max_attempts) if policy.max_total_s is None
        else tenacity.stop_after_attempt(policy.max_attempts) | tenacity.stop_after_delay(policy.max_total_s),
        before_sleep=log_retry, sleep=policy.sleep,
        reraise=True)
    return retrying(fn)
