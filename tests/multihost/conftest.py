"""Fixtures of the multi-host tests: a network of namespaces (skipped where it cannot be
made), certificates naming each host's 192.0.2.x address, and reading the event lines a
server prints once it listens."""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from netns import Network, unavailable_reason
from tls_certs import Authority, make_authority

from disttrain.core.processes import PARENT_ENV


@pytest.fixture(scope="session")
def namespaces_reason() -> str | None:
    return unavailable_reason()


@pytest.fixture
def network(namespaces_reason):
    """`network(["a", "b"])` makes hosts a, b at 192.0.2.1, .2; everything is removed at the
    end of the test, whatever its outcome."""
    if namespaces_reason:
        pytest.skip(namespaces_reason)
    made: list[Network] = []

    def make(names: list[str]) -> Network:
        net = Network(names).__enter__()
        made.append(net)
        return net

    yield make
    for net in made:
        net.close()


def issue_for(authority: Authority, folder: Path, name: str, address: str) -> tuple[Path, Path]:
    """A certificate naming `address` (and 127.0.0.1) in its subjectAltName, signed by
    `authority`; (cert, key) paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    names = [x509.IPAddress(ipaddress.ip_address(a)) for a in (address, "127.0.0.1")]
    certificate = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(authority.certificate.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName(names), critical=False)
                   .sign(authority.key, hashes.SHA256()))
    cert, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert, key_path


@pytest.fixture
def host_tls(tmp_path):
    """`host_tls(host)`: the --tls-* flags for a host, its certificate naming its address."""
    folder = tmp_path / "pki"
    folder.mkdir()
    authority = make_authority(folder, "run-ca")

    def flags(host) -> list[str]:
        cert, key = issue_for(authority, folder, host.name, host.address)
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(authority.pem_path)]

    return flags


@pytest.fixture
def run_env() -> dict[str, str]:
    """Environment of every process of a run: one token, and this test process as their
    launcher (so servers print the address they bound, and die with the test)."""
    return {"DISTTRAIN_TOKEN": secrets.token_urlsafe(32), PARENT_ENV: str(os.getpid()),
            "OMP_NUM_THREADS": "1"}
