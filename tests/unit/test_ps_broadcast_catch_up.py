"""Pull compression with workers at different versions (async and SSP): a worker behind
by several versions is sent the changes it missed, adds them in order and then holds the
shard's broadcast copy bit for bit, so it stays within the sync bound of the shard's
parameters (top-k: c / (1 - c) of the largest update) whatever its lag; a worker further
behind than the kept changes, across a dense version, or holding nothing (a restarted
worker) is answered dense; the kept changes never take more bytes than the copy."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

from disttrain.compression import InvalidPayload, topk_count
from disttrain.strategies.ps.server.broadcast import BroadcastCopy
from disttrain.strategies.ps.wire.payloads import ParameterChanges
from disttrain.strategies.ps.wire.sharding import plan_shards

torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self, width: int = 24):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 3)


def shard(width: int = 24):
    net = Net(width)
    plan = plan_shards(net, 1)[0]
    return plan, torch.cat([p.detach().reshape(-1) for p in net.parameters()])


class Worker:
    """A worker's copy as `ShardClient` keeps it: the version it holds and the values."""

    def __init__(self, w: torch.Tensor):
        self.held, self.values, self.scratch = -1, torch.zeros_like(w), torch.empty_like(w)
        self.num_dense = self.num_changes = self.nbytes = 0

    def pull(self, copy: BroadcastCopy, version: int) -> None:
        data = copy.change_for(self.held, version)
        if data is None:
            self.values.copy_(copy.copy)
            self.num_dense += 1
            self.nbytes += copy.copy.numel() * copy.copy.element_size()
        else:
            copy.changes.add_all(self.values, data, version - self.held, self.scratch)
            self.num_changes += 1
            self.nbytes += len(data)
        self.held = version


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.01, 0.05, 0.2]), st.integers(2, 4),
       st.sampled_from([9, 25, 10**9]), st.floats(1e-3, 1.0))
def test_workers_at_different_speeds_hold_the_copy_exactly_within_the_sync_bound(seed, ratio, num_workers,
                                                                                  dense_every, scale):
    plan, w = shard(40)
    changes = ParameterChanges(plan, "topk", ratio)
    copy = BroadcastCopy(w, changes, dense_every=dense_every)
    generator = torch.Generator().manual_seed(seed)
    workers = [Worker(w) for _ in range(num_workers)]
    # Worker r pulls once every r + 1 versions, at a random phase: lags of 1 .. num_workers.
    phases = torch.randint(0, num_workers, (num_workers,), generator=generator).tolist()
    c = math.sqrt(1 - topk_count(plan.numel, ratio) / plan.numel)
    largest = 0.0
    for version in range(1, 50):
        update = torch.randn(plan.numel, generator=generator) * scale
        largest = max(largest, update.norm().item())
        w = w + update
        copy.advance(w, version)
        for r, worker in enumerate(workers):
            if (version + phases[r]) % (r + 1) == 0:
                worker.pull(copy, version)
                assert torch.equal(worker.values, copy.copy)  # the shard's copy, to the bit
                slack = 1e-5 * (w.norm().item() + 1)
                assert (w - worker.values).norm().item() <= c / (1 - c) * largest + slack
    dense = plan.numel * 4
    assert copy.nbytes_kept <= dense
    for r, worker in enumerate(workers):
        if r + 1 <= copy.capacity:  # a lag the kept changes reach: changes, fewer bytes than dense
            assert worker.num_changes > 0
            assert worker.nbytes < (worker.num_changes + worker.num_dense) * dense
        else:
            assert worker.num_changes == 0


def test_a_worker_behind_by_several_versions_gets_each_missed_change_in_order():
    plan, w = shard()
    changes = ParameterChanges(plan, "topk", 0.05)
    copy = BroadcastCopy(w, changes, dense_every=100)
    held, scratch = w.clone(), torch.empty_like(w)
    generator = torch.Generator().manual_seed(0)
    for version in range(1, 5):
        w = w + torch.randn(plan.numel, generator=generator)
        copy.advance(w, version)
    data = copy.change_for(0, 4)
    assert data is not None and len(data) == 4 * changes.nbytes
    assert data == b"".join(list(copy.recent))
    changes.add_all(held, data, 4, scratch)
    assert torch.equal(held, copy.copy)
    with pytest.raises(InvalidPayload, match="not 3"):
        changes.add_all(held, data, 3, scratch)


def test_a_worker_further_behind_than_the_kept_changes_or_across_a_reset_is_answered_dense():
    plan, w = shard()
    changes = ParameterChanges(plan, "topk", 0.05)
    copy = BroadcastCopy(w, changes, dense_every=10**9)
    assert copy.capacity == plan.nbytes // changes.nbytes and copy.capacity >= 2
    for version in range(1, copy.capacity + 3):
        copy.advance(w + version, version)
    last = copy.capacity + 2
    assert copy.change_for(last - copy.capacity, last) is not None  # as many bytes as dense at most
    assert copy.change_for(last - copy.capacity - 1, last) is None
    assert copy.nbytes_kept == copy.capacity * changes.nbytes <= plan.nbytes
    assert copy.change_for(-1, last) is None  # holds nothing: a worker restarted or registered anew
    assert copy.change_for(last, last) is None and copy.change_for(last - 1, last + 1) is None
    copy.reset(w, last + 1)  # a dense version: no change reaches across it
    copy.advance(w + 1, last + 2)
    assert copy.change_for(last, last + 2) is None and copy.change_for(last + 1, last + 2) is not None


def test_a_catch_up_with_a_change_that_does_not_decode_leaves_the_copy_unchanged():
    plan, w = shard()
    changes = ParameterChanges(plan, "topk", 0.05)
    good = changes.encode(torch.ones_like(w))
    bad = bytearray(changes.encode(torch.ones_like(w)))
    bad[:4] = b"\xff\xff\xff\x7f"  # an index far out of the segment
    held = w.clone()
    with pytest.raises(InvalidPayload):
        changes.add_all(held, good + bytes(bad), 2, torch.empty_like(w))
    assert torch.equal(held, w)
