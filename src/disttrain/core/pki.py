"""A run's own certificate authority and certificates, for `disttrain tls new`: a CA, a
certificate for the servers (its subject alternative names the hosts they are reached
by) and one certificate per node, whose subject names the node (CN = node id) and its
role (OU), which is how a server with mutual TLS knows who calls it (`core.identity`).

Every certificate serves both ways (server and client authentication) and carries the
same host names, so a node's certificate is also its certificate as a server. Keys are
EC P-256, written with mode 600 before any byte of them is; nothing is overwritten.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from disttrain.core.errors import ConfigError
from disttrain.core.identity import NODE_ROLES
from disttrain.core.identity import OPERATOR_ROLE as OPERATOR

CA_FILES = ("ca.pem", "ca.key")
SERVER_NAME = "server"  # server.pem / server.key: an operator's certificate, for any process
DEFAULT_HOSTS = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class NodeName:
    """A certificate to issue: `node_id` (its CN) in `role` (its OU)."""

    node_id: str
    role: str


def parse_node(text: str, roles: Sequence[str] = NODE_ROLES) -> NodeName:
    """`NAME[:ROLE]` as a NodeName; without ROLE, the role is NAME without its trailing
    digits when that is one of `roles` (worker3 -> worker), else an error.

    Raises:
        ConfigError: an empty or odd name, an unknown role, or no role to infer.
    """
    name, _, role = text.partition(":")
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ConfigError(f"--node {text!r}: the name must be letters, digits, '-', '_' or '.', "
                          f"e.g. worker0 or worker0:worker")
    role = role or name.rstrip("0123456789")
    if role not in (*roles, OPERATOR):
        raise ConfigError(f"--node {text!r}: the role must be one of {', '.join((*roles, OPERATOR))}; "
                          f"write NAME:ROLE, e.g. {name}:worker")
    return NodeName(name, role)


def write_run_pki(folder: Path, hosts: Sequence[str], nodes: Sequence[NodeName], days: int) -> list[Path]:
    """Write a new CA (ca.pem, ca.key), the servers' certificate (server.pem, server.key;
    role operator) and each node's (<node_id>.pem, <node_id>.key) into `folder`, every
    certificate valid for `days` days and for `hosts` (DNS names or IP addresses).

    Returns:
        The files written.

    Raises:
        ConfigError: a file of that name is already there (nothing is written), or the
            folder cannot be written.
    """
    from cryptography.hazmat.primitives.asymmetric import ec

    names = [NodeName(SERVER_NAME, OPERATOR), *nodes]
    planned = [folder / name for name in CA_FILES] + [folder / f"{n.node_id}.{ext}"
                                                      for n in names for ext in ("pem", "key")]
    if len(set(planned)) != len(planned):
        raise ConfigError("--node: each name once, and not 'server' or 'ca' (taken by the CA and the "
                          "servers' certificate)")
    taken = [str(path) for path in planned if path.exists()]
    if taken:
        raise ConfigError(f"{', '.join(taken)}: already there; pick an empty folder (certificates of "
                          f"a run are made together, by one CA)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_subject = _subject("disttrain run CA", OPERATOR)
        ca_cert = _certificate(ca_subject, ca_key, ca_key, None, days, (), ca=True)
        written = [_write(folder / "ca.pem", _pem(ca_cert)), _write_key(folder / "ca.key", ca_key)]
        for node in names:
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _certificate(_subject(node.node_id, node.role), key, ca_key, ca_cert, days, hosts)
            written += [_write(folder / f"{node.node_id}.pem", _pem(cert)),
                        _write_key(folder / f"{node.node_id}.key", key)]
    except OSError as e:
        raise ConfigError(f"{folder}: cannot write the certificates there ({e.strerror or e})") from e
    return written


def _subject(common_name: str, role: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "disttrain"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _alternative_name(host: str):
    from cryptography import x509
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def _certificate(subject, key, issuer_key, issuer_cert, days: int, hosts: Sequence[str], ca: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer_cert.subject if issuer_cert is not None else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        builder = (builder.add_extension(x509.SubjectAlternativeName([_alternative_name(h) for h in hosts]),
                                         critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return certificate.public_bytes(serialization.Encoding.PEM)


def _write_key(path: Path, key) -> Path:
    from cryptography.hazmat.primitives import serialization
    return _write(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()), mode=0o600)


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    """Create `path` (never over an existing file) with `mode` from its first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as handle:
        os.fchmod(handle.fileno(), mode)  # the umask may have taken bits away; never added any
        handle.write(data)
    return path
