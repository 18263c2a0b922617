"""The server's side of Step: a push and the parameters it leads to, in one round trip
on a stream the worker keeps open for the run.

Each request is handled as PushGradients handles it (the same decoding, bounds, session
check and rules); its reply then waits, as a pull would, for the version the push leads
to: in sync mode the step the push joined (`base_version + 1`), otherwise none (the
parameters as they are, this push included). The stream holds one of the worker's
long-poll slots while it is open, taken once its first push passed the session check.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING

import grpc

from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps import wire
from disttrain.strategies.ps.refusals import refusals

if TYPE_CHECKING:
    from disttrain.strategies.ps.server import ParameterServicer

Outcome = pb.PushReply.Outcome
# Sync outcomes after which the worker's step is the version its push joined.
_JOINED = {Outcome.Value("APPLIED"), Outcome.Value("BUFFERED"), Outcome.Value("DUPLICATE")}
_ROLLED_BACK = Outcome.Value("ROLLED_BACK")


def answer(servicer: ParameterServicer, raws: Iterator[bytes], context) -> Iterator[bytes]:
    """The replies of one Step stream, one per push, until the worker closes it."""
    state = servicer.state
    if not wire.fits_one_message(state.plan.nbytes) and not state.segments:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"shard {state.plan.shard} holds {state.plan.nbytes} bytes, more than one "
                      "message carries; push with SendGradients and pull with GetParameters")
    with ExitStack() as slot:
        holding = False
        for raw in raws:
            payload = servicer.collect(iter([raw]), context)
            reply = servicer.push(payload, context)
            if reply.outcome == _ROLLED_BACK:  # read nothing: the worker registers again first
                yield wire.step_answer(reply)
                continue
            if not holding:  # the first push that passed the session check
                slot.enter_context(servicer.long_poll(f"{payload.header.worker_id} (step)", context))
                holding = True
            yield wire.step_answer(reply, parameters_after(servicer, payload.header, reply, context))


def parameters_after(servicer: ParameterServicer, header: pb.GradientMessage, reply: pb.PushReply,
                     context) -> bytes:
    """The parameter message that follows `reply` to the push of `header`."""
    state = servicer.state
    wanted = header.base_version + 1 if state.rules.mode == "sync" and reply.outcome in _JOINED else 0
    timeout = servicer.wait_s(context)
    if header.shared_memory:
        with refusals(context):
            version = state.write_parameters(header.worker_id, wanted, timeout)
        if version is not None:
            return wire.parameter_notice(state.plan, version, state.incarnation)
    else:
        snapshot = state.wait_for_version(wanted, timeout)
        if snapshot is not None:
            return snapshot.frames[0]
    servicer.not_reached(context, wanted)
