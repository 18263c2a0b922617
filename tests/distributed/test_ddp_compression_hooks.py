"""The compression hooks inside real DDP on a 2-rank gloo group: each scheme's averaged
gradient against what each rank computed alone, every rank holding the same bits, and
the bytes each hook says it sent.

The ranks train a small MLP on fixed, different batches without stepping, so every step
sees the same gradients: PowerSGD's error feedback must then make the mean of its
compressed steps converge to the true mean, which it does not without."""

from __future__ import annotations

import math
import os
from dataclasses import astuple
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from disttrain.compression.ddp_hooks import build_ddp_hook, run_hook
from disttrain.compression.schemes import segment_nbytes, topk_count
from disttrain.config import CompressionConfig
from disttrain.strategies.ddp.comm_hooks import CommStats, register_comm_hook

# Real ranks of a process group train once for the whole module (several seconds).
pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

SCHEMES = ("quantization", "topk", "fp16", "bf16", "powersgd")
# (scheme, error feedback, steps, bucket_cap_mb); PowerSGD all-reduces plainly at steps
# 1-2, then compresses, here in two buckets (a bucket closes once past 1 kB).
RUNS = {scheme: (scheme, True, 3, 25.0) for scheme in SCHEMES} | {
    "powersgd": ("powersgd", True, 60, 0.001), "powersgd_no_feedback": ("powersgd", False, 60, 0.001)}
RATIO = 0.1
WORLD_SIZE = 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def flat_gradients(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()]).clone()


