"""A client's gRPC channel to a server of the run: over TLS when the process has TLS
files (`core.tls`), plain TCP otherwise, carrying the run's token on every call when
there is one (`core.auth`). Every client of the project (a worker's shard clients, the
coordinator client) opens its channels here.
"""

from __future__ import annotations

import grpc

from disttrain.core import rpc_faults
from disttrain.core.auth import with_token
from disttrain.core.tls import TlsFiles


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """The credentials a client connects with: the CA to check the server against (the
    system's CAs when none is given), and its own certificate when it has one.

    Raises:
        ConfigError: a file cannot be read.
    """
    tls.check()
    return grpc.ssl_channel_credentials(root_certificates=tls.read("ca"), private_key=tls.read("key"),
                                        certificate_chain=tls.read("cert"))


def open_channel(address: str, tls: TlsFiles | None = None, token: str | None = None,
                 options: list | None = None) -> grpc.Channel:
    """A channel to `address`: TLS with `tls` when enabled, else plain TCP; every call
    carries `token` when given, and passes the network fault points (`core.failpoints`)
    when a network fault is meant for this process.

    Raises:
        ConfigError: a TLS file cannot be read.
    """
    tls = tls or TlsFiles()
    if tls.enabled:
        channel = grpc.secure_channel(address, channel_credentials(tls), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    return with_token(rpc_faults.wrap_channel(channel), token)
