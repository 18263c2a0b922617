"""A client's gRPC channel to a server of the run: over TLS when the process has TLS
files (`core.tls`), plain TCP otherwise, carrying the run's token on every call when
there is one (`core.auth`). Every client of the project (a worker's shard clients, the
coordinator client) opens its channels here.

Under a CA of `disttrain tls new` (which names its run), a client takes a server's
certificate only for the service it reaches: the certificate must carry the DNS name of
that role in that run (`core.identity.service_name`; a shard's also its node, `server<S>`),
checked by TLS in place of the host name, so a worker's certificate, or one of another
run, cannot serve as the coordinator's or a shard's. Under a CA of the user's own, the
host name is checked, as TLS does.
"""

from __future__ import annotations

import grpc

from disttrain.core import rpc_faults
from disttrain.core.auth import with_token
from disttrain.core.identity import service_name
from disttrain.core.tls import TlsFiles

# The option naming the name a server's certificate must carry, in place of the host's.
TARGET_NAME_OPTION = "grpc.ssl_target_name_override"


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """The credentials a client connects with: the CA to check the server against (the
    system's CAs when none is given), and its own certificate when it has one.

    Raises:
        ConfigError: a file cannot be read.
    """
    tls.check()
    return grpc.ssl_channel_credentials(root_certificates=tls.read("ca"), private_key=tls.read("key"),
                                        certificate_chain=tls.read("cert"))


def expected_name(tls: TlsFiles, role: str | None, node_id: str = "") -> str | None:
    """The name the server's certificate must carry when it serves as `role` (node
    `node_id` when given): None when nothing beyond the host name is checked (no role
    given, or a CA that names no run).

    Raises:
        ConfigError: the CA cannot be read.
    """
    run_id = tls.run_id if role else None
    return None if run_id is None or role is None else service_name(run_id, role, node_id.lower())


def wrong_service(error: grpc.RpcError) -> bool:
    """Whether `error` says the server's certificate does not serve the service the channel
    asked for (`open_channel`'s `role`): TLS ended the connection before any call."""
    details = error.details() if hasattr(error, "details") else ""
    return "Hostname Verification Check failed" in (details or "")


def open_channel(address: str, tls: TlsFiles | None = None, token: str | None = None,
                 options: list | None = None, role: str | None = None, node_id: str = "") -> grpc.Channel:
    """A channel to `address`: TLS with `tls` when enabled, else plain TCP; every call
    carries `token` when given, and passes the network fault points (`core.failpoints`)
    when a network fault is meant for this process. With `role` (and `node_id`), the
    server's certificate must serve as that role (and node) of the run (see the module):
    another is refused as TLS refuses one of another CA (UNAVAILABLE).

    Raises:
        ConfigError: a TLS file cannot be read.
    """
    tls = tls or TlsFiles()
    if tls.enabled:
        name = expected_name(tls, role, node_id)
        if name is not None:
            options = [*(options or ()), (TARGET_NAME_OPTION, name)]
        channel = grpc.secure_channel(address, channel_credentials(tls), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    return with_token(rpc_faults.wrap_channel(channel), token)
