"""The worker's end of a Step stream: a late reply cancels the call, any failure opens a
new call on the next exchange."""

from __future__ import annotations

import threading

import grpc
import pytest

from disttrain.strategies.ps.worker.step_stream import StepStream, StreamBroken

pytestmark = pytest.mark.timeout(30)


class Cancelled(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.CANCELLED


class FakeCall:
    """A call that answers each request with `reply(request)`, or hangs until cancelled."""

    def __init__(self, requests, reply):
        self.requests, self.reply = requests, reply
        self.cancelled = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        request = next(self.requests)
        answer = self.reply(request)
        if answer is None:  # hang, as a stopped server does
            self.cancelled.wait()
            raise Cancelled()
        if answer == "end":
            raise StopIteration
        return answer

    def cancel(self):
        self.cancelled.set()


def opener(reply):
    calls = []

    def open_call(requests):
        calls.append(FakeCall(requests, reply))
        return calls[-1]
    return open_call, calls


def test_replies_come_back_on_one_call():
    open_call, calls = opener(lambda request: request.upper())
    stream = StepStream(open_call)
    assert [stream.exchange(m, 5.0) for m in (b"a", b"b", b"c")] == [b"A", b"B", b"C"]
    assert len(calls) == 1
    stream.shutdown()


def test_a_late_reply_cancels_the_call_and_the_next_exchange_opens_another():
    open_call, calls = opener(lambda request: None if request == b"hang" else request)
    stream = StepStream(open_call)
    with pytest.raises(StreamBroken, match="no reply to the step within 0.2s"):
        stream.exchange(b"hang", 0.2)
    assert calls[0].cancelled.is_set()
    assert stream.exchange(b"next", 5.0) == b"next" and len(calls) == 2
    stream.shutdown()


def test_a_stream_the_server_ended_is_broken_not_finished():
    open_call, calls = opener(lambda request: "end")
    stream = StepStream(open_call)
    with pytest.raises(StreamBroken, match="ended the step stream"):
        stream.exchange(b"x", 5.0)
    stream.shutdown()
