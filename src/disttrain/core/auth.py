"""The run's token that every RPC of every service must carry: the server interceptor that
checks it and tells the servicer who calls (`core.identity`), the channel interceptor that
sends it, and where a token comes from.

A token is the run's secret (its holder is the operator) or a node token made from it
(its holder is that node). Under mutual TLS the client certificate may name the node
instead (`caller_of`).

The token travels as gRPC metadata (`authorization: Bearer <token>`) and is compared in
constant time. It is never logged, never put on a command line (any user can read
another's argv) and never written into a config, checkpoint or summary. Without TLS it
crosses the network in clear: it keeps out whoever reaches a port by chance, not an
eavesdropper on the network.

Environment variables are read by the CLI only; it hands `TOKEN_ENV`'s value here.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc

from disttrain.core.access import open_paths
from disttrain.core.errors import ConfigError
from disttrain.core.identity import ROLES_ONLY, Caller, CertificatePolicy, certificate_caller, verify_token
from disttrain.core.refusal_log import RateLimitedLog, printable
from disttrain.core.secret_files import read_private
from disttrain.core.tls import certificate_names

logger = logging.getLogger(__name__)

TOKEN_ENV = "DISTTRAIN_TOKEN"
METADATA_KEY = "authorization"
SCHEME = "Bearer "
# Probes of orchestrators (Kubernetes, load balancers) carry no token: the RPCs the
# authorization table opens to anyone (the health service's Check, which says only whether
# a server serves) need none.
OPEN_METHODS = open_paths()
REFUSED = (f"missing or wrong token: give this run's token in the {TOKEN_ENV} environment variable "
           f"or with --token-file PATH (a file holding it)")


def new_token() -> str:
    """A fresh random token (256 bits), for one run."""
    return secrets.token_urlsafe(32)


def write_token_file(path: str | Path, token: str) -> Path:
    """Write `token` into the new file `path`, readable by its owner only (mode 600 from
    its first byte), atomically: a temporary file beside it, fsynced, then linked into
    place, so `path` never holds part of a token and an existing file is never replaced.

    Raises:
        ConfigError: `path` exists already, or its folder cannot be written.
    """
    path = Path(path)
    if path.exists():
        raise ConfigError(f"{path}: already there; a new run secret goes into a new file (remove the "
                          f"old one first if it is no longer used)")
    try:
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 600
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(token + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.link(temporary, path)  # fails, rather than replaces, when `path` appeared meanwhile
        finally:
            os.unlink(temporary)
    except FileExistsError as e:
        raise ConfigError(f"{path}: already there; a new run secret goes into a new file") from e
    except OSError as e:
        raise ConfigError(f"{path}: cannot write the token there ({e.strerror or e})") from e
    return path


def check_token(token: str, origin: str) -> str:
    """`token` stripped of surrounding whitespace.

    Raises:
        ConfigError: it is empty, or holds characters gRPC metadata cannot carry (only
            printable ASCII without spaces is allowed); `origin` names where it came from.
    """
    token = token.strip()
    if not token:
        raise ConfigError(f"{origin}: the token is empty; put the run's token there")
    if not all("!" <= c <= "~" for c in token):
        raise ConfigError(f"{origin}: the token must be printable ASCII without spaces "
                          f"(e.g. from python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def read_token_file(path: str | Path) -> str:
    """The token held in file `path`, stripped of surrounding whitespace.

    Raises:
        ConfigError: the file cannot be read, is empty, holds a malformed token, or is not
            private to the user reading it (`secret_files`: another user owns it, or the
            group or others may read it), which would leak the token.
    """
    text = read_private(path, "--token-file").decode("utf-8", "replace")  # not ASCII: check_token says so
    return check_token(text, f"--token-file {path}")


def resolve_token(token_file: str | None, env_token: str | None) -> str | None:
    """The token a command was given: `--token-file` wins over the environment's value
    (`env_token`, that of `TOKEN_ENV`); None when neither was given (servers run open).

    Raises:
        ConfigError: see `read_token_file`; an empty or malformed environment value.
    """
    if token_file is not None:
        return read_token_file(token_file)
    if env_token is None:
        return None
    return check_token(env_token, f"environment variable {TOKEN_ENV}")


# The attribute of a call's context holding its caller, set by `TokenInterceptor`.
CALLER_ATTRIBUTE = "disttrain_caller"


def _caller(metadata: Any, secret: str) -> Caller | None:
    """Who the call's token says the caller is; None without a valid token."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            given = value if isinstance(value, str) else bytes(value).decode("ascii", "replace")
            if not given.startswith(SCHEME):
                return None
            return verify_token(secret, given[len(SCHEME):])
    return None


