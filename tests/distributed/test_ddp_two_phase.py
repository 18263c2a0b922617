"""The two-phase int8 all-reduce inside real DDP on a 3-rank gloo group (chunks that do not
divide the buckets evenly, two buckets, DDP's rebuild of its buckets after the first step):
every rank holds the same average bit for bit, within the two roundings of the true mean;
error feedback makes the mean of repeated steps on the same gradients converge to it;
the bytes each rank hands to the collectives are the chunks, flat in the ranks; and the
residuals checkpoint and load by parameter name."""

from __future__ import annotations

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

from disttrain.compression import two_phase
from disttrain.compression.ddp_hooks import TwoPhaseHook, build_ddp_hook, run_hook
from disttrain.config import CompressionConfig
from disttrain.strategies.ddp.comm_hooks import CommStats, register_comm_hook

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

WORLD_SIZE = 3
STEPS = 40


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(31, 47), nn.ReLU(), nn.Linear(47, 10))  # numels 1457, 47, 470, 10


def flat_gradients(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()]).clone()


def train(rank: int, error_feedback: bool) -> dict:
    module = make_model()
    generator = torch.Generator().manual_seed(100 + rank)
    inputs = torch.randn(16, 31, generator=generator)
    targets = torch.randint(0, 10, (16,), generator=generator)
    F.cross_entropy(module(inputs), targets).backward()
    local = flat_gradients(module)
    module.zero_grad(set_to_none=True)
    model = DistributedDataParallel(module, bucket_cap_mb=0.002)  # a bucket closes past 2 kB: two buckets
    section = CompressionConfig(enabled=True, type="quantization", ddp_collective="two_phase",
                                error_feedback=error_feedback)
    hook = build_ddp_hook(section, module.named_parameters(), seed=3, rank_seed=3 + rank)
    assert isinstance(hook, TwoPhaseHook)
    register_comm_hook(model, CommStats(), run_hook, hook)
    averaged, sent = [], []
    for _ in range(STEPS):  # the same gradients every step: nothing is stepped
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        averaged.append(flat_gradients(module))
        sent.append(astuple(hook.stats.drain())[:2])
    return {"local": local, "averaged": torch.stack(averaged), "sent": torch.tensor(sent),
            "state": hook.state_dict()}


def rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    torch.save({"feedback": train(rank, True), "plain": train(rank, False)}, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as a rank of `disttrain ddp` leaves: gloo's threads can abort interpreter shutdown


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("two_phase")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # binds a free port
    mp.start_processes(rank_main, args=(store.port, str(out_dir)), nprocs=WORLD_SIZE,
                       start_method="forkserver")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("run", ["feedback", "plain"])
def test_every_rank_holds_the_same_average_within_two_roundings_of_the_mean(ranks, run):
    for other in ranks[1:]:
        assert torch.equal(ranks[0][run]["averaged"], other[run]["averaged"])
    mean = sum(r[run]["local"] for r in ranks) / WORLD_SIZE
    first = ranks[0][run]["averaged"][0]
    # Phase 1 rounds each rank's chunk to half its level, phase 2 the mean to half its own.
    level = max(r[run]["local"].abs().max() for r in ranks) / two_phase.LEVELS
    assert (first - mean).abs().max() <= level + 1e-6
    assert (first - mean).abs().max() > 0  # it was quantized


def test_error_feedback_makes_the_mean_of_the_steps_converge_and_plain_rounding_does_not(ranks):
    mean = sum(r["feedback"]["local"] for r in ranks) / WORLD_SIZE
    fed = (ranks[0]["feedback"]["averaged"].mean(dim=0) - mean).abs().max()
    plain = (ranks[0]["plain"]["averaged"].mean(dim=0) - mean).abs().max()
    assert fed < plain / 3, (fed, plain)


def test_each_rank_hands_the_collectives_its_chunks_and_keeps_its_residuals_by_name(ranks):
    numel = sum(p.numel() for p in make_model().parameters())
    for r in ranks:
        dense, sent = r["feedback"]["sent"][-1].tolist()  # after DDP's rebuild of its buckets
        assert dense == 4 * numel
        # Every chunk and its scale, then the chunk it owns: P (n + 1) / n, with padding and scales.
        assert numel * (WORLD_SIZE + 1) / WORLD_SIZE <= sent <= numel * (WORLD_SIZE + 1) / WORLD_SIZE + 200
        names = {name for name, _ in make_model().named_parameters()}
        assert {key.removeprefix("quantization/residual/") for key in r["feedback"]["state"]
                if "/residual/" in key} == names
        assert {key.removeprefix("quantization/owned/") for key in r["feedback"]["state"]
                if "/owned/" in key} == names
    hook = TwoPhaseHook({}, error_feedback=True)
    hook.load_state_dict(ranks[0]["feedback"]["state"])
    assert set(hook.residuals) == set(hook.owner_residuals) == names
