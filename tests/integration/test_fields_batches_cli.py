"""Data as users have it and a model's own loss, end to end: items that are `datasets`-style
rows of named fields of different lengths, padded into batches (`training.collate_fn=pad`),
given to a model's forward as keyword arguments, with the loss the model computes itself
(`training.loss=model`). Sync PS (2 workers, 2 shards) and DDP (2 ranks) end with the
parameters of one process stepping on the concatenated batches; the baseline learns; a
loss function of the user's own is used as it is; a wrong target key is one line, exit 2,
before any process starts."""

import json

import pytest
from fields_plugin import write_fields_plugin
from ps_reference import assert_matches_one_process, concatenated

from disttrain.core.checkpoint import load_checkpoint

BASE = ["--optimizer", "sgd", "--set", "training.momentum=0", "--learning-rate", "0.1", "--batch-size", "16",
        "--num-epochs", "1", "--num-threads", "1", "--set", "training.collate_fn=pad"]


def fields(tmp_path, *extra):
    plugin = write_fields_plugin(tmp_path)
    return ["--model", f"{plugin}:model", "--dataset", f"{plugin}:data", *BASE, *extra,
            "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt"]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("command, final", [
    pytest.param(["ps", "--workers", "2", "--servers", "2"], "parameter_server_final.pt",
                 marks=pytest.mark.extended),  # padded rows match one process: the DDP run below
    (["ddp", "--world-size", "2"], "ddp_final.pt"),
])
def test_padded_rows_with_the_models_own_loss_match_one_process(tmp_path, cli, command, final):
    result = cli(*command, *fields(tmp_path, "--set", "training.loss=model"), timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["samples_processed"] == 256 and summary["steps"] == 8, summary
    config = assert_matches_one_process(tmp_path, concatenated, final)
    assert (config.training.loss, config.training.collate_fn) == ("model", "pad")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_baseline_learns_from_rows_and_takes_a_users_loss_function(tmp_path, cli):
    plugin = write_fields_plugin(tmp_path)
    result = cli("baseline", *fields(tmp_path, "--set", f"training.loss={plugin}:doubled_loss",
                                     "--num-epochs", "4"), timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.7, summary
    assert load_checkpoint(tmp_path / "ckpt" / "baseline_final.pt")["model"]["head.weight"].shape == (2, 8)


@pytest.mark.slow  # a process of the command line
def test_a_target_key_the_rows_lack_stops_before_any_process_with_its_line(tmp_path, cli):
    result = cli("ps", "--workers", "2", *fields(tmp_path, "--set", "training.target_key=answer"), timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: training.target_key: a batch of ") and "has the fields ['attention_mask', 'input_ids', " \
        "'labels'], and none is 'answer'; set training.target_key" in result.stderr
    assert not list((tmp_path / "logs").glob("*.log"))
