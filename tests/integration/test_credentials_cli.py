"""Secure by default, as real processes: a server command asked to listen beyond this
machine without the run's token or client certificates refuses (exit 2, one line saying
how to make them) unless given --insecure; `disttrain token new` and `disttrain tls new`
make credentials that a real coordinator, started with them on 0.0.0.0, requires: a
client holding them gets in, one without is refused."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.core.processes import EVENT_PREFIX, PARENT_ENV
from disttrain.core.tls import TlsFiles

pytestmark = pytest.mark.timeout(120)

REFUSING = [
    ["coordinator", "--bind", "0.0.0.0:0"],
    ["ps-server", "--bind", "0.0.0.0:0"],
    ["ddp", "--coordinator", "192.0.2.1:50050", "--check-config"],
    ["advise", "--serve", "--bind", "0.0.0.0:0"],
]


def without_token() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "DISTTRAIN_TOKEN"}


def run(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disttrain", *map(str, args)], capture_output=True,
                          text=True, timeout=90, env=env if env is not None else without_token())


class Served:
    """`disttrain coordinator ARGS` in a child process, until `stop`; `port` is where it listens."""

    def __init__(self, tmp_path: Path, *args: object, env: dict[str, str] | None = None):
        env = {**(env if env is not None else without_token()), PARENT_ENV: str(os.getpid()),
               "PYTHONUNBUFFERED": "1"}
        self.log = tmp_path / "coordinator.log"
        with self.log.open("ab") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "disttrain", "coordinator", "--registry", str(tmp_path / "cluster.db"),
                 *map(str, args)], stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                env=env, text=True)
        for line in self.process.stdout:  # the test's timeout bounds the wait
            if line.startswith(EVENT_PREFIX) and json.loads(line[len(EVENT_PREFIX):])["event"] == "listening":
                self.address = json.loads(line[len(EVENT_PREFIX):])["address"]
                break
        else:
            raise AssertionError(f"the coordinator did not start:\n{self.log.read_text()[-2000:]}")
        self.port = int(self.address.rpartition(":")[2])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)  # a loaded machine may take a while
        except subprocess.TimeoutExpired:
            self.process.kill()
            log = self.log.read_text()[-2000:]
            raise AssertionError(f"the coordinator did not stop on SIGTERM:\n{log}") from None


def registers(port: int, token: str | None = None, tls: TlsFiles | None = None) -> str:
    """"ok", or the status code's name with which the coordinator refused a registration
    and then a status request (the latter not retried)."""
    client = CoordinatorClient(f"localhost:{port}", token=token, tls=tls)
    try:
        client.status()
        client.register("worker0", "worker", retry_s=0)
        return "ok"
    except CoordinatorError as e:
        return e.code.name if e.code is not None else str(e)
    finally:
        client.close()


@pytest.mark.slow  # a command line start per case: make test runs it, make test-fast does not
@pytest.mark.parametrize("command", REFUSING, ids=lambda c: c[0])
def test_listening_beyond_this_machine_without_credentials_is_refused_with_how_to_make_them(command):
    result = run(*command)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    for advice in ("disttrain token new", "disttrain tls new", "--insecure"):
        assert advice in errors[0], errors[0]
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # a process of the command line
def test_tls_without_client_certificates_is_not_credentials(tmp_path):
    run("tls", "new", tmp_path / "certs").check_returncode()
    result = run("coordinator", "--bind", "0.0.0.0:0", "--tls-cert", tmp_path / "certs" / "server.pem",
                 "--tls-key", tmp_path / "certs" / "server.key", "--check-config")
    assert result.returncode == 2 and "TLS without --tls-ca lets any client in" in result.stderr


@pytest.mark.slow  # two command line starts per case: make test runs it, make test-fast does not
@pytest.mark.parametrize("command", [REFUSING[1], REFUSING[2]], ids=lambda c: c[0])
def test_insecure_or_a_loopback_bind_is_accepted(command):
    assert run(*command, "--check-config", "--insecure").returncode == 0
    loopback = [("127.0.0.1:0" if arg == "0.0.0.0:0" else "127.0.0.1:50050" if arg == "192.0.2.1:50050"
                 else arg) for arg in command]
    result = run(*loopback, "--check-config")
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow  # a process of the command line
def test_an_insecure_coordinator_serves_anyone_on_every_interface(tmp_path):
    served = Served(tmp_path, "--bind", "0.0.0.0:0", "--insecure")
    try:
        assert served.address.startswith("0.0.0.0:")
        assert registers(served.port) == "ok"
    finally:
        served.stop()


@pytest.mark.slow  # a process of the command line
def test_the_coordinator_binds_this_machine_only_by_default():
    result = run("coordinator", "--check-config")
    assert result.returncode == 0 and "listening on 127.0.0.1:50050" in result.stdout, result.stderr


@pytest.mark.slow  # processes of the command line: the credentials, then a server
def test_token_new_writes_a_private_secret_that_a_server_then_requires(tmp_path):
    token_file = tmp_path / "run.token"
    made = run("token", "new", token_file)
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 43 and token != run("token", "new").stdout.strip()  # 256 random bits each time
    again = run("token", "new", token_file)  # never over an existing secret
    assert again.returncode == 2 and token_file.read_text().strip() == token
    served = Served(tmp_path, "--bind", "0.0.0.0:0", "--token-file", token_file)
    try:
        assert registers(served.port, token=token) == "ok"
        assert registers(served.port) == grpc.StatusCode.UNAUTHENTICATED.name
        assert registers(served.port, token=run("token", "new").stdout.strip()) == "UNAUTHENTICATED"
    finally:
        served.stop()


@pytest.mark.slow  # processes of the command line: the credentials, then a server
def test_tls_new_makes_a_ca_and_certificates_a_server_then_requires(tmp_path):
    certs = tmp_path / "certs"
    made = run("tls", "new", certs, "--node", "worker0", "--node", "ops:operator")
    assert made.returncode == 0, made.stderr
    for name in ("ca", "server", "worker0", "ops"):
        assert stat.S_IMODE((certs / f"{name}.key").stat().st_mode) == 0o600, name
        assert (certs / f"{name}.pem").read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert run("tls", "new", certs).returncode == 2  # never over a run's files
    served = Served(tmp_path, "--bind", "0.0.0.0:0", "--tls-cert", certs / "server.pem",
                    "--tls-key", certs / "server.key", "--tls-ca", certs / "ca.pem")
    try:
        worker = TlsFiles(str(certs / "worker0.pem"), str(certs / "worker0.key"), str(certs / "ca.pem"))
        assert registers(served.port, tls=worker) == "ok"
        assert registers(served.port, tls=TlsFiles(ca=str(certs / "ca.pem"))) == "UNAVAILABLE"
        other = tmp_path / "other"
        run("tls", "new", other, "--node", "worker0").check_returncode()  # another run's CA
        stranger = TlsFiles(str(other / "worker0.pem"), str(other / "worker0.key"), str(certs / "ca.pem"))
        assert registers(served.port, tls=stranger) == "UNAVAILABLE"
    finally:
        served.stop()
