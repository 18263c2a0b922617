"""Certificates the TLS tests make for themselves: a CA, and certificates it signs for
127.0.0.1 and localhost, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Authority:
    name: str
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate
    pem_path: Path


def _name(common_name: str, unit: str = "") -> x509.Name:
    unit_attribute = [x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit)] if unit else []
    return x509.Name([*unit_attribute, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def make_authority(folder: Path, name: str = "test-ca") -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(key, hashes.SHA256()))
    path = _write(folder / f"{name}.pem", certificate.public_bytes(serialization.Encoding.PEM))
    return Authority(name, key, certificate, path)


def issue(authority: Authority, folder: Path, name: str, addresses: tuple[str, ...] = (), unit: str = ""
          ) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, localhost and `addresses` signed by `authority`, naming
    `name` (CN) and, when given, `unit` (OU: a role of the run, or "operator"); (cert, key)
    paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), *(x509.IPAddress(ipaddress.ip_address(a))
                                          for a in ("127.0.0.1", *addresses))]
    certificate = (x509.CertificateBuilder().subject_name(_name(name, unit))
                   .issuer_name(authority.certificate.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName(names), critical=False)
                   .sign(authority.key, hashes.SHA256()))
    cert = _write(folder / f"{name}.crt", certificate.public_bytes(serialization.Encoding.PEM))
    key_path = _write(folder / f"{name}.key", key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert, key_path


def run_authority(folder: Path) -> Authority:
    """The CA `disttrain tls new` (core.pki.write_run_pki) wrote into `folder`."""
    path = folder / "ca.pem"
    key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return Authority("ca", key, x509.load_pem_x509_certificate(path.read_bytes()), path)


def issue_for_run(authority: Authority, folder: Path, node_id: str, role: str, run_id: str
                  ) -> tuple[Path, Path]:
    """A certificate of `authority` as `disttrain tls new` makes them, for node `node_id` in
    `role` of run `run_id` (another run than the CA's, say); (cert, key) paths."""
    from disttrain.core.pki import NodeName, Signer
    from disttrain.core.pki import issue as issue_node
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = issue_node(Signer(authority.key, authority.certificate), key, NodeName(node_id, role),
                             run_id, ["localhost", "127.0.0.1"], days=1)
    name = f"{node_id}-{run_id}"
    cert = _write(folder / f"{name}.crt", certificate.public_bytes(serialization.Encoding.PEM))
    key_path = _write(folder / f"{name}.key", key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert, key_path
