"""TLS for the project's gRPC services: the PEM files a user names with `--tls-cert`,
`--tls-key` and `--tls-ca`, checked and read here; `core.channels` and
`core.rpc_server` turn them into gRPC credentials.

A server needs its certificate and key; given a CA as well, it also asks every client for
a certificate signed by that CA (mutual TLS) and refuses those without one. A client
needs the CA that signed the server's certificate; given its own certificate and key as
well, it presents them. Errors name the file and the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from disttrain.core.errors import ConfigError
from disttrain.core.secret_files import read_private

# field -> the flag a user names it with (in errors)
FLAG_OF = {"cert": "--tls-cert", "key": "--tls-key", "ca": "--tls-ca"}


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

    def check(self) -> None:
        """Raises ConfigError when a certificate comes without its key or the reverse, or a
        named file cannot be read."""
        if bool(self.cert) != bool(self.key):
            raise ConfigError("--tls-cert and --tls-key go together: give both (the certificate "
                              "and its private key) or neither")
        for name in FLAG_OF:
            self.read(name)

    def read(self, name: str) -> bytes | None:
        """The PEM bytes of file `name` ("cert", "key" or "ca"); None when not given.

        Raises:
            ConfigError: the file cannot be read, is not PEM, or is the private key and
                not private to its reader (`secret_files`); the flag and file named.
        """
        path, flag = getattr(self, name), FLAG_OF[name]
        if not path:
            return None
        if name == "key":  # a private key is its reader's own, as a token file is
            data = read_private(path, flag)
        else:
            try:
                data = Path(path).read_bytes()
            except OSError as e:
                raise ConfigError(f"{flag} {path}: cannot be read ({e.strerror or e})") from e
        if b"-----BEGIN" not in data:
            raise ConfigError(f"{flag} {path}: is not a PEM file (no -----BEGIN line)")
        return data
