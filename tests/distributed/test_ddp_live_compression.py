"""Live mode's compressed gradient average with a real gloo group of two processes: every
scheme's DDP hook runs on the flat buffer (`FlatBucket`), both ranks end with the same
average, close to the exact one; the state a joiner takes carries no residual, and taking
it leaves the taker's residual at zero. A PowerSGD trainer that joins a member already
past PowerSGD's plain first iterations takes its iteration, P and Q, so their collectives
match and they end with the same model."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from disttrain.config import CompressionConfig, Config
from tests.live_steps import live_step

pytestmark = pytest.mark.slow  # every test spawns a process group of live ranks

SCHEMES = ("topk", "quantization", "two_phase", "fp16", "bf16", "powersgd")
# two_phase: int8 combined by the two-phase collective (`compression.ddp_collective`)
SECTIONS = {"two_phase": {"type": "quantization", "ddp_collective": "two_phase"}}
STEPS = 4


def rank_main(rank: int, port: int, scheme: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    from disttrain.compression.ddp_hooks import average_flat
    from disttrain.strategies.ddp.participant import compression_hook
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    section = SECTIONS.get(scheme, {"type": scheme})
    config = replace(Config(), compression=CompressionConfig(enabled=True, ratio=0.25, **section))
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))
    params = list(module.parameters())
    hook = compression_hook(config.compression, config.training.seed, module, rank, 2)
    assert hook is not None
    generator = torch.Generator().manual_seed(100 + rank)
    record: dict = {"averages": [], "exact": []}
    for _ in range(STEPS):
        flat = torch.randn(sum(p.numel() for p in params), generator=generator)
        exact = flat.clone()
        dist.all_reduce(exact)
        record["exact"].append((exact / 2).tolist())
        record["averages"].append(average_flat(flat.clone(), params, hook).tolist())
    shared = hook.shared_state()
    record["shared_names"] = sorted(shared)
    record["residual_names"] = sorted(set(hook.state_dict()) - set(shared))
    hook.load_shared_state(shared)
    record["left_after_load"] = sorted(set(hook.state_dict()) - set(hook.shared_state()))
    dist.barrier()
    dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_averages_the_flat_buffer_alike_on_every_rank(tmp_path, scheme):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    context = mp.get_context("forkserver")
    processes = [context.Process(target=rank_main, args=(rank, store.port, scheme, str(tmp_path)))
                 for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=100)
        assert process.exitcode == 0
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert records[0]["averages"] == records[1]["averages"]  # the same bits on both ranks
    for average, exact in zip(records[0]["averages"], records[0]["exact"], strict=True):
        average, exact = torch.tensor(average), torch.tensor(exact)
        if scheme in ("fp16", "bf16"):
            assert torch.allclose(average, exact, atol=0.05)
        else:  # lossy: what is sent still points the way of the exact average
            assert torch.dot(average, exact) > 0
            assert not torch.equal(average, torch.zeros_like(average))
    for record in records:
        assert record["left_after_load"] == []
        if scheme in ("topk", "quantization"):
            assert record["residual_names"] and all("/residual/" in n for n in record["residual_names"])
        if scheme == "two_phase":  # phase 1's rounding and the owned chunk's: both this rank's own
            assert {n.split("/")[1] for n in record["residual_names"]} == {"residual", "owned"}
        if scheme == "powersgd":  # after the plain first iterations, P and Q are shared
            assert any("/q/" in name for name in record["shared_names"])


POWERSGD = {"training": {"dataset": "digits", "model_architecture": "mlp", "batch_size": 8, "seed": 3},
            "compression": {"enabled": True, "type": "powersgd", "powersgd_rank": 2},
            "system": {"num_workers": 2}}


def powersgd_member(slot: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    from disttrain.strategies.ddp.live.group import LiveGroup, connect
    from disttrain.strategies.ddp.live.membership import Patience
    from disttrain.strategies.ddp.live.state import share_state
    from disttrain.strategies.ddp.live.trainer import LiveTrainer
    trainer = LiveTrainer(Config().replace(**POWERSGD), slot)
    group = LiveGroup(connect("127.0.0.1", port, 30.0), slot, Patience(1.0, 5.0, 30.0))
    if slot == 0:  # alone in generation 0, it gets past PowerSGD's plain iterations
        group.form(0, (0,))
        trainer.attach(0, 1)
        for _ in range(4):
            live_step(trainer)
        tickets = 0
        while tickets == 0:  # step boundaries until slot 1's ticket shows
            tickets = group.pending_joins(0)
        trainer.detach()  # as a live rank does before the group changes
        grown = group.grow(0, tickets)
    else:  # holds no state: it asks to join and takes slot 0's
        grown = group.request_join()
    assert grown == (1, (0, 1))
    group.form(*grown)
    state = share_state(trainer.state_dict() if slot == 0 else None, 0, group.rank, group.store,
                        "gen1/state", 30.0)
    if slot == 1:
        trainer.load_state_dict(state)
    trainer.attach(group.rank, group.world_size)
    for _ in range(3):
        live_step(trainer)
    assert trainer.compression is not None
    record = {"iter": trainer.compression.state_dict()["powersgd/iter"].tolist()[0],
              "weights": [p.detach().sum().item() for p in trainer.module.parameters()]}
    dist.barrier()
    group.leave()
    (Path(out_dir) / f"slot{slot}.json").write_text(json.dumps(record))
    os._exit(0)


@pytest.mark.timeout(120)
def test_a_powersgd_joiner_takes_the_members_state_and_its_collectives_match(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    context = mp.get_context("forkserver")
    processes = [context.Process(target=powersgd_member, args=(slot, store.port, str(tmp_path)))
                 for slot in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=100)
        assert process.exitcode == 0  # a collective mismatch aborts gloo (SIGABRT)
    records = [json.loads((tmp_path / f"slot{slot}.json").read_text()) for slot in range(2)]
    assert records[0]["iter"] == records[1]["iter"] == 4 + 3  # the joiner went on from slot 0's count
    assert records[0]["weights"] == records[1]["weights"]
