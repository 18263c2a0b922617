"""How commands take TLS files: a certificate without its key, or a file that cannot be
read, stops each command before anything starts (exit 2, naming it); a real `disttrain
ps` or `disttrain ddp` run with `--tls-*` runs every server and client of the run over
mutual TLS, and `status --coordinator` reads a coordinator with TLS given the files."""

from __future__ import annotations

import json

import pytest
from tls_certs import issue, make_authority

from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.client import CoordinatorClient
from disttrain.coordinator.registry import read_status
from disttrain.coordinator.service import CoordinatorServer
from disttrain.core.credentials import Credentials
from disttrain.core.tls import TlsFiles

COMMANDS = [["ps"], ["ps-server"], ["ps-worker", "--servers", "127.0.0.1:1"], ["ddp"], ["coordinator"],
            ["status", "--coordinator", "127.0.0.1:1"]]


@pytest.fixture
def pki(tmp_path):
    authority = make_authority(tmp_path, "ca")
    cert, key = issue(authority, tmp_path, "node")  # a CA of the user's own: no role, no run named
    return {"cert": cert, "key": key, "ca": authority.pem_path}


# The certificate names no role of a run: its servers take it only when the operator names it
# as its own (passed on by the launcher to every process it starts).
OPERATOR = ("--tls-operator", "node")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_certificate_without_its_key_exits_2_naming_the_flags(cli, pki, command):
    result = cli(*command, "--tls-cert", pki["cert"], "--tls-ca", pki["ca"], timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--tls-cert and --tls-key go together" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_an_unreadable_file_exits_2_naming_it(cli, pki, tmp_path, command):
    missing = tmp_path / "absent-ca.pem"
    result = cli(*command, "--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", missing,
                 timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"--tls-ca {missing}: cannot be read" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_ps_run_with_mutual_tls_finishes(cli, pki, tmp_path):
    logs, checkpoints = tmp_path / "logs", tmp_path / "ckpt"
    result = cli("ps", "--workers", "2", "--dataset", "digits", "--num-epochs", "1", "--max-train-samples",
                 "256", "--log-dir", logs, "--checkpoint-dir", checkpoints, "--tls-cert", pki["cert"],
                 "--tls-key", pki["key"], "--tls-ca", pki["ca"], *OPERATOR, timeout=170)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["strategy"] == "ps-sync" and summary["samples_lost"] == 0
    assert summary["samples_applied"] == 256 and summary["steps"] > 0
    # the servers and the coordinator listened with mutual TLS, and every client got in with it
    for name in ("server0", "coordinator"):
        log = (logs / f"{name}.log").read_text()
        assert "TLS on for" in log and "mutual: clients need a certificate" in log, name


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_ddp_run_with_mutual_tls_reports_every_rank_to_its_coordinator(cli, pki, tmp_path):
    logs = tmp_path / "logs"
    result = cli("ddp", "--world-size", "2", "--dataset", "digits", "--num-epochs", "1",
                 "--max-train-samples", "256", "--log-dir", logs, "--checkpoint-dir", tmp_path / "ckpt",
                 "--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"], *OPERATOR,
                 timeout=170)
    assert result.returncode == 0, result.stderr[-2000:]
    # the ranks reached the coordinator (which required their certificate) and said they finished
    status = read_status(logs / "cluster.db", max_events=100)
    assert {node["node_id"]: node["state"] for node in status.nodes} == {"rank0": "done", "rank1": "done"}
    for name in ("rank0", "rank1"):  # joined: registered by the rank itself, over TLS
        assert [e["kind"] for e in status.events if e["node_id"] == name] == ["joined", "done"]
    log = (logs / "coordinator.log").read_text()
    assert "TLS on for" in log and "mutual: clients need a certificate" in log


@pytest.mark.slow  # processes of the command line
@pytest.mark.timeout(120)
def test_status_reads_a_coordinator_with_mutual_tls_only_with_the_files(cli, pki, tmp_path):
    files = TlsFiles(str(pki["cert"]), str(pki["key"]), str(pki["ca"]), operators=("node",))
    server = CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0", tmp_path / "registry.db",
                               credentials=Credentials(tls=files))
    try:
        client = CoordinatorClient(server.address, tls=files)
        client.register("worker0", "worker")
        client.close()
        shown = cli("status", "--coordinator", server.address, "--json", "--tls-cert", pki["cert"],
                    "--tls-key", pki["key"], "--tls-ca", pki["ca"], timeout=60)
        assert shown.returncode == 0, shown.stderr[-2000:]
        assert [node["node_id"] for node in json.loads(shown.stdout)["nodes"]] == ["worker0"]
        plain = cli("status", "--coordinator", server.address, "--json", timeout=60)
        assert plain.returncode != 0 and "worker0" not in plain.stdout
    finally:
        server.stop(0)
