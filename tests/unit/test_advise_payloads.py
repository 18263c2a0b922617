"""The cost model's byte formulas against what the real compressors put on the wire, on a
model of odd shapes (a scalar, 1-d, a convolution whose matrix is too small to compress,
matrices that are, a wide and a tall one): PowerSGD's P and Q as PyTorch's own hook
allocates and counts them inside real DDP on a one-rank gloo group in this process, and a
pulled change as each shard's real `ParameterChanges` encodes it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from disttrain.advise import Candidate, CompressionCost, CostModel, Link, Workload
from disttrain.advise.payloads import powersgd_numel, pull_bytes_per_step, pull_change_bytes
from disttrain.compression.ddp_hooks import build_ddp_hook, run_hook
from disttrain.config import CompressionConfig
from disttrain.strategies.ddp.comm_hooks import CommStats, register_comm_hook
from disttrain.strategies.ps.server.broadcast import BroadcastCopy
from disttrain.strategies.ps.wire.payloads import ParameterChanges
from disttrain.strategies.ps.wire.sharding import plan_shards

pytestmark = pytest.mark.timeout(120)

POWERSGD_START = 2  # the hook all-reduces plainly at its first two steps


class OddShapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, (3, 2))  # 5 x 18: not worth compressing at rank >= 2
        self.wide = nn.Linear(37, 29)  # 29 x 37
        self.tall = nn.Linear(3, 53, bias=False)  # 53 x 3
        self.odd = nn.Linear(13, 7)  # 7 x 13
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d
        self.tiny = nn.Parameter(torch.ones(1, 1))

    def forward(self, x):
        y = self.conv(x).flatten(1)[:, :37]
        y = self.wide(y)[:, :3]
        y = self.tall(y)[:, :13]
        return (self.odd(y) * self.scale * self.tiny).sum()


def shapes(module: nn.Module) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p.shape) for p in module.parameters())


@pytest.fixture(scope="module")
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.001])
def test_powersgd_bytes_are_what_pytorchs_hook_sends(one_rank_group, rank, bucket_cap_mb):
    torch.manual_seed(0)
    module = OddShapes()
    model = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    section = CompressionConfig(enabled=True, type="powersgd", powersgd_rank=rank)
    hook = build_ddp_hook(section, module.named_parameters(), seed=3, rank_seed=3)
    register_comm_hook(model, CommStats(), run_hook, hook)
    for _ in range(POWERSGD_START + 1):
        model.zero_grad(set_to_none=True)
        model(torch.randn(2, 3, 9, 8)).backward()
    state = hook.buckets.state
    sent = state.total_numel_after_compression  # counted by PyTorch's hook, one compressed step
    assert state.total_numel_before_compression == sum(p.numel() for p in module.parameters())
    factors = sum(m.numel() for m in (*state.p_memory_dict.values(), *state.q_memory_dict.values()))
    assert 0 < factors < sent < state.total_numel_before_compression
    assert powersgd_numel(shapes(module), rank) == sent


@pytest.mark.parametrize("scheme", ["topk", "quantization", "fp16", "bf16"])
@pytest.mark.parametrize("num_shards", [1, 3, 4])
def test_pulled_bytes_are_what_the_shards_real_changes_encode(scheme, num_shards):
    torch.manual_seed(1)
    module = OddShapes()
    ratio, dense_every = 0.03, 5
    plans = plan_shards(module, num_shards)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    encoded = 0
    for plan in plans:
        changes = ParameterChanges(plan, scheme, ratio)
        copy = BroadcastCopy(flat[plan.offset:plan.offset + plan.numel], changes, dense_every)
        moved = flat[plan.offset:plan.offset + plan.numel] + torch.randn(plan.numel)
        copy.advance(moved, 1)
        encoded += len(copy.change)
    assert pull_change_bytes(shapes(module), num_shards, scheme, ratio) == encoded
    dense = 4 * flat.numel()
    per_step = pull_bytes_per_step(shapes(module), num_shards, scheme, ratio, dense_every)
    assert per_step == pytest.approx(((dense_every - 1) * encoded + dense) / dense_every)
    assert pull_bytes_per_step(shapes(module), num_shards, "none", ratio, dense_every) == dense


def test_the_model_carries_the_formulas_into_a_step():
    module = OddShapes()
    sizes = shapes(module)
    numel = sum(math.prod(s) for s in sizes)
    costs = {"powersgd": CompressionCost("powersgd", 2.0, 4 * powersgd_numel(sizes, 2), 1e-3, 1e-3)}
    pulls = {"topk": CompressionCost("topk", 0.03, 0, 2e-3, 1e-3)}
    workload = Workload("odd", numel, 4 * numel, len(sizes), 8, 0.01, 0.02, 0.001, 0.0, "given", costs,
                        sizes, pulls)
    model = CostModel(workload, Link(1e8, 1e-4), pull_ratio=0.03, pull_dense_every=5)
    plain = model.predict(Candidate("ps-sync", "none", 3), 8)
    pulled = model.predict(Candidate("ps-sync", "none", 3, 1, "topk"), 8)
    expected_pull = pull_bytes_per_step(sizes, 3, "topk", 0.03, 5)
    assert pulled.bytes_per_step == pytest.approx(4 * numel + expected_pull)
    assert plain.bytes_per_step == 8 * numel
    ddp = model.predict(Candidate("ddp", "powersgd"), 8)
    assert ddp.bytes_per_step == pytest.approx(2 * 2 * 7 / 8 * 4 * powersgd_numel(sizes, 2))
    with pytest.raises(ValueError, match="DDP's all-reduce only"):
        Candidate("ps-sync", "powersgd", 1)
    with pytest.raises(ValueError, match="without local updates"):
        Candidate("ps-sync", "none", 1, 4, "topk")


def test_async_pulls_are_priced_as_the_changes_a_worker_missed():
    module = OddShapes()
    sizes = shapes(module)
    numel = sum(math.prod(s) for s in sizes)
    pulls = {"topk": CompressionCost("topk", 0.03, 0, 2e-3, 1e-3)}
    workload = Workload("odd", numel, 4 * numel, len(sizes), 8, 0.01, 0.02, 0.001, 0.0, "given", {},
                        sizes, pulls)
    model = CostModel(workload, Link(1e7, 1e-4), pull_ratio=0.03, pull_dense_every=50)
    change = pull_change_bytes(sizes, 2, "topk", 0.03)
    for n in (2, 4, 40, 100):  # the workers' updates leave each one n versions behind
        plain = model.predict(Candidate("ps-async", "none", 2), n)
        pulled = model.predict(Candidate("ps-async", "none", 2, 1, "topk"), n)
        crossing = min(1.0, n / 50)
        missed = crossing * 4 * numel + (1 - crossing) * min(n * change, 4 * numel)
        assert pulled.bytes_per_step == pytest.approx(4 * numel + missed)
        assert plain.bytes_per_step == 8 * numel
        # the shards encode and add every update's change: fewer updates a second at most
        assert pulled.details["shard_updates_per_s"] < plain.details["shard_updates_per_s"]
        if n * change < 4 * numel:
            assert pulled.bytes_per_step < plain.bytes_per_step
        else:  # as far behind as the kept changes reach, or past them: dense
            assert pulled.bytes_per_step == pytest.approx(plain.bytes_per_step)
