"""How commands take the token: a bad `--token-file` stops each before anything starts;
a real `disttrain ps` run hands its token to its children without a trace in their
command lines, logs or files."""

from __future__ import annotations

import json

import pytest

TOKEN = "a-token-that-must-not-leak-0123456789"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["ps"], ["ps-server"], ["ps-worker", "--servers", "127.0.0.1:1"],
                                     ["ddp"], ["coordinator"], ["status", "--coordinator", "127.0.0.1:1"]])
def test_an_empty_token_file_exits_2_naming_it(cli, tmp_path, command):
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    token_file.chmod(0o600)
    result = cli(*command, "--token-file", token_file, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"--token-file {token_file}: the token is empty" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_ps_run_keeps_its_token_out_of_command_lines_logs_and_files(cli, tmp_path):
    logs, checkpoints = tmp_path / "logs", tmp_path / "ckpt"
    result = cli("ps", "--workers", "2", "--dataset", "digits", "--num-epochs", "1", "--max-train-samples",
                 "256", "-v", "--log-dir", logs, "--checkpoint-dir", checkpoints, timeout=170,
                 env={"DISTTRAIN_TOKEN": TOKEN})
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((logs / "summary.json").read_text())["strategy"] == "ps-sync"
    # -v logs every child's command line as it starts: none carries the token
    started = [line for line in result.stderr.splitlines() if "started " in line and "(pid " in line]
    assert {"coordinator", "server0", "worker0", "worker1"} <= {line.split("started ")[1].split()[0]
                                                               for line in started}
    assert TOKEN not in result.stdout and TOKEN not in result.stderr
    files = [path for folder in (logs, checkpoints) for path in folder.rglob("*") if path.is_file()]
    assert any(path.suffix == ".log" for path in files) and (logs / "config.yaml") in files
    assert [path for path in files if TOKEN.encode() in path.read_bytes()] == []
    # the servers and the coordinator required the token, and the workers had it: the run finished
    for name in ("server0", "coordinator"):
        assert "without the run's token are refused" in (logs / f"{name}.log").read_text()
