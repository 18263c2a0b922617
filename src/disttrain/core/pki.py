"""A run's own certificate authority and certificates, for `disttrain tls new`: a CA, the
operator's certificate (server.pem) and one certificate per node, whose subject names the
node (CN = node id) and its role (OU), and whose URI names its run, role and node
(`disttrain://<run id>/<role>/<node id>`; the CA's names the run too): how a server with
mutual TLS knows who calls it, and that the caller is of its run (`core.identity`).

Every certificate serves both ways (server and client authentication) and carries the
host names the servers are reached by; as a server's it is valid only for the service its
role names (DNS `<role>.<run id>.disttrain` and `<node id>.<role>.<run id>.disttrain`,
which the run's clients check: `core.channels`): a worker's certificate serves nobody
as a coordinator or a shard. The operator's serves any service of its run. Keys are EC
P-256, written with mode 600 before any byte of them is; nothing is overwritten.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrain.core.errors import ConfigError
from disttrain.core.identity import NODE_ROLES, SERVICE_ROLES, plain_label, run_uri, service_name
from disttrain.core.identity import OPERATOR_ROLE as OPERATOR

CA_FILES = ("ca.pem", "ca.key")
SERVER_NAME = "server"  # server.pem / server.key: an operator's certificate, for any process
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
CA_ROLE = "ca"  # the role the run's URI names in the CA's certificate


def new_run_id() -> str:
    """A fresh random run id (64 bits, hex): one DNS label."""
    return secrets.token_hex(8)


def check_run_id(run_id: str) -> str:
    """`run_id` when it can name a run in certificates (one DNS label: letters, digits, '-').

    Raises:
        ConfigError: it cannot.
    """
    if not plain_label(run_id):
        raise ConfigError(f"--run-id {run_id!r}: at most 63 letters, digits or '-' (not first or last), "
                          f"e.g. mnist-0412")
    return run_id.lower()


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


def write_run_pki(folder: Path, hosts: Sequence[str], nodes: Sequence[NodeName], days: int,
                  run_id: str | None = None) -> list[Path]:
    """Write a new CA (ca.pem, ca.key), the operator's certificate (server.pem, server.key)
    and each node's (<node_id>.pem, <node_id>.key) into `folder`, for run `run_id` (None: a
    fresh one), every certificate valid for `days` days and for `hosts` (DNS names or IP
    addresses) and, as a server's, for the services its role names.

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
        run_id = check_run_id(run_id) if run_id is not None else new_run_id()
        folder.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_subject = _subject("disttrain run CA", OPERATOR)
        ca_cert = _certificate(ca_subject, ca_key, Signer(ca_key), days,
                               AltNames((), (run_uri(run_id, CA_ROLE),)), ca=True)
        written = [_write(folder / "ca.pem", _pem(ca_cert)), _write_key(folder / "ca.key", ca_key)]
        for node in names:
            key = ec.generate_private_key(ec.SECP256R1())
            cert = issue(Signer(ca_key, ca_cert), key, node, run_id, hosts, days)
            written += [_write(folder / f"{node.node_id}.pem", _pem(cert)),
                        _write_key(folder / f"{node.node_id}.key", key)]
    except OSError as e:
        raise ConfigError(f"{folder}: cannot write the certificates there ({e.strerror or e})") from e
    return written


@dataclass(frozen=True)
class Signer:
    """Who signs a certificate: its private `key` and its certificate (None: the
    certificate signed is its own, a CA's)."""

    key: Any
    cert: Any = None


@dataclass(frozen=True)
class AltNames:
    """A certificate's subject alternative names: the `hosts` (names or addresses) and
    `uris` it is valid for."""

    hosts: tuple[str, ...]
    uris: tuple[str, ...]


def issue(ca: Signer, key, node: NodeName, run_id: str, hosts: Sequence[str], days: int):
    """The certificate of `node` (its public `key`) in run `run_id`, signed by the run's
    `ca`: valid for `hosts` and for the services its role names (the operator's: every
    service)."""
    if node.role == OPERATOR:
        services = [name for role in SERVICE_ROLES for name in (service_name(run_id, role),
                                                                 service_name(run_id, role, "*"))]
    else:
        services = [service_name(run_id, node.role)]
        if plain_label(node.node_id):
            services.append(service_name(run_id, node.role, node.node_id.lower()))
    return _certificate(_subject(node.node_id, node.role), key, ca, days,
                        AltNames((*hosts, *services), (run_uri(run_id, node.role, node.node_id),)))


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


def _certificate(subject, key, signer: Signer, days: int, names: AltNames, ca: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(signer.cert.subject if signer.cert is not None else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    alternatives = [*(_alternative_name(h) for h in names.hosts),
                    *(x509.UniformResourceIdentifier(u) for u in names.uris)]
    if alternatives:
        builder = builder.add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(signer.key, hashes.SHA256())


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