def train(rank: int, scheme: str, error_feedback: bool, steps: int, bucket_cap_mb: float) -> dict:
    module = make_model()
    generator = torch.Generator().manual_seed(100 + rank)
    inputs = torch.randn(16, 32, generator=generator)
    targets = torch.randint(0, 10, (16,), generator=generator)
    F.cross_entropy(module(inputs), targets).backward()
    local = flat_gradients(module)
    module.zero_grad(set_to_none=True)
    model = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    section = CompressionConfig(enabled=True, type=scheme, ratio=RATIO, powersgd_rank=1,
                                error_feedback=error_feedback)
    hook = build_ddp_hook(section, module.named_parameters(), seed=3, rank_seed=3 + rank)
    register_comm_hook(model, CommStats(), run_hook, hook)
    averaged, samples, powersgd_numel = [], [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        averaged.append(flat_gradients(module))
        samples.append(astuple(hook.stats.drain())[:3])  # bytes dense and sent, dense tensors
        if scheme == "powersgd":
            powersgd_numel.append(hook.buckets.state.total_numel_after_compression)
    num_buckets = len(hook.buckets.layouts) if scheme == "powersgd" else None
    return {"local": local, "averaged": torch.stack(averaged), "samples": samples,
            "powersgd_numel": powersgd_numel, "num_buckets": num_buckets}


def rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    torch.save({name: train(rank, *run) for name, run in RUNS.items()}, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    # Leave as a rank of `disttrain ddp` does: gloo's threads can abort interpreter shutdown.
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' results of every run (one process group, one run after another)."""
    out_dir = tmp_path_factory.mktemp("hooks")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # binds a free port
    mp.start_processes(rank_main, args=(store.port, str(out_dir)), nprocs=WORLD_SIZE,
                       start_method="forkserver")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


def shapes() -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in make_model().parameters()]


def per_parameter(flat: torch.Tensor) -> list[torch.Tensor]:
    return list(flat.split([math.prod(shape) for shape in shapes()]))


def true_mean(ranks, scheme: str) -> torch.Tensor:
    return sum(r[scheme]["local"] for r in ranks) / WORLD_SIZE


@pytest.mark.parametrize("scheme", RUNS)
def test_every_rank_holds_the_same_average(ranks, scheme):
    assert torch.equal(ranks[0][scheme]["averaged"], ranks[1][scheme]["averaged"])
    assert ranks[0][scheme]["samples"] == ranks[1][scheme]["samples"]


@pytest.mark.parametrize(("scheme", "rtol"), [("fp16", 1e-3), ("bf16", 1e-2)])
def test_half_precision_averages_within_its_precision(ranks, scheme, rtol):
    averaged, mean = ranks[0][scheme]["averaged"][0], true_mean(ranks, scheme)
    torch.testing.assert_close(averaged, mean, rtol=rtol, atol=rtol * mean.abs().max().item())
    assert not torch.equal(averaged, mean)  # it did travel in half precision
    assert ranks[0][scheme]["samples"][0] == (4 * mean.numel(), 2 * mean.numel(), 0)


def test_quantization_average_is_within_half_a_level_of_each_rank(ranks):
    averaged = per_parameter(ranks[0]["quantization"]["averaged"][0])  # step 1: no residual yet
    own = [per_parameter(r["quantization"]["local"]) for r in ranks]
    for i, value in enumerate(averaged):
        # Rounding to the nearest of 255 levels errs by half a level at most on each rank.
        bound = sum((g[i].max() - g[i].min()).item() / 255 / 2 for g in own) / WORLD_SIZE
        error = (value - sum(g[i] for g in own) / WORLD_SIZE).abs().max().item()
        assert 0 < error <= bound * 1.001 + 1e-9, (i, error, bound)
    dense, sent, raw = ranks[0]["quantization"]["samples"][0]
    assert sent == sum(segment_nbytes("quantization", math.prod(s), 4, RATIO) for s in shapes())
    assert dense == 4 * sum(math.prod(s) for s in shapes()) and raw == 0


def top_k(x: torch.Tensor) -> torch.Tensor:
    kept = torch.zeros_like(x)
    indices = x.abs().topk(topk_count(x.numel(), RATIO)).indices
    kept[indices] = x[indices]
    return kept


def test_topk_average_is_the_mean_of_each_ranks_top_k(ranks):
    # The model is one bucket, and top-k picks its k over the whole bucket.
    kept = [top_k(r["topk"]["local"]) for r in ranks]
    assert torch.equal(ranks[0]["topk"]["averaged"][0], (kept[0] + kept[1]) / WORLD_SIZE)
    _, sent, raw = ranks[0]["topk"]["samples"][0]
    numel = sum(math.prod(s) for s in shapes())
    assert sent == segment_nbytes("topk", numel, 4, RATIO) == 4 + 8 * topk_count(numel, RATIO)
    assert raw == 0


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((x - reference).norm() / reference.norm()).item()


def cumulative_errors(ranks, run: str) -> list[float]:
    """The error of the mean of the first k compressed steps, for each k."""
    compressed, mean = ranks[0][run]["averaged"][2:], true_mean(ranks, run)
    return [relative_error(compressed[:k].mean(dim=0), mean) for k in range(1, len(compressed) + 1)]


def test_powersgd_error_feedback_makes_the_compressed_steps_converge(ranks):
    mean = true_mean(ranks, "powersgd")
    for step in (0, 1):  # plain all-reduce
        torch.testing.assert_close(ranks[0]["powersgd"]["averaged"][step], mean, rtol=1e-6, atol=1e-7)
    with_feedback = cumulative_errors(ranks, "powersgd")
    without = cumulative_errors(ranks, "powersgd_no_feedback")
    assert with_feedback[0] == without[0] > 0.05  # rank 1 loses much in one step
    # What one step leaves out, later steps send: the mean closes in on the true mean.
    assert with_feedback[-1] < with_feedback[9] < with_feedback[0] / 1.5
    assert with_feedback[-1] < without[-1] / 3


def test_powersgd_bytes_follow_the_hooks_own_count(ranks):
    result = ranks[0]["powersgd"]
    assert result["num_buckets"] > 1  # several buckets in flight on gloo, one after another
    numel = result["powersgd_numel"]
    dense = 4 * sum(math.prod(s) for s in shapes())
    for step, (bytes_dense, sent, raw) in enumerate(result["samples"]):
        assert bytes_dense == dense
        assert raw == 2  # the biases: a vector never pays
        if step < 2:
            assert sent == dense
        else:  # what PowerSGDState itself counts as elements after compression
            assert sent == 4 * (numel[step] - numel[step - 1]) and sent < dense / 10
