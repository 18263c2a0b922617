"""Bad input to the PS and DDP commands: one clear line and exit code 2, nothing started."""

import pytest

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["ps", "--set", "system.compression_enabled=true"], "compression is not available"),
        (["ps-worker", "--servers", "localhost"], "HOST:PORT"),
        (["ps-server", "--shard", "2/2"], "0 <= I < S"),
    ],
)
def test_bad_usage_exits_2_with_one_line(cli, tmp_path, args, words):
    result = cli(*args, "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt")
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr


def test_ddp_refuses_compression_before_starting_ranks(cli, tmp_path):
    result = cli("ddp", "--world-size", "2", "--set", "compression.enabled=true",
                 "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt")
    assert result.returncode == 2, result.stderr
    assert "compression.enabled: gradient compression is not available in DDP yet" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "logs").exists()
