"""An async or SSP parameter-server run stopped with its workers at different positions of
an epoch, re-split for another number of workers (`strategies.ps.run.positions`, and the
checkpoints' rewrite in `run.resize`): whatever the old positions, the new shards hold
what was handed out ahead of the new positions and what the epoch still owes after them,
each sample once; the ledger, the workers' steps and SSP's clocks follow the new split."""

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
from disttrain.strategies.ps.run.positions import resplit_positions, spread


def old_samplers(num_samples: int, written: int, seed: int, positions: list[int], epoch: int = 1):
    samplers = []
    for rank, position in enumerate(positions):
        sampler = ShardedSampler(num_samples, world_size=written, rank=rank, seed=seed)
        sampler.epoch, sampler.position = epoch, min(position, len(sampler))
        samplers.append(sampler)
    return samplers


@settings(max_examples=300, deadline=None)
@given(data=st.data(), steps_per_epoch=st.integers(1, 10), batch_size=st.integers(1, 6),
       written=st.integers(1, 4), world_size=st.integers(1, 6), extra=st.integers(0, 5),
       seed=st.integers(0, 3))
def test_any_positions_re_split_cover_what_was_handed_out_and_what_is_owed_once(
        data, steps_per_epoch, batch_size, written, world_size, extra, seed):
    global_batch = batch_size * written
    assume(global_batch % world_size == 0)
    new_batch = global_batch // world_size
    num_samples = steps_per_epoch * global_batch + extra
    taken = data.draw(st.lists(st.integers(0, steps_per_epoch), min_size=written, max_size=written))
    old = old_samplers(num_samples, written, seed, [t * batch_size for t in taken])
    done = [int(i) for sampler in old for i in sampler.consumed()]
    rest = [int(i) for sampler in old for i in sampler.remaining()]
    states = [sampler.state_dict() for sampler in old]
    try:
        split = resplit_positions(states, world_size, new_batch)
    except ValueError as e:  # only near the epoch's end, too little owed to even out the shards
        assert "still owes" in str(e)
        assert len(rest) < world_size * new_batch * 2
        return
    if not any(taken):  # at the epoch's start the new layout is the epoch's permutation
        assert all(s["position"] == 0 and "order" not in s for s in split.samplers)
        return
    new = []
    for rank, state in enumerate(split.samplers):
        sampler = ShardedSampler(num_samples, world_size=world_size, rank=rank, seed=seed)
        sampler.load_state_dict(state)
        new.append(sampler)
    ahead = [int(i) for sampler in new for i in sampler.consumed()]
    after = [int(i) for sampler in new for i in sampler.remaining()]
    # each new worker stands past whole batches of its own: its next batch is its next block
    assert [s.position for s in new] == [t * new_batch for t in split.batches_taken]
    assert max(split.batches_taken) - min(split.batches_taken) <= 1
    assert len(set(ahead)) == len(ahead) and set(ahead) <= set(done)
    assert len(done) - len(ahead) < new_batch  # short of a whole new batch: applied, not listed
    assert len(set(after)) == len(after) and set(after) <= set(rest) and not set(after) & set(done)
    assert len(rest) - len(after) == split.left_out < world_size  # only the owed list's tail
    assert split.handed_out == len(done) and split.owed == len(rest)


@settings(max_examples=150, deadline=None)
@given(steps_per_epoch=st.integers(1, 10), batch_size=st.integers(1, 6), written=st.integers(1, 4),
       world_size=st.integers(1, 6), taken=st.integers(1, 10), extra=st.integers(0, 5),
       seed=st.integers(0, 3))
