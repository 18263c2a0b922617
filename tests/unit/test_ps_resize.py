"""A parameter-server checkpoint of N workers rewritten for M (`strategies.ps.run.resize`)
and the sampler's re-split that keeps the position (`resplit_state(keep_position=True)`):
whatever the sizes and the step, the new shards hold what the old ones had handed out
ahead of their position and what the epoch still owes after it, each sample once; the
ledger is renumbered by the steps taken; runs that cannot be resized are refused with one
line naming what to do."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from disttrain.config import Config
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import ConfigError
from disttrain.data import ShardedSampler
from disttrain.data.sampler import resplit_state
from disttrain.strategies.ps.run import resize
from disttrain.strategies.ps.worker.blocks import block_id


@settings(max_examples=200, deadline=None)
@given(steps_per_epoch=st.integers(1, 12), batch_size=st.integers(1, 6), written=st.integers(1, 4),
       world_size=st.integers(1, 6), taken=st.integers(1, 12), extra=st.integers(0, 5),
       seed=st.integers(0, 3))
def test_a_re_split_keeping_the_position_deals_what_was_handed_out_ahead_and_the_rest_after(
        steps_per_epoch, batch_size, written, world_size, taken, extra, seed):
    global_batch = batch_size * written
    num_samples = steps_per_epoch * global_batch + extra
    assume(num_samples >= world_size)
    taken = min(taken, steps_per_epoch)
    old = [ShardedSampler(num_samples, world_size=written, rank=r, seed=seed) for r in range(written)]
    for sampler in old:
        sampler.position = taken * batch_size
    done = {int(i) for sampler in old for i in sampler.consumed()}
    rest = {int(i) for sampler in old for i in sampler.remaining()}
    if taken * global_batch % world_size:
        with pytest.raises(ValueError, match="do not divide over"):
            resplit_state(old[0].state_dict(), world_size, 0, keep_position=True)
        return
    new = []
    for rank in range(world_size):
        sampler = ShardedSampler(num_samples, world_size=world_size, rank=rank, seed=seed)
        sampler.load_state_dict(resplit_state(old[0].state_dict(), world_size, rank, keep_position=True))
        new.append(sampler)
    assert all(sampler.position == taken * global_batch // world_size for sampler in new)
    ahead = [int(i) for sampler in new for i in sampler.consumed()]
    after = [int(i) for sampler in new for i in sampler.remaining()]
    assert sorted(ahead) == sorted(done)  # each handed out once, before the position
    assert len(set(after)) == len(after) and set(after) <= rest
    assert len(rest) - len(after) < world_size  # only the owed list's tail is left out


def test_at_an_epoch_s_start_the_new_layout_is_the_permutation():
    state = ShardedSampler(100, world_size=2, seed=4).state_dict()
    assert resplit_state(state, 3, 1, keep_position=True) == resplit_state(state, 3, 1)


def synthetic_config(tmp_path, workers: int, batch_size: int, **sections) -> Config:
    return Config().replace(
        training={"dataset": "synthetic", "num_samples": 240, "batch_size": batch_size, "num_epochs": 2,
                  "seed": 3},
        system={"checkpoint_dir": str(tmp_path), "num_workers": workers},
        ps={"num_servers": 2, **sections.get("ps", {})},
        **{k: v for k, v in sections.items() if k != "ps"})


def stopped_run(tmp_path, written: int = 2, batch_size: int = 6, epoch: int = 1, taken: int = 4):
    """The newest checkpoints of a sync run of `written` workers stopped `taken` batches
    into `epoch`, every shard's ledger holding the steps taken (20 steps an epoch)."""
    steps_per_epoch = 240 // (written * batch_size)
    step = epoch * steps_per_epoch + taken
    record = {"system": {"num_workers": written}, "training": {"batch_size": batch_size}}
    for rank in range(written):
        sampler = ShardedSampler(240, world_size=written, rank=rank, seed=3)
        sampler.epoch, sampler.position = epoch, taken * batch_size
        ckpt.save_checkpoint(tmp_path / f"worker{rank}", step, {
            "strategy": "ps-worker", "worker_id": f"worker{rank}", "rank": rank, "world_size": written,
            "position": {"epoch": epoch, "step": step, "samples_processed": step * batch_size,
                         "train_time_s": 1.0},
            "sampler": sampler.state_dict(), "rng": ckpt.rng_state(), "config": record, "bytes_sent": 7,
            "bytes_received": 7, "bytes_received_dense": 7, "compression": None, "samples_redone": 0,
            "samples_taken_over": 0, "dropped_blocks": [], "last_block": -1})
    ledger = resize.Numbering(written, steps_per_epoch).steps_taken(epoch, taken)
    for shard in range(2):
        ckpt.save_checkpoint(tmp_path / f"server{shard}", step, {
            "strategy": "ps-server", "version": step, "config": record,
            "rules": {"ranks": {f"worker{r}": r for r in range(written)}, "done": [],
                      "last_step": dict.fromkeys(range(written), step),
                      "roster": {"parked": dict.fromkeys(range(written), epoch - 1), "num_fenced": 0},
                      "ledger": {"blocks": sorted(ledger), "samples_duplicate": 0}, "counts": {"samples": 1}},
            "barriers": {"epoch0:trained": [[1.0]] * written},
            "identities": {f"worker{r}": {"digest": "00", "generation": 0} for r in range(written)}})
    return step


