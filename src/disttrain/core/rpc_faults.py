"""The network fault points of `core.failpoints` on gRPC: a client interceptor that every
channel of an armed process carries (`core.channels`) and a server interceptor that every
server of one carries (`core.rpc_server`). A partition fails calls UNAVAILABLE both ways,
streams already open included; a slow link delays each call; a delayed reply comes back
late, or, past the call's deadline, never (DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc

from disttrain.core.failpoints import network

CUT_DETAILS = "injected partition: this process is cut off from the others"


class _Cut(grpc.RpcError, grpc.Call):
    """The error a call meets while the process is cut off (or its delayed reply was lost)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self):
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback) -> bool:
        return False


def _before_call() -> None:
    if network.cut():
        raise _Cut(grpc.StatusCode.UNAVAILABLE, CUT_DETAILS)
    if network.latency_s:
        time.sleep(network.latency_s)


class _StreamCall:
    """A streaming call whose responses stop once the process is cut off, and whose next
    response is held back by a delayed-reply fault; everything else is the call's own."""

    def __init__(self, call: Any, method: str):
        self._call, self._method = call, method

    def __iter__(self):
        return self

    def __next__(self):
        response = next(self._call)
        if network.cut():
            self._call.cancel()
            raise _Cut(grpc.StatusCode.UNAVAILABLE, CUT_DETAILS)
        seconds = network.take_delay(self._method)
        if seconds:
            time.sleep(seconds)
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class _Delayed:
    """A unary call's outcome held back `seconds` (a late reply; lost past `timeout_s`)."""

    def __init__(self, call: Any, seconds: float, timeout_s: float | None):
        self._call, self._seconds, self._timeout_s = call, seconds, timeout_s

    def result(self, timeout: float | None = None) -> Any:
        value = self._call.result(timeout)
        if self._timeout_s is not None and self._seconds >= self._timeout_s:
            time.sleep(self._timeout_s)
            raise _Cut(grpc.StatusCode.DEADLINE_EXCEEDED, "injected fault: the reply came too late")
        time.sleep(self._seconds)
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class _ClientPoints(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The network fault points of every call a client makes."""

    def intercept_unary_unary(self, continuation, client_call_details, request):
        _before_call()
        call = continuation(client_call_details, request)
        seconds = network.take_delay(client_call_details.method)
        return _Delayed(call, seconds, client_call_details.timeout) if seconds else call

    def intercept_unary_stream(self, continuation, client_call_details, request):
        _before_call()
        return _StreamCall(continuation(client_call_details, request), client_call_details.method)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        _before_call()
        call = continuation(client_call_details, request_iterator)
        seconds = network.take_delay(client_call_details.method)
        return _Delayed(call, seconds, client_call_details.timeout) if seconds else call

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        _before_call()
        return _StreamCall(continuation(client_call_details, request_iterator),
                           client_call_details.method)


def wrap_channel(channel: grpc.Channel) -> grpc.Channel:
    """`channel` with the network fault points when a network fault is armed (else itself)."""
    return grpc.intercept_channel(channel, _ClientPoints()) if network.armed else channel


def _served(behavior: Callable, streaming_response: bool) -> Callable:
    def refuse(context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAVAILABLE, CUT_DETAILS)

    if streaming_response:
        def stream(request_or_iterator, context):
            if network.cut():
                refuse(context)
            if network.latency_s:
                time.sleep(network.latency_s)
            for response in behavior(request_or_iterator, context):
                if network.cut():
                    refuse(context)
                yield response
        return stream

    def unary(request_or_iterator, context):
        if network.cut():
            refuse(context)
        if network.latency_s:
            time.sleep(network.latency_s)
        response = behavior(request_or_iterator, context)
        if network.cut():
            refuse(context)
        return response
    return unary


class ServerPoints(grpc.ServerInterceptor):
    """The network fault points of every call a server takes (health checks included: a
    partitioned server answers nobody)."""

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        kind = (("stream_" if handler.request_streaming else "unary_")
                + ("stream" if handler.response_streaming else "unary"))
        return handler._replace(**{kind: _served(getattr(handler, kind), handler.response_streaming)})


def server_interceptors() -> list[grpc.ServerInterceptor]:
    """The interceptors a server adds (first) when a network fault is armed (else none)."""
    return [ServerPoints()] if network.armed else []