def test_one_position_for_all_is_the_sync_re_split(steps_per_epoch, batch_size, written, world_size, taken,
                                                   extra, seed):
    global_batch = batch_size * written
    assume(global_batch % world_size == 0)
    num_samples = steps_per_epoch * global_batch + extra
    taken = min(taken, steps_per_epoch)
    old = old_samplers(num_samples, written, seed, [taken * batch_size] * written)
    states = [s.state_dict() for s in old]
    split = resplit_positions(states, world_size, global_batch // world_size)
    for rank in range(world_size):
        expected = resplit_state(states[0], world_size, rank, keep_position=True)
        assert split.samplers[rank]["position"] == expected["position"]
        assert torch.equal(split.samplers[rank]["order"], expected["order"])


def test_spread_evens_out_lower_ranks_first():
    assert spread(7, 3) == [3, 2, 2] and spread(2, 3) == [1, 1, 0] and spread(6, 1) == [6]


# 240 samples, 2 workers x 6: 20 steps an epoch; on 3 workers x 4, 20 too.
def stopped_async_run(tmp_path, mode: str, taken: list[int], epoch: int = 1):
    written, batch_size, steps_per_epoch = len(taken), 6, 20
    record = {"system": {"num_workers": written}, "training": {"batch_size": batch_size},
              "ps": {"aggregation_mode": mode}}
    samplers = old_samplers(240, written, 3, [t * batch_size for t in taken], epoch)
    for rank, (sampler, batches) in enumerate(zip(samplers, taken, strict=True)):
        step = epoch * steps_per_epoch + batches
        ckpt.save_checkpoint(tmp_path / f"worker{rank}", step, {
            "strategy": "ps-worker", "worker_id": f"worker{rank}", "rank": rank, "world_size": written,
            "position": {"epoch": epoch, "step": step, "samples_processed": step * batch_size,
                         "train_time_s": 1.0},
            "sampler": sampler.state_dict(), "rng": ckpt.rng_state(), "config": record, "bytes_sent": 7,
            "bytes_received": 7, "bytes_received_dense": 7, "compression": None, "samples_redone": 0,
            "samples_taken_over": 0, "dropped_blocks": [], "last_block": -1})
    ledger = resize.Numbering(written, steps_per_epoch).steps_taken(epoch, taken)
    steps = {rank: epoch * steps_per_epoch + t for rank, t in enumerate(taken)}
    for shard in range(2):
        rules = {"mode": mode, "ranks": {f"worker{r}": r for r in range(written)}, "done": [],
                 "last_step": steps, "roster": {"parked": dict.fromkeys(range(written), epoch - 1),
                                                "num_fenced": 0},
                 "ledger": {"blocks": sorted(ledger), "samples_duplicate": 0}, "counts": {"samples": 1}}
        if mode == "ssp":
            rules["clocks"] = {str(r): s for r, s in steps.items()}
        ckpt.save_checkpoint(tmp_path / f"server{shard}", 99, {
            "strategy": "ps-server", "version": 99, "config": record, "rules": rules, "barriers": {},
            "identities": {f"worker{r}": {"digest": "00", "generation": 0} for r in range(written)}})


def config_for(tmp_path, mode: str, workers: int) -> Config:
    return Config().replace(
        training={"dataset": "synthetic", "num_samples": 240, "batch_size": 6, "num_epochs": 2, "seed": 3},
        system={"checkpoint_dir": str(tmp_path), "num_workers": workers},
        ps={"num_servers": 2, "aggregation_mode": mode})


def newest(folder):
    return ckpt.load_checkpoint(ckpt.list_checkpoints(folder)[-1])


@pytest.mark.parametrize("mode", ["async", "ssp"])
# Steps: the epoch's first (20) plus the batches taken, moved on together so that no
# worker's new step is below its checkpoint's (worker 1 stood at 28).
@pytest.mark.parametrize("workers, batches, steps", [(3, [7, 6, 6], [29, 28, 28]), (1, [6], [26]),
                                                     (4, [7, 7, 6, 6], [28, 28, 27, 27])])
def test_workers_apart_are_rewritten_at_even_positions_with_their_steps_and_clocks(tmp_path, mode, workers,
                                                                                    batches, steps):
    # worker 0 is 5 batches into epoch 1, worker 1 8: 78 samples handed out, 19 batches of 4 (and 2
    # left over) for 3 workers, 6 of 12 for 1, 26 of 3 for 4
    stopped_async_run(tmp_path, mode, [5, 8])
    config = resize.resumed_config(config_for(tmp_path, mode, workers))
    resize.resize_checkpoints(config)
    new_batch = 12 // workers
    states = [newest(tmp_path / f"worker{rank}") for rank in range(workers)]
    assert [s["sampler"]["position"] for s in states] == [b * new_batch for b in batches]
    assert [s["position"]["step"] for s in states] == steps
    named = [ckpt.checkpoint_step(ckpt.list_checkpoints(tmp_path / f"worker{r}")[-1]) for r in range(workers)]
    assert named == steps
    expected = resize.Numbering(workers, 20).steps_taken(1, batches)
    for shard in range(2):
        rules = newest(tmp_path / f"server{shard}")["rules"]
        assert set(rules["ledger"]["blocks"]) == expected
        assert rules["last_step"] == dict(enumerate(steps))
        if mode == "ssp":
            assert rules["clocks"] == {str(rank): step for rank, step in enumerate(steps)}
        else:
            assert "clocks" not in rules
    handed_out = {int(i) for s in old_samplers(240, 2, 3, [30, 48]) for i in s.consumed()}
    ahead = set()
    for rank, state in enumerate(states):
        sampler = ShardedSampler(240, world_size=workers, rank=rank, seed=3)
        sampler.load_state_dict(state["sampler"])
        ahead |= {int(i) for i in sampler.consumed()}
    assert ahead <= handed_out and len(handed_out) - len(ahead) < new_batch


def test_async_workers_in_different_epochs_are_refused(tmp_path):
    stopped_async_run(tmp_path, "async", [5, 8])
    worker = newest(tmp_path / "worker1")
    worker["sampler"]["epoch"] = 0
    ckpt.save_checkpoint(tmp_path / "worker1", 28, worker)
    config = resize.resumed_config(config_for(tmp_path, "async", 3))
    with pytest.raises(ConfigError, match="different epochs"):
        resize.resize_checkpoints(config)


def test_a_resize_in_another_aggregation_mode_is_refused_naming_the_checkpoint_s(tmp_path):
    stopped_async_run(tmp_path, "ssp", [5, 8])
    with pytest.raises(ConfigError, match=r"^ps.aggregation_mode: the checkpoint was written in ssp mode and "
                                          r"this run is async; resume with --aggregation-mode ssp$"):
        resize.resumed_config(config_for(tmp_path, "async", 3))
