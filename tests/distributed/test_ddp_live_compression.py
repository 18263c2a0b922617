"""Live mode's compressed gradient average with a real gloo group of two processes: every
scheme's DDP hook runs on the flat buffer (`FlatBucket`), both ranks end with the same
average, close to the exact one; the state a joiner takes carries no residual, and taking
it leaves the taker's residual at zero."""

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

SCHEMES = ("topk", "quantization", "fp16", "bf16", "powersgd")
STEPS = 4


def rank_main(rank: int, port: int, scheme: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    from disttrain.strategies.ddp.live.compression import (
        compressed_average,
        live_compression,
        load_shared_state,
        shared_state,
    )
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    config = replace(Config(), compression=CompressionConfig(enabled=True, type=scheme, ratio=0.25))
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))
    params = list(module.parameters())
    hook = live_compression(config, module, rank)
    assert hook is not None
    generator = torch.Generator().manual_seed(100 + rank)
    record: dict = {"averages": [], "exact": []}
    for _ in range(STEPS):
        flat = torch.randn(sum(p.numel() for p in params), generator=generator)
        exact = flat.clone()
        dist.all_reduce(exact)
        record["exact"].append((exact / 2).tolist())
        record["averages"].append(compressed_average(hook, flat.clone(), params).tolist())
    shared = shared_state(hook)
    record["shared_names"] = sorted(shared)
    record["residual_names"] = sorted(set(hook.state_dict()) - set(shared))
    load_shared_state(hook, shared)
    record["left_after_load"] = sorted(set(hook.state_dict()) - set(shared_state(hook)))
    dist.barrier()
    dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_averages_the_flat_buffer_alike_on_every_rank(tmp_path, scheme):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    context = mp.get_context("spawn")
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
        if scheme == "powersgd":  # after the plain first iterations, P and Q are shared
            assert any("/q/" in name for name in record["shared_names"])
