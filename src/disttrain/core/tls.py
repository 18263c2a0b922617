"""TLS for the project's gRPC services: the PEM files a user names with `--tls-cert`,
`--tls-key` and `--tls-ca`, read once and turned into gRPC credentials.

A server needs its certificate and key; given a CA as well, it also asks every client for
a certificate signed by that CA (mutual TLS) and refuses those without one. A client
needs the CA that signed the server's certificate; given its own certificate and key as
well, it presents them. Errors name the file and the flag.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from disttrain.core.errors import ConfigError


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of one process; all None means plain TCP.

    Args:
        cert: this process's certificate chain (`--tls-cert`).
        key: its private key (`--tls-key`).
        ca: the certificate authority the peers' certificates must be signed by (`--tls-ca`).
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @property
    def enabled(self) -> bool:
        return any((self.cert, self.key, self.ca))

    @property
    def mutual(self) -> bool:
        """Whether a server with these files asks every client for a certificate."""
        return bool(self.cert and self.ca)

    def args(self) -> list[str]:
        """The flags that give a child process the same files (absolute paths: paths are not
        secrets, so a command line may carry them)."""
        return [item for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                                        ("--tls-ca", self.ca)) if path
                for item in (flag, os.path.abspath(path))]

    def channel(self, address: str, options: list | None = None) -> grpc.Channel:
        """A channel to `address`: TLS with these files when enabled, else plain TCP.

        Raises:
            ConfigError: a file cannot be read.
        """
        if self.enabled:
            return grpc.secure_channel(address, self.channel_credentials(), options=options)
        return grpc.insecure_channel(address, options=options)

    def check(self) -> None:
        """Raises ConfigError when a certificate comes without its key or the reverse, or a
        named file cannot be read."""
        if bool(self.cert) != bool(self.key):
            raise ConfigError("--tls-cert and --tls-key go together: give both (the certificate "
                              "and its private key) or neither")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path:
                _read(path, flag)

    def server_credentials(self) -> grpc.ServerCredentials:
        """The credentials a server listens with (mutual TLS when a CA is given).

        Raises:
            ConfigError: no certificate and key, or a file cannot be read.
        """
        self.check()
        if not self.cert:
            raise ConfigError("a server with TLS needs --tls-cert and --tls-key (and --tls-ca to "
                              "require client certificates)")
        pair = [(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))]
        if self.ca:
            return grpc.ssl_server_credentials(pair, root_certificates=_read(self.ca, "--tls-ca"),
                                               require_client_auth=True)
        return grpc.ssl_server_credentials(pair)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The credentials a client connects with: the CA to check the server against
        (the system's CAs when none is given), and its own certificate when it has one.

        Raises:
            ConfigError: a file cannot be read.
        """
        self.check()
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--tls-ca") if self.ca else None,
            private_key=_read(self.key, "--tls-key") if self.key else None,
            certificate_chain=_read(self.cert, "--tls-cert") if self.cert else None)


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot be read ({e.strerror or e})") from e
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{flag} {path}: is not a PEM file (no -----BEGIN line)")
    return data
