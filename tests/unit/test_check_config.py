"""`--check-config` on every command that starts processes or training: a good command line
prints one line of what would run and exits 0, binding, starting and writing nothing; a bad
one exits 2 with the real run's one-line error."""

import socket
import subprocess
from pathlib import Path

import grpc
import pytest
import torch

from disttrain import cli
from disttrain.core.processes import PARENT_ENV

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    """Fail the test on any bound socket, gRPC server or child process."""
    torch.set_num_threads(1)

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run must not bind, serve or start anything")

    monkeypatch.setattr(socket.socket, "bind", refuse)
    monkeypatch.setattr(grpc, "server", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(cli, "setup_logging", lambda *args, **kwargs: None)


def folders(tmp_path: Path) -> list[str]:
    return ["--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")]


def good_commands(tmp_path: Path) -> dict[str, list[str]]:
    return {
        "baseline": ["baseline", "--config", "example", *folders(tmp_path)],
        "ps": ["ps", "--config", "ps_sync_topk", "--servers", "2", *folders(tmp_path)],
        "ps-server": ["ps-server", "--config", "ps_sync_mnist", "--bind", "0.0.0.0:50051", "--shard", "0/2",
                      "--insecure", *folders(tmp_path)],
        "ps-worker": ["ps-worker", "--config", "ps_sync_mnist", "--servers", "hostA:50051,hostA:50052",
                      "--rank", "1", "--coordinator", "hostC:50050", *folders(tmp_path)],
        "coordinator": ["coordinator", "--bind", "0.0.0.0:50050", "--registry", str(tmp_path / "r.db"),
                        "--insecure"],
        "ddp": ["ddp", "--config", "ddp_mnist", "--backend", "gloo", *folders(tmp_path)],
        "compare": ["compare", "--config", "example", "--strategies", "baseline,ps-sync",
                    "--output-dir", str(tmp_path / "out")],
        "validate": ["validate", "--config", "example", "--output-dir", str(tmp_path / "out")],
    }


@pytest.mark.parametrize("command", ["baseline", "ps", "ps-server", "ps-worker", "coordinator", "ddp",
                                     "compare", "validate"])
