"""The authorization table (`core.access`) applied to every call of every gRPC server of
the project, in one place: `AccessInterceptor`, which every `RpcServer` runs after the
token check. A call whose method has no row is refused; any other call is checked
against its row before its handler runs (its caller's role, and the node a unary
request names); a request framed by hand is checked message by message by the servicer
that decodes it (`authorize_message`), before the rest of it is read. A refusal is
PERMISSION_DENIED naming the caller and what it may not do, logged at most once per
method and caller host every few seconds, and changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
from google.protobuf import descriptor_pool

from disttrain.core.access import Rule, missing_rows, rule_of
from disttrain.core.auth import UnknownCertificate, caller_of, replace_behavior
from disttrain.core.identity import ROLES_ONLY, Caller, CertificatePolicy, NotPermitted
from disttrain.core.refusal_log import RateLimitedLog, printable

logger = logging.getLogger(__name__)

# The attribute of a call's context holding its row and caller, for `authorize_message`.
GRANT_ATTRIBUTE = "disttrain_grant"


class Unread:
    """A request its server left unparsed (over its size limit, say): the handler refuses
    it without reading it, so no field of it is checked here."""


def check_service(service: str, pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Refuse to serve `service` while an RPC of it (in the proto descriptors of `pool`,
    by default the project's) has no row.

    Raises:
        ValueError: naming the methods without a row.
    """
    try:
        descriptor = (pool or descriptor_pool.Default()).FindServiceByName(service)
    except KeyError:
        return  # not a service of the project's protos (a test's own)
    missing = missing_rows(service, (method.name for method in descriptor.methods))
    if missing:
        raise ValueError(f"{service}: no row in the authorization table (core.access.RULES) for "
                         f"{', '.join(missing)}; add one saying who may call it, on what, with which limits")


class _Grant:
    """The row a call is made under and who makes it."""

    def __init__(self, rule: Rule, caller: Caller | None):
        self.rule, self.caller = rule, caller


class AccessInterceptor(grpc.ServerInterceptor):
    """Checks every call against its row of `core.access.RULES` (see the module); a call
    with a client certificate that `policy` takes from nobody (another run's, or naming no
    role of the run) is refused UNAUTHENTICATED, unread, whatever its row."""

    def __init__(self, policy: CertificatePolicy = ROLES_ONLY) -> None:
        self._refusals = RateLimitedLog(logger)
        self._policy = policy

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        rule = rule_of(method)
        if rule is None:
            return replace_behavior(handler, lambda behavior: self._no_row(method))
        return replace_behavior(handler, lambda behavior: self._checking(rule, handler, behavior))

    def _refuse(self, context: grpc.ServicerContext, method: str, message: str,
                code: grpc.StatusCode = grpc.StatusCode.PERMISSION_DENIED) -> None:
        host = context.peer().rpartition(":")[0] or context.peer()  # its host: ports change
        self._refusals.warning(f"{method} {host}", "refused %s from %s: %s", method, printable(host),
                               printable(message))
        context.abort(code, message)

    def _no_row(self, method: str) -> Callable:
        def refuse(request_or_iterator, context, *more):
            self._refuse(context, method, f"{method}: no row in the authorization table; nobody may call it")
        return refuse

    def _checking(self, rule: Rule, handler: grpc.RpcMethodHandler, behavior: Callable) -> Callable:
        typed_stream = handler.request_streaming and not rule.framed
        whole = not (rule.framed or handler.request_streaming)  # a request read whole, before the handler

        def check(request_or_iterator, context, *more):
            try:
                caller = caller_of(context, self._policy)
            except UnknownCertificate as e:
                caller = None
                if rule.authenticated:
                    self._refuse(context, rule.path, str(e), grpc.StatusCode.UNAUTHENTICATED)
            message = request_or_iterator if whole and not isinstance(request_or_iterator, Unread) else None
            try:
                rule.check(caller, message)
            except NotPermitted as e:
                self._refuse(context, rule.path, str(e))
            setattr(context, GRANT_ATTRIBUTE, _Grant(rule, caller))
            if typed_stream:
                request_or_iterator = self._each_checked(request_or_iterator, context, rule, caller)
            return behavior(request_or_iterator, context, *more)
        return check

    def _each_checked(self, requests: Iterable, context, rule: Rule, caller: Caller | None) -> Iterator:
        for request in requests:
            try:
                rule.check(caller, request)
            except NotPermitted as e:
                self._refuse(context, rule.path, str(e))
            yield request


def authorize_message(context: grpc.ServicerContext, message: Any) -> None:
    """Check one decoded message of a framed request (a push's header) against the row its
    call is made under, before anything else of the message is read or done.

    Raises:
        NotPermitted: its caller may not send it (the servicer answers PERMISSION_DENIED),
            or the call never went through `AccessInterceptor`.
    """
    grant: _Grant | None = getattr(context, GRANT_ATTRIBUTE, None)
    if grant is None:  # refuse rather than guess
        raise NotPermitted("this call was not checked against the authorization table; nobody may make it")
    grant.rule.check(grant.caller, message)
