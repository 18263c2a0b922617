"""Bad input to the PS and DDP commands: one clear line and exit code 2, nothing started."""

import pytest

pytestmark = pytest.mark.timeout(60)

COMPRESSION = ["--compression-enabled", "--compression-type"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["ps", *COMPRESSION, "powersgd"], "powersgd compresses DDP's all-reduce"),
        (["ps", *COMPRESSION, "topk", "--compression-ratio", "0"], "ratio: 0.0 must be in (0, 1]"),
        (["ps", *COMPRESSION, "topk", "--compression-ratio", "1.5"], "ratio: 1.5 must be in (0, 1]"),
        (["ps", *COMPRESSION, "int4"], "compression.type: 'int4' must be one of quantization, topk"),
        (["ddp", *COMPRESSION, "topk", "--compression-ratio", "0"], "compression.ratio: 0.0 must be in"),
        (["ddp", "--set", "system.compression_type=zip"], "system.compression_type: 'zip' must be one of"),
        (["ps", "--dataset", "digits", "--model", "mlp", "--set", "training.mlp_hidden_size=2",
          "--set", "training.mlp_num_layers=1", "--servers", "200"],
         "cannot split 160 parameter elements into 200 shards; use ps.num_servers between 1 and 160"),
        (["ps-worker", "--servers", "localhost"], "HOST:PORT"),
        (["ps-server", "--shard", "2/2"], "0 <= I < S"),
    ],
)
@pytest.mark.slow
def test_bad_usage_exits_2_with_one_line(cli, tmp_path, args, words):
    result = cli(*args, "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt")
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert words in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(errors) == 1 and not (tmp_path / "logs").exists(), result.stderr