def test_good_command_line_says_what_would_run_and_starts_nothing(command, tmp_path, capsys):
    assert cli.main([*good_commands(tmp_path)[command], "--check-config"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"{command}: ") and out[0].endswith("; config OK")
    assert list(tmp_path.iterdir()) == []  # no checkpoint, log, registry or output folder


def test_lines_name_what_the_run_is(tmp_path, capsys):
    commands = good_commands(tmp_path)
    expected = {
        "ps-server": ["shard 0/2 of a sync run for 2 workers", "listening on 0.0.0.0:50051"],
        "ps-worker": ["rank 1", "hostA:50051,hostA:50052", "coordinator at hostC:50050"],
        "ps": ["2 server shards", "topk 0.1 compression"],
        "ddp": ["2 ranks on this node", "gloo"],
        "coordinator": ["listening on 0.0.0.0:50050", str(tmp_path / "r.db")],
        "compare": ["2 runs in turn (baseline, ps-sync)", str(tmp_path / "out")],
    }
    for command, parts in expected.items():
        assert cli.main([*commands[command], "--check-config"]) == 0
        line = capsys.readouterr().out
        assert all(part in line for part in parts), (command, line)


BAD = {
    "baseline": (["baseline", "--config", "example", "--set", "training.batch_size=0"],
                 "training.batch_size: 0 must be > 0"),
    "unknown config": (["baseline", "--config", "exampel"], "nor the name of a shipped config"),
    "ps": (["ps", "--config", "ps_sync_mnist", "--compression-enabled", "--compression-type", "powersgd"],
           "powersgd"),
    "ps-server bind": (["ps-server", "--bind", "0.0.0.0:99999"], "--bind"),
    "ps-server shard": (["ps-server", "--shard", "2/2"], "--shard '2/2'"),
    "ps-worker": (["ps-worker", "--servers", "hostA:50051,hostB"], "--servers"),
    "ps-worker coordinator": (["ps-worker", "--servers", "h:1", "--coordinator", "nope"],
                              "coordinator.address"),
    "coordinator": (["coordinator", "--bind", "nowhere"], "--bind"),
    "ddp": (["ddp", "--world-size", "3", "--nnodes", "2", "--rdzv-endpoint", "n0:29400"], "does not split"),
    "ddp precision": (["ddp", "--backend", "gloo", "--precision", "fp16"], "training.precision: fp16"),
    "renamed key": (["ddp", "--backend", "gloo", "--set", "ddp.mixed_precision=bf16"],
                    "ddp.mixed_precision: unknown key; it is training.precision now"),
    "ps precision": (["ps", "--precision", "fp16"], "training.precision: fp16 needs loss scaling"),
    "compare": (["compare", "--strategies", "baseline,nope"], "--strategies"),
    "validate": (["validate", "--tolerance", "2"], "--tolerance"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_command_line_exits_2_with_the_runs_one_line_error(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, message = BAD[case]
    assert cli.main([*argv, "--check-config"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_token_and_tls_files_are_checked(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-enough-length\n")
    token.chmod(0o600)
    argv = ["ps-worker", "--servers", "h:1", *folders(tmp_path), "--check-config"]
    assert cli.main([*argv, "--token-file", str(token)]) == 0
    assert "with token" in capsys.readouterr().out
    token.chmod(0o644)
    assert cli.main([*argv, "--token-file", str(token)]) == 2
    assert cli.main([*argv, "--token-file", str(tmp_path / "absent")]) == 2
    assert cli.main([*argv, "--tls-cert", str(tmp_path / "absent.pem")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and "--token-file" in errors[1] and "--tls" in errors[2]


@pytest.fixture
def user_started(monkeypatch):
    """As a process the user typed: no launcher named in the environment."""
    monkeypatch.delenv(PARENT_ENV, raising=False)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_key_the_run_ignores_is_named_once_and_defaults_say_nothing(tmp_path, capsys, caplog, user_started):
    assert cli.main(["ps", *folders(tmp_path), "--set", "ps.staleness=5", "--check-config"]) == 0
    assert warnings_of(caplog) == ["ps.staleness = 5 is ignored by this run: only ssp bounds staleness "
                                   "(ps.aggregation_mode is sync)"]
    assert capsys.readouterr().out.startswith("ps: a sync run")
    caplog.clear()
    for argv in (["ps"], ["ps", "--aggregation-mode", "ssp", "--staleness", "5"], ["baseline"], ["ddp"],
                 ["train", "--config", "ps_sync_mnist"]):
        assert cli.main([*argv, *folders(tmp_path), "--check-config"]) == 0
        assert warnings_of(caplog) == [], argv


def test_train_runs_the_command_the_config_names_with_its_flags(tmp_path, capsys, caplog, user_started):
    for config, command in (("ps_sync_topk", "ps"), ("ddp_mnist", "ddp"), ("example", "baseline")):
        assert cli.main(["train", "--config", config, *folders(tmp_path), "--check-config"]) == 0
        assert capsys.readouterr().out.startswith(f"{command}: "), config
    argv = ["train", "--config", "ps_sync_topk", "--set", "system.architecture=ddp", "--world-size", "3",
            "--backend", "gloo", *folders(tmp_path), "--check-config"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith("ddp: 3 ranks on this node")
    with pytest.raises(SystemExit) as usage:  # the baseline's flags: a usage error, as typed to it
        cli.main(["train", "--config", "example", "--servers", "2", "--check-config"])
    assert usage.value.code == 2 and "unrecognized arguments: --servers 2" in capsys.readouterr().err
    assert warnings_of(caplog) == []
    assert list(tmp_path.iterdir()) == []


def test_a_command_running_a_config_written_for_another_strategy_says_train_would(tmp_path, caplog,
                                                                                 user_started):
    assert cli.main(["ddp", "--config", "ps_sync_mnist", "--backend", "gloo", *folders(tmp_path),
                     "--check-config"]) == 0
    (line,) = warnings_of(caplog)
    assert line.startswith("system.architecture is parameter_server, but `disttrain ddp` runs ddp")
    assert "`disttrain train --config FILE`" in line
