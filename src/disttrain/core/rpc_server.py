"""Every gRPC server of the project started one way: its port bound exclusively, the
standard health service (`grpc.health.v1.Health`) beside its own for orchestrators'
probes, every other call checked for the run's token when it has one (`auth`), every
call checked against the authorization table (`rpc_access`, `access`), TLS when given
certificates (`tls`; mutual with a CA), and a warning when it listens beyond this
machine without a token or client certificates.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from disttrain.core import rpc_faults
from disttrain.core.addresses import parse_address
from disttrain.core.auth import TokenInterceptor
from disttrain.core.credentials import Credentials
from disttrain.core.errors import ConfigError
from disttrain.core.identity import ROLES_ONLY
from disttrain.core.refusal_log import RefusalLog, printable
from disttrain.core.rpc_access import AccessInterceptor, check_service
from disttrain.core.tls import TlsFiles

logger = logging.getLogger(__name__)

# A second server on a port already taken must fail, not share it silently (gRPC turns
# SO_REUSEPORT on by default on Linux).
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]
# The bytes a client may send on one call before the server reads any (HTTP/2's stream
# window, when an option sets it): what an unauthenticated caller can make a server hold,
# since a refused call is never read (`auth`): with the parameter server's 64 MB (its
# clients' setting, for pulls) an outsider's refused 60 MB message still sat in memory.
# Measured on a shard's options: 16 outsiders' 60 MB messages at once grew the server by
# 570 MB (kept after) before, by 6 MB with both. A message a handler reads widens the
# window to its size, so an authenticated push is not held back (its time on loopback
# changed within the noise).
LOOKAHEAD_OPTION = "grpc.http2.lookahead_bytes"
MAX_LOOKAHEAD_BYTES = 1 << 20


def server_options(options: list[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    """`options` for a server: a stream window they set capped at `MAX_LOOKAHEAD_BYTES`,
    the port bound exclusively."""
    capped = [(key, min(value, MAX_LOOKAHEAD_BYTES) if key == LOOKAHEAD_OPTION else value)
              for key, value in options or ()]
    return [*capped, *SERVER_OPTIONS]


@contextmanager
def refusals(context: grpc.ServicerContext, codes: Sequence[tuple[type[Exception], grpc.StatusCode]],
             log: RefusalLog | None = None, method: str = "a call") -> Iterator[None]:
    """Answer a refusal raised in the block with its status code and message: the code
    of the first class in `codes` the error is an instance of (list subclasses first).
    Other errors go on. With `log`, the refusal of `method` is logged as a warning as
    `log` allows (once per caller host per period, with a count), control characters
    escaped."""
    try:
        yield
    except tuple(kind for kind, _ in codes) as e:
        code = next(code for kind, code in codes if isinstance(e, kind))
        if log is not None:
            caller = context.peer().rpartition(":")[0] or context.peer()  # its host: ports change
            count = log.refused(caller, time.monotonic())
            if count:
                more = f" ({count - 1} more refused since the last warning)" if count > 1 else ""
                logger.warning("refused %s from %s (%s): %s%s", method, printable(caller), code.name,
                               printable(str(e)), more)
        context.abort(code, str(e))


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """The credentials a server listens with (mutual TLS when a CA is given).

    Raises:
        ConfigError: no certificate and key, or a file cannot be read.
    """
    tls.check()
    if not tls.cert:
        raise ConfigError("a server with TLS needs --tls-cert and --tls-key (and --tls-ca to "
                          "require client certificates)")
    pair = [(tls.read("key"), tls.read("cert"))]
    if tls.ca:
        return grpc.ssl_server_credentials(pair, root_certificates=tls.read("ca"), require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


@dataclass(frozen=True)
class ServerLimits:
    """How much a gRPC server takes at once.

    Attributes:
        max_threads: the handler threads (each long-poll holds one).
        maximum_concurrent_rpcs: calls in progress or queued at once; a call over it is
            refused RESOURCE_EXHAUSTED at once (None: unbounded).
        options: further gRPC server options (message sizes).
    """

    max_threads: int
    maximum_concurrent_rpcs: int | None = None
    options: tuple[tuple[str, Any], ...] = ()


class RpcServer:
    """A started gRPC server with the health service.

    Args:
        handler: the service's generic handler.
        service: its full name, reported SERVING by the health service while it serves.
        bind: HOST:PORT to listen on (port 0: a free one; `address` says which).
        limits: its threads, calls at once and gRPC options.
        credentials: with a token, every call but the health service's must carry it (else
            it is refused UNAUTHENTICATED before its handler runs), without one it is open
            to anyone; with TLS files enabled, it listens with TLS (its certificate and key;
            with its CA, every client must present a certificate that CA signed), else plain
            TCP.

    Every call is checked against its row of the authorization table (`core.access`); a
    call of a method without one is refused.

    Raises:
        ConfigError: the address is malformed or cannot be listened on, or a TLS file
            cannot be read.
        ValueError: a method of `service` (in the proto descriptors) has no row in the
            authorization table.
    """

    def __init__(self, handler: grpc.GenericRpcHandler, service: str, bind: str, limits: ServerLimits,
                 credentials: Credentials | None = None):
        check_service(service)
        host, port = parse_address(bind, "--bind")
        token = None if credentials is None else credentials.token
        tls = (None if credentials is None else credentials.tls) or TlsFiles()
        credentials = server_credentials(tls) if tls.enabled else None  # a bad file fails before binding
        # The health service stays open without the token (the interceptor lets it through),
        # so orchestrators' probes work.
        # The network fault points first: a partitioned server refuses even a bad token's call.
        interceptors = rpc_faults.server_interceptors()
        if token is not None:
            interceptors.append(TokenInterceptor(token))
        # who calls is known from here on (a client certificate: as its CA's run says)
        interceptors.append(AccessInterceptor(tls.policy() if tls.mutual else ROLES_ONLY))
        self.server = grpc.server(futures.ThreadPoolExecutor(limits.max_threads, thread_name_prefix="rpc"),
                                  interceptors=interceptors, options=server_options(list(limits.options)),
                                  maximum_concurrent_rpcs=limits.maximum_concurrent_rpcs)
        self.server.add_generic_rpc_handlers((handler,))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            bound = (self.server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
                     else self.server.add_insecure_port(f"{host}:{port}"))
        except RuntimeError as e:
            logger.debug("binding %s failed: %s", bind, e)
            bound = 0
        if bound == 0:
            raise ConfigError(f"--bind {bind}: cannot listen there (the port is taken, or the address "
                              f"is not this machine's); pick a free port, or 0 for any")
        self.address = f"{host}:{bound}"
        for name in ("", service):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.server.start()
        _log_protection(self.address, host, token is not None, tls)

    def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING to health probes, then stop within `grace_s`."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def _log_protection(address: str, host: str, has_token: bool, tls: TlsFiles) -> None:
    """Say how the server is protected; warn when other machines can reach it and call it
    without a token or a client certificate."""
    if tls.enabled:
        logger.info("TLS on for %s (%s)", address, "mutual: clients need a certificate signed by "
                    "--tls-ca" if tls.mutual else "clients are not asked for a certificate")
    if has_token:
        logger.info("calls to %s without the run's token are refused (health checks excepted)", address)
    elif is_loopback(host) or tls.mutual:
        return  # only this machine, or only clients holding a certificate of the run's CA, get in
    elif tls.enabled:
        logger.warning("listening on %s with TLS but without a token or client certificates: any "
                       "client that reaches this port can still call it; set DISTTRAIN_TOKEN (or "
                       "--token-file), or give --tls-ca to require client certificates", address)
    else:
        logger.warning("listening on %s, reachable from other machines, without authentication: "
                       "anyone who reaches this port can use the service; set DISTTRAIN_TOKEN (or "
                       "--token-file) on every process of the run (and --tls-* for encryption), bind "
                       "127.0.0.1 unless other machines must connect, and keep the port behind a "
                       "firewall", address)


INSECURE_FLAG = "--insecure"


def require_credentials(address: str, flag: str, exposure: str, has_token: bool, tls: TlsFiles,
                        insecure: bool = False) -> None:
    """Refuse `address` (given with `flag`) when other machines reach it (`exposure` says
    what would be reachable, e.g. "the coordinator would be reachable from other
    machines") without credentials: the run's token, or mutual TLS (TLS alone encrypts, but lets any client
    in). A loopback address, or `insecure` (the user's `--insecure`), passes.

    Raises:
        ConfigError: `address` is malformed, or reachable from other machines while
            neither a token nor client certificates are required; the message says how
            to make them (exit code 2).
    """
    host, _ = parse_address(address, flag)
    if insecure or is_loopback(host) or has_token or tls.mutual:
        return
    missing = ("TLS without --tls-ca lets any client in, and there is no token" if tls.enabled
               else "there is no token and no TLS")
    raise ConfigError(f"{flag} {address}: {exposure}, but {missing}; "
                      f"make a run secret with `disttrain token new run.token` and give --token-file "
                      f"run.token to every process, or certificates with `disttrain tls new DIR` "
                      f"(--tls-cert, --tls-key, --tls-ca); or use 127.0.0.1, or add {INSECURE_FLAG} "
                      f"on a network you trust")


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only ("localhost", 127.x, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface
