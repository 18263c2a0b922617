"""A user's iterable data set that lists its shards, trained from the command line: a
baseline preempted mid-epoch (inside a shard) and resumed ends bit for bit where the
uninterrupted run does, its checkpoint holding the position in the shard order; a plain
IterableDataset is refused in one line, exit code 2, before the run."""

import json

import pytest
import torch

from tests.unit.test_user_iterable import CORPUS

ARGS = ["--model", "mlp", "--batch-size", "8", "--num-epochs", "2", "--num-threads", "1", "--seed", "7",
        "--optimizer", "sgd", "--learning-rate", "0.05", "--checkpoint-interval", "1000"]
STEPS_PER_EPOCH = 8  # 60 items, batches of 8


def run(cli, folder, spec, *extra):
    return cli("baseline", *ARGS, "--dataset", spec, "--data-dir", folder / "data", "--log-dir",
               folder / "logs", "--checkpoint-dir", folder / "ckpt", *extra, timeout=150)


def final(folder):
    return torch.load(folder / "ckpt" / "baseline_final.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_baseline_on_a_users_shards_resumes_bit_identical(tmp_path, cli):
    corpus = tmp_path / "corpus.py"
    corpus.write_text(CORPUS)
    spec = f"{corpus}:build"
    whole = run(cli, tmp_path / "whole", spec)
    assert whole.returncode == 0, whole.stderr[-3000:]
    cut = tmp_path / "cut"
    stopped = run(cli, cut, spec, "--inject", "term:worker=0:step=5")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    saved = torch.load(next((cut / "ckpt").glob("checkpoint_step*.pt")), weights_only=True)
    assert saved["sampler"]["shard_sizes"] == [10] * 6 and saved["sampler"]["position"] == 40
    resumed = run(cli, cut, spec, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((cut / "logs" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 5 and summary["steps"] == 2 * STEPS_PER_EPOCH
    one, other = final(tmp_path / "whole")["model"], final(cut)["model"]
    assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


@pytest.mark.slow  # a command: a few seconds on two busy cores
@pytest.mark.timeout(120)
def test_a_plain_iterable_data_set_is_one_line_before_the_run(tmp_path, cli):
    corpus = tmp_path / "corpus.py"
    corpus.write_text(CORPUS)
    result = run(cli, tmp_path, f"{corpus}:plain")
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "is an iterable data set with no listed shards" in last and "Traceback" not in result.stderr
    assert not (tmp_path / "ckpt").exists()
