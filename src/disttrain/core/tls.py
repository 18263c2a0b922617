"""TLS for the project's gRPC services: the PEM files a user names with `--tls-cert`,
`--tls-key` and `--tls-ca`, checked and read here; `core.channels` and
`core.rpc_server` turn them into gRPC credentials.

A server needs its certificate and key; given a CA as well, it also asks every client for
a certificate signed by that CA (mutual TLS) and refuses those without one. A client
needs the CA that signed the server's certificate; given its own certificate and key as
well, it presents them. Errors name the file and the flag.

A CA of `disttrain tls new` names its run (`core.identity`): a server under it takes only
certificates of that run naming a role of it (or those `--tls-operator` names), and a
client under it takes a server's certificate only for the service the certificate names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from disttrain.core.errors import ConfigError
from disttrain.core.identity import CertificatePolicy, parse_run_uri
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
        operators: common names of client certificates a server takes as the operator's
            although they name no role of the run (`--tls-operator`).
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    operators: tuple[str, ...] = ()

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

    @property
    def run_id(self) -> str | None:
        """The run the CA was made for (`disttrain tls new`); None without a CA, or for a CA
        that names no run.

        Raises:
            ConfigError: the CA cannot be read.
        """
        ca = self.read("ca")
        return None if ca is None else run_of(ca)

    def policy(self) -> CertificatePolicy:
        """Which client certificates a server with these files takes, and as whom."""
        return CertificatePolicy(self.run_id, self.operators)

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


@dataclass(frozen=True)
class CertificateNames:
    """What a certificate names: its subject's CN and OU, and the run, role and node its
    run URI names (empty strings when it has none)."""

    common_name: str
    unit: str
    run_id: str | None = None
    role: str = ""
    node_id: str = ""


@functools.lru_cache(maxsize=256)  # a peer's certificate is the same on each of its calls
def certificate_names(pem: bytes) -> CertificateNames:
    """The names of the first certificate of PEM `pem`.

    Raises:
        ValueError: `pem` holds no certificate.
    """
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    certificate = x509.load_pem_x509_certificate(pem)
    subject = certificate.subject

    def first(oid) -> str:
        values = subject.get_attributes_for_oid(oid)
        return str(values[0].value) if values else ""
    try:
        uris = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
            .get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    named = [parsed for parsed in map(parse_run_uri, uris) if parsed is not None]
    run_id, role, node_id = named[0] if len(named) == 1 else (None, "", "")  # two runs: neither
    return CertificateNames(first(NameOID.COMMON_NAME), first(NameOID.ORGANIZATIONAL_UNIT_NAME),
                            run_id, role, node_id)


def run_of(pem: bytes) -> str | None:
    """The run a CA's certificate (PEM) names; None when it names none (a CA of the user's own)."""
    try:
        return certificate_names(pem).run_id
    except ValueError:
        return None
