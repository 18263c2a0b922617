"""The status code each refusal of a shard server is answered with.

A refused call changes nothing on the shard; its status code tells the client what to
do: retry later (UNAVAILABLE), register again or stop (PERMISSION_DENIED,
ALREADY_EXISTS), fix the call (INVALID_ARGUMENT), or follow the protocol
(FAILED_PRECONDITION).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from disttrain.strategies.ps.decisions import PushRefused
from disttrain.strategies.ps.identity import IdentityTaken, SessionRefused, UnknownWorker
from disttrain.strategies.ps.roster import FencedPush, UnknownGeneration


class ShardStopping(RuntimeError):
    """A call that arrived after the final checkpoint began: not taken (retry later)."""


# The first matching class decides: subclasses before the ValueError they derive from.
CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (SessionRefused, grpc.StatusCode.PERMISSION_DENIED),
    (IdentityTaken, grpc.StatusCode.ALREADY_EXISTS),
    (UnknownGeneration, grpc.StatusCode.UNAVAILABLE),  # the membership is on its way: retry
    (ShardStopping, grpc.StatusCode.UNAVAILABLE),
    (UnknownWorker, grpc.StatusCode.FAILED_PRECONDITION),
    (FencedPush, grpc.StatusCode.FAILED_PRECONDITION),
    (PushRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # a malformed message (InvalidPush, InvalidIdentity)
)


REFUSALS = tuple(kind for kind, _ in CODES)


def status_of(error: Exception) -> grpc.StatusCode:
    """The status code of a refusal (one of `REFUSALS`)."""
    return next(code for kind, code in CODES if isinstance(error, kind))


@contextmanager
def refusals(context: grpc.ServicerContext) -> Iterator[None]:
    """Answer a refusal raised in the block with its status code and message."""
    try:
        yield
    except REFUSALS as e:
        context.abort(status_of(e), str(e))