def newest(folder):
    return ckpt.load_checkpoint(ckpt.list_checkpoints(folder)[-1])


@pytest.mark.parametrize("workers", [3, 1, 4])
def test_the_checkpoints_are_rewritten_for_the_new_workers(tmp_path, workers, caplog):
    step = stopped_run(tmp_path)
    config = synthetic_config(tmp_path, workers, 6)
    with caplog.at_level("INFO"):
        config = resize.resumed_config(config)
        resize.resize_checkpoints(config)
    per_worker = 12 // workers
    assert config.training.batch_size == per_worker
    assert (f"resuming a checkpoint of 2 workers on {workers}: per-worker batch {per_worker} keeps the "
            "global batch of 12") in caplog.text
    states = [newest(tmp_path / f"worker{rank}") for rank in range(workers)]
    assert [s["rank"] for s in states] == list(range(workers))
    assert {s["world_size"] for s in states} == {workers}
    assert all(s["config"]["training"]["batch_size"] == per_worker for s in states)
    assert sum(s["position"]["samples_processed"] for s in states) == 2 * step * 6
    assert {s["sampler"]["position"] for s in states} == {4 * per_worker}  # 4 batches into the epoch, still
    assert len({s["rng"]["torch"].numpy().tobytes() for s in states}) == workers
    expected = resize.Numbering(workers, 20).steps_taken(1, 4)
    assert states[-1]["last_block"] == block_id(1, workers - 1, 3, workers, 20)
    for shard in range(2):
        state = newest(tmp_path / f"server{shard}")
        assert set(state["rules"]["ledger"]["blocks"]) == expected
        assert set(state["rules"]["ranks"].values()) == set(range(min(workers, 2)))
        assert set(state["identities"]) == set(state["rules"]["ranks"])
        assert state["barriers"] == {}
        assert state["rules"]["roster"]["parked"] == dict.fromkeys(range(workers), 0)
        assert len(ckpt.list_checkpoints(tmp_path / f"server{shard}")) == 1
    # a second resize composes: back on 2
    again = resize.resumed_config(synthetic_config(tmp_path, 2, 6))
    resize.resize_checkpoints(again)
    assert again.training.batch_size == 6
    assert set(newest(tmp_path / "server0")["rules"]["ledger"]["blocks"]) == \
        resize.Numbering(2, 20).steps_taken(1, 4)


def test_the_same_number_of_workers_is_left_alone(tmp_path):
    stopped_run(tmp_path)
    config = synthetic_config(tmp_path, 2, 6)
    assert resize.resumed_config(config) is config


def test_a_number_of_workers_off_the_global_batch_is_refused_naming_those_that_keep_it(tmp_path):
    stopped_run(tmp_path)
    with pytest.raises(ConfigError, match=r"^system.num_workers: the checkpoint's global batch of 12 \(2 "
                                          r"workers x 6\) does not divide over 5 workers; resume with "
                                          r"--workers in 1, 2, 3, 4, 6, 12 \(each keeps it\)$"):
        resize.resumed_config(synthetic_config(tmp_path, 5, 6))


@pytest.mark.parametrize("sections, named", [
    ({"compression": {"enabled": True}}, "compression"),
    ({"ps": {"backup_workers": 1}}, "ps.backup_workers")])
def test_what_belongs_to_the_old_workers_numbering_is_refused(tmp_path, sections, named):
    stopped_run(tmp_path)
    with pytest.raises(ConfigError, match=f"without compression, .*{named}.*; resume with --workers 2$"):
        resize.resumed_config(synthetic_config(tmp_path, 3, 6, **sections))


def test_checkpoints_not_of_one_step_are_refused_and_left_as_they_were(tmp_path):
    step = stopped_run(tmp_path)
    state = newest(tmp_path / "server1")
    state["rules"]["ledger"]["blocks"] = state["rules"]["ledger"]["blocks"][:-1]  # a block short
    ckpt.save_checkpoint(tmp_path / "server1", step, state)
    config = resize.resumed_config(synthetic_config(tmp_path, 3, 6))
    with pytest.raises(ConfigError, match="server1's newest checkpoint .* resume with --workers 2, stop"):
        resize.resize_checkpoints(config)
    assert newest(tmp_path / "worker0")["world_size"] == 2 and not (tmp_path / "worker2").exists()
    worker = newest(tmp_path / "worker1")
    worker["sampler"]["position"] = 0
    ckpt.save_checkpoint(tmp_path / "worker1", step, worker)
    with pytest.raises(ConfigError, match="different steps or positions"):
        resize.resize_checkpoints(config)


def test_an_epoch_every_worker_finished_is_the_new_layout_s_finished(tmp_path):
    stopped_run(tmp_path, epoch=0, taken=20)
    config = resize.resumed_config(synthetic_config(tmp_path, 3, 6))
    resize.resize_checkpoints(config)
    sampler = ShardedSampler(240, world_size=3, rank=2, seed=3)
    sampler.load_state_dict(newest(tmp_path / "worker2")["sampler"])
    assert sampler.exhausted and sampler.order is None
    assert set(newest(tmp_path / "server0")["rules"]["ledger"]["blocks"]) == set(range(60))
    assert torch.equal(sampler.shard(0), sampler.shard())
