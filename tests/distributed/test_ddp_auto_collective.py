"""`compression.ddp_collective: auto` inside real DDP on a 3-rank gloo group: a top-k
bucket whose gathered payloads would outgrow the dense ring (half the entries kept, 8
bytes each: (n - 1) x the tensor against 2(n - 1)/n x) is all-reduced dense instead, with
the same average as the all-gather's and the same error feedback, every rank holding the
same bits, and the dense bytes counted; int8 takes the two phases beyond 2 ranks."""

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

from disttrain.compression.ddp_hooks import GatherHook, TwoPhaseHook, build_ddp_hook, run_hook
from disttrain.config import CompressionConfig
from disttrain.strategies.ddp.comm_hooks import CommStats, register_comm_hook

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

WORLD_SIZE = 3
STEPS = 5


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(31, 47), nn.ReLU(), nn.Linear(47, 10))


def train(rank: int, collective: str) -> dict:
    module = make_model()
    generator = torch.Generator().manual_seed(100 + rank)
    inputs = torch.randn(16, 31, generator=generator)
    targets = torch.randint(0, 10, (16,), generator=generator)
    model = DistributedDataParallel(module, bucket_cap_mb=0.002)  # two buckets
    section = CompressionConfig(enabled=True, type="topk", ratio=0.5, ddp_collective=collective)
    hook = build_ddp_hook(section, module.named_parameters(), seed=3, rank_seed=3 + rank)
    assert isinstance(hook, GatherHook)
    register_comm_hook(model, CommStats(), run_hook, hook)
    averaged, sent = [], []
    for _ in range(STEPS):  # the same gradients every step: the residuals change what is kept
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        averaged.append(torch.cat([p.grad.reshape(-1) for p in module.parameters()]).clone())
        sent.append(astuple(hook.stats.drain())[:2])
    return {"averaged": torch.stack(averaged), "sent": torch.tensor(sent), "state": hook.state_dict()}


def rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    int8 = CompressionConfig(enabled=True, type="quantization")  # auto, the default
    chosen = {"int8_here": type(build_ddp_hook(int8, make_model().named_parameters(), 3, 3)).__name__,
              "int8_at_2": type(build_ddp_hook(int8, make_model().named_parameters(), 3, 3, 2)).__name__}
    torch.save({"auto": train(rank, "auto"), "gather": train(rank, "gather"), "chosen": chosen},
               Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as a rank of `disttrain ddp` leaves: gloo's threads can abort interpreter shutdown


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("auto_collective")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # binds a free port
    mp.start_processes(rank_main, args=(store.port, str(out_dir)), nprocs=WORLD_SIZE,
                       start_method="forkserver")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


def test_a_bucket_the_gather_would_outgrow_goes_dense_with_the_same_average(ranks):
    for other in ranks[1:]:
        assert torch.equal(ranks[0]["auto"]["averaged"], other["auto"]["averaged"])
    # the same payloads averaged, summed in another order
    torch.testing.assert_close(ranks[0]["auto"]["averaged"], ranks[0]["gather"]["averaged"],
                               rtol=1e-5, atol=1e-7)
    for r in ranks:  # the error feedback is the payload's either way
        assert r["auto"]["state"].keys() == r["gather"]["state"].keys()
        for key, value in r["auto"]["state"].items():
            if "/residual/" in key:
                torch.testing.assert_close(value, r["gather"]["state"][key])


def test_the_dense_transport_hands_the_collective_the_dense_bytes(ranks):
    numel = sum(p.numel() for p in make_model().parameters())
    for r in ranks:
        dense, sent = r["auto"]["sent"][-1].tolist()
        assert dense == sent == 4 * numel
        dense, sent = r["gather"]["sent"][-1].tolist()
        assert dense == 4 * numel and sent >= 8 * numel // 2  # half the entries, 8 bytes each


def test_int8_takes_the_two_phases_beyond_two_ranks(ranks):
    assert ranks[0]["chosen"] == {"int8_here": TwoPhaseHook.__name__, "int8_at_2": GatherHook.__name__}
