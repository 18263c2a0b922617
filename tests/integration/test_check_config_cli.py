"""The dry run and the shipped configs through the installed entry point, from a folder
that holds no configs."""

import socket

import pytest

from disttrain.config.shipped import shipped_configs

pytestmark = pytest.mark.timeout(120)


@pytest.mark.slow  # a process of the command line
def test_configs_lists_every_shipped_config_with_its_description(cli, tmp_path):
    result = cli("configs", cwd=tmp_path, timeout=100)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for config in shipped_configs():
        assert any(line.split()[0] == config.name and config.description in line for line in lines if line)


@pytest.mark.slow  # a process of the command line
def test_check_config_by_shipped_name_from_any_folder(cli, tmp_path):
    result = cli("baseline", "--config", "example", "--check-config", cwd=tmp_path, timeout=100)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("baseline: train simplecnn on digits") and "config OK" in result.stdout
    assert list(tmp_path.iterdir()) == []  # the config's runs/example folders were not made


@pytest.mark.slow
def test_ps_server_check_binds_nothing_and_a_bad_one_exits_2(cli, tmp_path):
    with socket.socket() as held:  # the port is taken: a server that tried to bind it would fail
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        good = cli("ps-server", "--config", "ps_sync_mnist", "--bind", f"127.0.0.1:{port}", "--shard", "1/2",
                   "--check-config", cwd=tmp_path, timeout=100)
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip() == (f"ps-server: shard 1/2 of a sync run for 2 workers, listening on "
                                   f"127.0.0.1:{port}, without a coordinator; checkpoints in "
                                   f"runs/ps_sync_mnist/checkpoints/server1; config OK")
    bad = cli("ps-server", "--config", "ps_sync_mnist", "--shard", "1/1", "--check-config", cwd=tmp_path,
              timeout=100)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "error: --shard '1/1' must look like I/S with 0 <= I < S, e.g. 0/2"]
    assert list(tmp_path.iterdir()) == []
