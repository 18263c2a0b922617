"""A live run's checkpoints: the leader's background writes hold a copy of the state taken
when submitted, `--resume` reads the newest, and a checkpoint of another kind is refused
with a line that names what it lacks."""

from __future__ import annotations

import pytest
import torch

from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import CheckpointError
from disttrain.strategies.ddp.live.checkpoints import LiveCheckpoints, load_resume_state


def state(step: int, weight: torch.Tensor) -> dict:
    return {"model": {"weight": weight}, "ledger": torch.ones(2, 3, dtype=torch.int32),
            "progress": {"epoch": 0, "index": step, "step": step, "train_time_s": 1.5, "admitted": 0,
                         "evaluations": [], "recoveries": [{"kind": "shrink", "members": [0, 2]}],
                         "plans": [], "replans": 0, "global_batch": 32, "first_world_size": 2}}


def test_the_leaders_checkpoints_are_copies_and_resume_takes_the_newest(tmp_path):
    assert load_resume_state(tmp_path) is None  # nothing yet: the run starts from the beginning
    checkpoints = LiveCheckpoints(tmp_path, interval=5, keep=2)
    assert [step for step in range(12) if checkpoints.due(step)] == [5, 10]
    weight = torch.zeros(3)
    checkpoints.save(5, state(5, weight))
    weight += 7.0  # training goes on: the snapshot already queued must not change
    checkpoints.close()
    first = ckpt.load_checkpoint(tmp_path / ckpt.checkpoint_name(5))
    assert torch.equal(first["model"]["weight"], torch.zeros(3))
    checkpoints.save(10, state(10, weight))
    checkpoints.close()
    resumed = load_resume_state(tmp_path)
    assert resumed is not None and resumed["progress"]["step"] == 10
    assert torch.equal(resumed["model"]["weight"], torch.full((3,), 7.0))
    assert resumed["progress"]["recoveries"] == [{"kind": "shrink", "members": [0, 2]}]


def test_a_checkpoint_of_restart_mode_is_refused_by_a_live_resume(tmp_path):
    ckpt.save_checkpoint(tmp_path, 4, {"model": {"weight": torch.zeros(2)}, "rng": [{}]})
    with pytest.raises(CheckpointError, match="lacks 'progress'"):
        load_resume_state(tmp_path)


@pytest.mark.parametrize("missing", [("plans", "replans"), ("global_batch", "first_world_size")])
def test_a_checkpoint_lacking_a_piece_of_the_position_is_refused_by_a_live_resume(tmp_path, missing):
    lacking = state(4, torch.zeros(3))
    for key in missing:  # the balance plans; the run's global batch and first size
        del lacking["progress"][key]
    ckpt.save_checkpoint(tmp_path, 4, lacking)
    with pytest.raises(CheckpointError, match=f"lacks '{missing[0]}'") as info:
        load_resume_state(tmp_path)
    assert "\n" not in str(info.value)
