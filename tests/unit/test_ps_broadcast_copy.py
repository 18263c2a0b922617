"""Pull compression's broadcast copy on its own: a worker adding every change holds the
shard's copy bit for bit, the copy stays within the compressor's bound of the true
parameters over many versions (top-k: its residual never grows past c / (1 - c) of the
largest update; int8: half a level), a dense version resets it, and a worker that holds
another version is answered dense."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

from disttrain.compression import InvalidPayload, topk_count
from disttrain.strategies.ps.run.finalize import WorkerTotals, compression_summary
from disttrain.strategies.ps.server.broadcast import BroadcastCopy
from disttrain.strategies.ps.wire import service
from disttrain.strategies.ps.wire.payloads import ParameterChanges, shard_segments
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


def updates(seed: int, numel: int, steps: int, scale: float):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=generator) * scale for _ in range(steps)]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.01, 0.05, 0.2, 0.5]), st.integers(4, 40),
       st.floats(1e-4, 1.0))
def test_topk_copies_are_identical_and_the_residual_stays_bounded(seed, ratio, width, scale):
    plan, w = shard(width)
    changes = ParameterChanges(plan, "topk", ratio)
    copy = BroadcastCopy(w, changes, dense_every=10**9)
    worker, scratch = w.clone(), torch.empty_like(w)
    k = topk_count(plan.numel, ratio)
    c = math.sqrt(1 - k / plan.numel)  # topk keeps the k largest: |x - topk(x)| <= c |x|
    largest = 0.0
    for version, update in enumerate(updates(seed, plan.numel, 60, scale), start=1):
        before = (w - copy.copy).norm().item()
        w = w + update
        delta = (w - copy.copy).norm().item()
        copy.advance(w, version)
        change = copy.change_for(version - 1, version)
        # (dense where topk would not save bytes)
        assert change is not None and len(change) == changes.nbytes <= plan.nbytes
        changes.add(worker, change, scratch)
        assert torch.equal(worker, copy.copy)  # the worker's copy is the shard's, to the bit
        largest = max(largest, update.norm().item())
        slack = 1e-5 * (w.norm().item() + 1)  # w_b + (w - w_b) rounds to within an ulp of w
        residual = (w - copy.copy).norm().item()
        assert residual <= c * delta + slack
        assert delta <= before + update.norm().item() + slack
        assert residual <= c / (1 - c) * largest + slack  # never grows without limit


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(1e-4, 10.0))
def test_quantization_keeps_every_element_within_half_a_level(seed, scale):
    plan, w = shard()
    changes = ParameterChanges(plan, "quantization", 0.01)
    copy = BroadcastCopy(w, changes, dense_every=10**9)
    worker, scratch = w.clone(), torch.empty_like(w)
    segments = shard_segments(plan)
    for version, update in enumerate(updates(seed, plan.numel, 30, scale), start=1):
        w = w + update
        delta = w - copy.copy
        copy.advance(w, version)
        changes.add(worker, copy.change_for(version - 1, version), scratch)
        assert torch.equal(worker, copy.copy)
        start = 0
        for _, n in segments:
            part, error = delta[start:start + n], (w - copy.copy)[start:start + n]
            half_level = (part.max() - part.min()).item() / 510
            slack = 1e-6 * (w[start:start + n].abs().max().item() + 1)
            assert error.abs().max().item() <= half_level * (1 + 1e-4) + slack
            start += n


def test_a_dense_version_resets_the_copy_to_the_parameters():
    plan, w = shard()
    copy = BroadcastCopy(w, ParameterChanges(plan, "topk", 0.05), dense_every=4)
    for version, update in enumerate(updates(3, plan.numel, 8, 0.1), start=1):
        w = w + update
        copy.advance(w, version)
        if version % 4 == 0:
            assert torch.equal(copy.copy, w) and copy.change_for(version - 1, version) is None
        else:
            assert not torch.equal(copy.copy, w) and copy.change_for(version - 1, version) is not None


def test_a_worker_holding_another_version_or_a_skipped_version_gets_none():
    plan, w = shard()
    copy = BroadcastCopy(w, ParameterChanges(plan, "topk", 0.05), dense_every=100)
    copy.advance(w + 1, 1)
    assert copy.change_for(0, 1) is not None
    assert copy.change_for(-1, 1) is None  # holds nothing (registered anew)
    assert copy.change_for(0, 2) is None  # asks for a version the copy is not at
    copy.advance(w + 2, 3)  # a version skipped: reset, dense
    assert copy.change_for(2, 3) is None and torch.equal(copy.copy, w + 2)


def test_a_change_that_does_not_decode_leaves_the_copy_unchanged():
    plan, w = shard()
    changes = ParameterChanges(plan, "topk", 0.05)
    held = w.clone()
    with pytest.raises(InvalidPayload):
        changes.add(held, b"\0" * (changes.nbytes - 1), torch.empty_like(w))
    assert torch.equal(held, w)


def test_dense_every_must_be_positive():
    plan, w = shard()
    with pytest.raises(ValueError, match="pull_dense_every"):
        BroadcastCopy(w, ParameterChanges(plan, "topk", 0.05), dense_every=0)


def test_a_compressed_answer_says_so_and_carries_only_the_change():
    plan, w = shard()
    changes = ParameterChanges(plan, "topk", 0.05)
    data = changes.encode(w)
    (raw,) = service.parameter_frames(plan, service.ParameterStamp(7, 5), memoryview(data), "topk")
    frame = service.read_parameters(raw)
    assert frame.header.compressed and frame.header.compression_type == "topk"
    assert frame.header.version == 7 and bytes(frame.data) == data


def test_the_summary_shows_pull_bytes_beside_push_bytes():
    totals = [WorkerTotals(10, 1.0, 400, 100, 0, 0, 0, 0, 1000)] * 2
    summary = compression_summary(totals, pull=True)
    assert summary["bytes_sent"] == 800 and summary["bytes_received"] == 200
    assert summary["compression_pull_ratio"] == pytest.approx(10.0)
    assert "compression_pull_ratio" not in compression_summary(totals, pull=False)
