"""Checkpoints of an earlier, unreleased build of the parameter server: a shard's or a
worker's that lacks a field every release writes is refused in one line that says so and
how to go on, not read with a default."""

from __future__ import annotations

import pytest

from disttrain.config import config_from_dict
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import CheckpointError
from disttrain.strategies.ps.run.resize import resumed_config
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.worker.participant import CURRENT_KEYS, WorkerParticipant

pytestmark = pytest.mark.timeout(60)


def make_config(tmp_path):
    return config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd",
                     "mlp_hidden_size": 8, "mlp_num_layers": 1, "max_train_samples": 32},
        "system": {"num_workers": 1, "checkpoint_dir": str(tmp_path / "ckpt")}})


def _refused(error: pytest.ExceptionInfo, key: str) -> None:
    line = str(error.value)
    assert key in line and "earlier disttrain" in line
    assert "start a fresh run in another --checkpoint-dir" in line
    assert "\n" not in line


@pytest.mark.parametrize("key", ["schedule", "buffers", "barriers", "identities",
                                 "rules.sync_step", "rules.step_version", "rules.restored"])
def test_a_shard_checkpoint_of_an_earlier_build_is_refused_in_one_line(tmp_path, key):
    shard = build_state(make_config(tmp_path), 0, 1)
    saved = shard.state_dict()
    shard.load_state_dict(saved)  # the current build's loads
    section, _, name = key.rpartition(".")
    if section:
        saved = {**saved, section: {k: v for k, v in saved[section].items() if k != name}}
    else:
        saved = {k: v for k, v in saved.items() if k != key}
    with pytest.raises(CheckpointError) as error:
        build_state(make_config(tmp_path / "other"), 0, 1).load_state_dict(saved)
    _refused(error, key)


def _worker() -> WorkerParticipant:
    """A worker participant with what loading its checkpoint reads before its fields; the
    parts a refusal never reaches are left out."""
    return WorkerParticipant(client=None, exchange=None, worker_id="w0", rank=0, world_size=1, model=None,
                             grads=None, train_set=None, test_set=None, eval_batch_size=1, sampler=None,
                             batch_size=1, faults=None)


@pytest.mark.parametrize("key", CURRENT_KEYS)
def test_a_worker_checkpoint_of_an_earlier_build_is_refused_in_one_line(key):
    saved = {"rank": 0, "world_size": 1, "bytes_sent": 0, "bytes_received": 0, "bytes_received_dense": 0,
             "samples_redone": 0, "samples_taken_over": 0, "dropped_blocks": [], "last_block": 3,
             "compression": None}
    earlier = {k: v for k, v in saved.items() if k != key}
    with pytest.raises(ValueError) as error:  # the loop names the file: "checkpoint P does not fit"
        _worker().load_state_dict(earlier)
    _refused(error, key)
    if key == "last_block":  # choosing a checkpoint leaves it to the load, which refuses it
        assert _worker().unapplied(earlier) is None


def test_resuming_a_worker_checkpoint_without_its_runs_config_is_refused_in_one_line(tmp_path):
    config = make_config(tmp_path)
    earlier = {"strategy": "ps-worker", "rank": 0, "world_size": 2}
    ckpt.save_checkpoint(tmp_path / "ckpt" / "worker0", 4, earlier)
    with pytest.raises(CheckpointError) as error:
        resumed_config(config)
    _refused(error, "config")
