"""DDP compression hooks' state without processes: PowerSGD's plan of a bucket, its state
following a bucket cut anew, checkpoint round trips, the step statistics, and a checkpoint
of another scheme refused by name."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from disttrain.compression.ddp_hooks import CompressionStats, build_ddp_hook
from disttrain.compression.powersgd import Pieces, PowerSGDBuckets, assemble, plan_bucket, split
from disttrain.config import CompressionConfig

LAYOUT = (("a", (16, 8)), ("bias", (16,)), ("c", (16, 2, 4)), ("d", (8, 16)))


def powersgd(rank: int = 2) -> PowerSGDBuckets:
    return PowerSGDBuckets(CompressionConfig(enabled=True, type="powersgd", powersgd_rank=rank), seed=5)


def test_plan_follows_powersgd_rules():
    plan = {t.name: t for t in plan_bucket(LAYOUT, rank=2, min_compression_rate=2)}
    # Compressed where (rows + cols) * rank * 2 < rows * cols: (16 + 8) * 2 * 2 < 128; a
    # vector never pays.
    assert [plan[n].rank for n in ("a", "bias", "c", "d")] == [2, 0, 2, 2]
    # P and Q memory grouped by matrix shape: a and c (both 16x8) before d.
    assert [(plan[n].p_offset, plan[n].q_offset) for n in ("a", "c", "d")] == [(0, 0), (32, 16), (64, 32)]
    assert plan["a"].sent_numel == 48 and plan["bias"].sent_numel == 16
    assert plan_bucket((("w", (64, 64)),), rank=2, min_compression_rate=2)[0].rank == 2
    assert plan_bucket((("w", (3, 3)),), rank=2, min_compression_rate=2)[0].rank == 0


def flat_state(layout, seed: int) -> dict[str, torch.Tensor]:
    plan = plan_bucket(layout, 2, 2)
    generator = torch.Generator().manual_seed(seed)
    sizes = {"error": sum(t.numel for t in plan), "p": sum(t.rows * t.rank for t in plan),
             "q": sum(t.cols * t.rank for t in plan)}
    return {category: torch.randn(size, generator=generator) for category, size in sizes.items()}


def test_state_split_and_assembled_in_another_order_keeps_every_value():
    flats = flat_state(LAYOUT, 0)
    pieces = Pieces()
    split(plan_bucket(LAYOUT, 2, 2), flats, pieces)
    reordered = tuple(reversed(LAYOUT))
    assembled = assemble(plan_bucket(reordered, 2, 2), pieces, torch.empty(0))
    assert not pieces.errors and not pieces.ps and not pieces.qs  # all taken
    back = Pieces()
    split(plan_bucket(reordered, 2, 2), assembled, back)
    expected = Pieces()
    split(plan_bucket(LAYOUT, 2, 2), flats, expected)
    for category, found in expected.categories().items():
        assert found.keys() == back.categories()[category].keys()
        assert all(torch.equal(value, back.categories()[category][n]) for n, value in found.items())


def test_bucket_cut_anew_gets_its_state_from_the_old_buckets():
    buckets = powersgd()
    first, second = LAYOUT[:2], LAYOUT[2:]
    buckets.fit(0, first, torch.empty(0))
    buckets.fit(1, second, torch.empty(0))
    for index, layout in ((0, first), (1, second)):
        for category, flat in flat_state(layout, index).items():
            buckets._entries()[category][index] = flat
    before = buckets.state_dict()
    # DDP rebuilt its buckets: one bucket, the other order.
    buckets.fit(0, tuple(reversed(LAYOUT)), torch.empty(0))
    assert set(buckets.state.error_dict) == {0} and set(buckets.state.p_memory_dict) == {0}
    after = buckets.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_checkpoint_round_trip_continues_the_same_way():
    buckets = powersgd()
    buckets.fit(0, LAYOUT, torch.empty(0))
    for category, flat in flat_state(LAYOUT, 1).items():
        buckets._entries()[category][0] = flat
    buckets.state.iter = 7
    buckets.state.rng.randint(10)
    saved = buckets.state_dict()
    assert all(isinstance(value, torch.Tensor) for value in saved.values())
    restored = powersgd()
    restored.load_state_dict(saved)
    assert restored.state.iter == 7 and restored.compressing
    restored.fit(0, tuple(reversed(LAYOUT)), torch.empty(0))  # a resumed run's first bucket
    assert restored.state_dict().keys() == saved.keys()
    assert all(torch.equal(saved[n], restored.state_dict()[n]) for n in saved)
    assert restored.state.rng.randint(1_000_000) == buckets.state.rng.randint(1_000_000)


def test_state_of_another_rank_setting_is_dropped_not_fitted(caplog):
    saved = powersgd(rank=2)
    saved.fit(0, LAYOUT, torch.empty(0))
    for category, flat in flat_state(LAYOUT, 2).items():
        saved._entries()[category][0] = flat
    other = powersgd(rank=1)
    other.load_state_dict(saved.state_dict())
    other.fit(0, LAYOUT, torch.empty(0))
    assert 0 in other.state.error_dict  # error feedback is per element: it still fits
    assert 0 not in other.state.p_memory_dict and 0 not in other.state.q_memory_dict
    assert "does not fit the bucket" in caplog.text


def test_stats_drain_per_step_and_keep_totals():
    stats = CompressionStats()
    threads = [threading.Thread(target=stats.record, args=(100, 10, 1, 0.5)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    step = stats.drain()
    assert (step.bytes_dense, step.bytes_sent, step.dense_segments) == (800, 80, 8)
    assert step.scalars()["time/compression_s"] == pytest.approx(4.0)
    stats.record(bytes_dense=50, bytes_sent=5)
    assert stats.drain().bytes_sent == 5 and stats.totals().bytes_sent == 85
    restored = CompressionStats()
    restored.load_state_dict(stats.state_dict())
    assert restored.totals() == stats.totals() and restored.drain().bytes_sent == 0


def model_hook(scheme: str, **settings):
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 2))
    section = CompressionConfig(enabled=True, type=scheme, **settings)
    return build_ddp_hook(section, model.named_parameters(), seed=1, rank_seed=2)


def test_compressor_state_round_trips_as_tensors():
    hook = model_hook("quantization", stochastic_rounding=True)
    hook.compressor.residuals = {"0.weight": torch.randn(128)}
    hook.compressor.draws = {"0.weight": 5, "1.weight": 4}
    hook.stats.record(400, 100)
    saved = hook.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in saved.values())
    assert {"quantization/totals", "quantization/residual/0.weight",
            "quantization/draws/0.weight"} <= set(saved)
    restored = model_hook("quantization", stochastic_rounding=True)
    restored.load_state_dict(saved)
    assert torch.equal(restored.compressor.residuals["0.weight"], hook.compressor.residuals["0.weight"])
    assert restored.compressor.draws == {"0.weight": 5, "1.weight": 4}
    assert restored.stats.totals().bytes_dense == 400
