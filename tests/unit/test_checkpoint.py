"""Checkpoints: atomic writes, pruning, safe loading, RNG round trips."""

import random

import numpy as np
import pytest
import torch

from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import CheckpointError, ConfigError


def test_save_load_and_prune(tmp_path):
    for step in (5, 10, 15, 20):
        ckpt.save_checkpoint(tmp_path, step, {"step": step, "w": torch.full((3,), float(step))}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "checkpoint_step00000015.pt", "checkpoint_step00000020.pt"]
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    assert state["step"] == 20 and torch.equal(state["w"], torch.full((3,), 20.0))
    assert not list(tmp_path.glob(".*tmp"))  # no temporary files left behind


def test_a_failed_write_leaves_the_old_file_intact(tmp_path):
    path = ckpt.atomic_torch_save({"v": 1}, tmp_path / "state.pt")

    class Unsavable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError):
        ckpt.atomic_torch_save({"v": Unsavable()}, path)
    assert ckpt.load_checkpoint(path) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt", "state.pt.sha256"]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_files_raise_a_named_error(tmp_path, damage):
    path = ckpt.atomic_torch_save({"model": {"w": torch.ones(1000)}}, tmp_path / "c.pt")
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00junk" * 50,
                      "empty": b""}[damage])
    with pytest.raises(CheckpointError, match="c.pt is corrupt or truncated"):
        ckpt.load_checkpoint(path)


def test_loading_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "evil.pt"
    ckpt.atomic_torch_save({"payload": ConfigError("x")}, path)  # any non-allowlisted class, its sum right
    with pytest.raises(CheckpointError, match="evil.pt is corrupt or truncated .*Weights only load failed"):
        ckpt.load_checkpoint(path)


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    ckpt.atomic_torch_save({"rng": ckpt.rng_state()}, tmp_path / "rng.pt")
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    ckpt.set_rng_state(ckpt.load_checkpoint(tmp_path / "rng.pt")["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_fresh_runs_refuse_a_folder_with_checkpoints(tmp_path):
    assert ckpt.prepare_checkpoint_dir(tmp_path, resume=False) is None
    assert ckpt.prepare_checkpoint_dir(tmp_path, resume=True) is None
    ckpt.save_checkpoint(tmp_path, 3, {"step": 3})
    with pytest.raises(ConfigError, match="--resume"):
        ckpt.prepare_checkpoint_dir(tmp_path, resume=False)
    assert ckpt.prepare_checkpoint_dir(tmp_path, resume=True).name == "checkpoint_step00000003.pt"


def test_a_checkpoint_that_does_not_fit_is_passed_over_for_the_newest_older_one_that_does(tmp_path, caplog):
    """`LocalCheckpoints(fits=...)`: the newest intact checkpoint the check accepts is the one
    resumed from; a damaged one on the way is skipped; with none accepted, nothing is."""
    from disttrain.training.checkpoints import LocalCheckpoints

    for step in (5, 10, 15, 20):
        ckpt.save_checkpoint(tmp_path, step, {"step": step}, keep=10)
    (tmp_path / ckpt.checkpoint_name(10)).write_bytes(b"damaged")

    def ahead_of(limit):
        return lambda state: None if state["step"] <= limit else f"step {state['step']} is past {limit}"

    assert LocalCheckpoints(tmp_path, 10).choose(resume=True) == tmp_path / ckpt.checkpoint_name(20)
    store = LocalCheckpoints(tmp_path, 10, fits=ahead_of(12))
    chosen = store.choose(resume=True)
    assert chosen == tmp_path / ckpt.checkpoint_name(5)  # 20 and 15 do not fit, 10 is damaged
    assert store.load(chosen) == {"step": 5}
    assert "step 20 is past 12" in caplog.text and "step 15 is past 12" in caplog.text
    assert LocalCheckpoints(tmp_path, 10, fits=ahead_of(0)).choose(resume=True) is None
    assert "starts from the beginning" in caplog.text
