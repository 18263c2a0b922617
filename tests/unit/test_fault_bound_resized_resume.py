"""The last step an `--inject` fault may name on a resume that changes the number of
workers (PS) or ranks (DDP): the run keeps its checkpoint's global batch with another
per-worker batch, so it has the steps of that batch, not of the command line's."""

from __future__ import annotations

import pytest

from disttrain.cli.flags import run_shape
from disttrain.config import config_from_dict
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import ConfigError
from disttrain.core.fault_spec import check_faults
from disttrain.core.faults import parse_fault

pytestmark = pytest.mark.timeout(60)

# 240 training samples over 3 workers: 80 each. The command line's batch of 24 makes
# ceil(80 / 24) = 4 steps; the checkpoint's 2 workers x 24 kept over 3 (16 each), 5.
SAMPLES, WORKERS, BATCH = 240, 3, 24


def make_config(tmp_path):
    return config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "max_train_samples": SAMPLES,
                     "batch_size": BATCH, "num_epochs": 1},
        "system": {"num_workers": WORKERS, "checkpoint_dir": str(tmp_path / "ckpt")}})


def write_checkpoint(tmp_path, command: str) -> None:
    """A checkpoint of 2 workers (ranks) of BATCH, as the resize reads it."""
    written = {"world_size": 2, "config": {"training": {"batch_size": BATCH}}}
    if command == "ps":
        state = {"strategy": "ps-worker", "rank": 0, **written}
        ckpt.save_checkpoint(tmp_path / "ckpt" / "worker0", 8, state)
    else:
        ckpt.save_checkpoint(tmp_path / "ckpt", 8, {"strategy": "ddp", **written})


@pytest.mark.parametrize("command, role", [("ps", "worker"), ("ddp", "rank")])
def test_a_resized_resume_bounds_fault_steps_by_the_batch_it_will_use(tmp_path, command, role):
    config = make_config(tmp_path)
    assert run_shape(config, command).last_step[role] == 4  # a fresh run: the command line's batch
    write_checkpoint(tmp_path, command)
    shape = run_shape(config, command, resume=True)
    assert shape.last_step[role] == 5
    check_faults([parse_fault(f"kill:{role}=1:step=5")], shape)  # the run's last step: accepted
    with pytest.raises(ValueError, match="step 6 is past the run's end"):
        check_faults([parse_fault(f"kill:{role}=1:step=6")], shape)


@pytest.mark.parametrize("command", ["ps", "ddp"])
def test_a_resume_without_a_checkpoint_bounds_by_the_command_lines_batch(tmp_path, command):
    role = "rank" if command == "ddp" else "worker"
    assert run_shape(make_config(tmp_path), command, resume=True).last_step[role] == 4


def test_a_resume_the_workers_cannot_take_is_refused_before_the_faults_are_checked(tmp_path):
    config = make_config(tmp_path).replace(system={"num_workers": 5})  # 48 does not divide over 5
    write_checkpoint(tmp_path, "ps")
    with pytest.raises(ConfigError, match="does not divide over 5 workers"):
        run_shape(config, "ps", resume=True)