def replace_behavior(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable], Callable]
                     ) -> grpc.RpcMethodHandler:
    """`handler` of the same kind, its behavior replaced by `wrap(behavior)`: a function
    of (request or request iterator, context, *more) that calls `behavior` with them or
    refuses the call. A non-blocking behavior (the health service's Watch, which holds no
    thread while it waits) stays non-blocking: `more` is then the callback it answers by."""
    kind = (("stream_" if handler.request_streaming else "unary_")
            + ("stream" if handler.response_streaming else "unary"))
    behavior = getattr(handler, kind)
    replaced = wrap(behavior)
    if getattr(behavior, "experimental_non_blocking", False):
        replaced.experimental_non_blocking = True
        replaced.experimental_thread_pool = getattr(behavior, "experimental_thread_pool", None)
    return cast(Any, handler)._replace(**{kind: replaced})


def _with_caller(handler: grpc.RpcMethodHandler, caller: Caller) -> grpc.RpcMethodHandler:
    """`handler` with `caller` set on each call's context before its behavior runs."""
    def attach(behavior: Callable) -> Callable:
        def handle(request_or_iterator, context, *more):
            setattr(context, CALLER_ATTRIBUTE, caller)
            return behavior(request_or_iterator, context, *more)
        return handle
    return replace_behavior(handler, attach)


class UnknownCertificate(PermissionError):
    """The client certificate names nobody of the run: another run's, or one naming no role
    of the run that the operator did not name (`core.identity.certificate_caller`). Not
    recoverable for that certificate: the call is refused UNAUTHENTICATED, unread."""


def caller_of(context: grpc.ServicerContext, policy: CertificatePolicy = ROLES_ONLY) -> Caller | None:
    """Who makes the call: the node its node token names, else the node its client
    certificate names (mutual TLS with a certificate of `disttrain tls new`), else the
    operator when it presented the run's secret or an operator's certificate; None on a
    server that checks neither (anyone may call it, as anyone).

    Raises:
        UnknownCertificate: the call came with a client certificate that `policy` takes
            from nobody (whatever token it carries).
    """
    by_token: Caller | None = getattr(context, CALLER_ATTRIBUTE, None)
    by_certificate = _certificate_caller(context, policy)
    if by_token is not None and not by_token.is_operator:
        return by_token
    return by_certificate if by_certificate is not None and not by_certificate.is_operator \
        else by_token or by_certificate


def _certificate_caller(context: grpc.ServicerContext, policy: CertificatePolicy) -> Caller | None:
    try:
        pem = (context.auth_context() or {}).get("x509_pem_cert")
    except (AttributeError, ValueError):
        return None
    if not pem:
        return None
    caller = subject_caller(bytes(pem[0]), policy)
    if caller is None:
        raise UnknownCertificate("the client certificate names no role of this run (or another run); "
                                 "use a certificate of `disttrain tls new --node NAME:ROLE` for this run, "
                                 "or name it with --tls-operator on the server")
    return caller


def subject_caller(pem: bytes, policy: CertificatePolicy) -> Caller | None:
    """The caller the certificate `pem` names under `policy`; None: nobody (refused). A
    certificate whose run URI names another node or role than its subject names nobody."""
    try:
        names = certificate_names(pem)
    except ValueError:
        return None
    if names.run_id is not None and (names.role, names.node_id) != (names.unit, names.common_name):
        return None
    return certificate_caller(names.common_name, names.unit, names.run_id, policy)


def _refuse(request: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


def _refuse_stream(request: Any, context: grpc.ServicerContext):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)
    yield  # a generator, as a stream-response handler must be; abort raises first


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that refuses the call without reading its request: a request-streaming
    one whatever `handler`'s kind (the wire does not tell them apart), because gRPC reads a
    unary request whole before its handler runs (an outsider's 60 MB message was held in
    memory before it was refused); a stream is read only when its handler asks."""
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse_stream)
    return grpc.stream_unary_rpc_method_handler(_refuse)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call that carries neither the run's secret
    `token` nor a node token made from it, before its handler runs; tells the handler who
    calls (`caller_of`). The RPCs open to anyone (`OPEN_METHODS`: health checks) need none."""

    def __init__(self, token: str):
        self._secret = token
        self._refusals = RateLimitedLog(logger)  # an outsider's calls must not flood the log

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in OPEN_METHODS:
            return handler
        method = handler_call_details.method
        try:
            caller = _caller(handler_call_details.invocation_metadata, self._secret)
        except (ValueError, TypeError) as e:  # a credential no rule foresaw still names nobody
            self._refusals.warning(f"{method} malformed", "refused %s: malformed credentials (%s)", method,
                                   printable(str(e)))
            return _refusal(handler)
        if caller is not None:
            return _with_caller(handler, caller)
        self._refusals.warning(method, "refused %s: missing or wrong token", method)
        return _refusal(handler)


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _TokenSender(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token to the metadata of every call, of all four kinds."""

    def __init__(self, token: str):
        self._entry = (METADATA_KEY, SCHEME + token)

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(details.method, details.timeout, [*(details.metadata or ()), self._entry],
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel` sending `token` on every call (`channel` itself when token is None)."""
    return channel if token is None else grpc.intercept_channel(channel, _TokenSender(token))
