"""Ranks of an `auto` run agree on one backend before the process group starts, with real
processes: through a real TCPStore (every rank reads the same answers, per attempt of the
group); through `disttrain ddp` on two nodes without a GPU (gloo, "no rank has a GPU",
and the run trains); and, on a machine with CUDA, a node that sees the GPU beside a node
that does not (gloo, the GPU rank computing on its GPU, checkpoints of both ranks'
different RNG states). Per-rank state whose names and sizes differ between ranks, as a
GPU rank's and a CPU rank's RNG states do, is gathered for the checkpoint intact."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from disttrain.core.addresses import unclaimed_port
from disttrain.core.checkpoint import rng_state
from disttrain.core.errors import DistributedError
from disttrain.strategies.ddp import rng
from disttrain.strategies.ddp.agreement import decide_backend, exchange_flags, store_prefix

WORLD_SIZE = 2
# Per attempt of the group (restart count): every rank's GPU flag.
ATTEMPTS = {0: (False, False), 1: (True, False)}
STEPS = 256 // WORLD_SIZE // 32  # 256 samples, batches of 32 per rank
MIXED = re.compile(r"backend gloo: rank [01] has no CUDA GPU \(NCCL needs every rank on a GPU\); "
                   r"GPU ranks compute on their GPU and all-reduce through the host")


def rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False)
    choices = {}
    for attempt, flags in ATTEMPTS.items():
        seen = exchange_flags(dist.PrefixStore(store_prefix(attempt), store), rank, WORLD_SIZE, flags[rank],
                              timeout_s=30)
        choice = decide_backend(seen)
        choices[attempt] = [seen, choice.backend, choice.reason]
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=WORLD_SIZE)
    # Rank 0 as a GPU rank: its RNG state has a "cuda" entry that rank 1's lacks.
    state = rng_state()
    if rank == 0:
        state["cuda"] = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    local = {"shared": torch.full((2, 3), float(rank)), "sized": torch.arange(3 + 4 * rank)}
    if rank == 1:
        local["only_rank1"] = torch.ones(5, dtype=torch.bool)
    gathered = {"rng": [rng.decode(t) for t in rng.gather_tensors(rng.encode(state), WORLD_SIZE,
                                                                    torch.device("cpu"))],
                "local": rng.gather_tensors(local, WORLD_SIZE, torch.device("cpu"))}
    try:
        rng.gather_tensors({"shared": torch.zeros(2, dtype=torch.float32 if rank else torch.float64)},
                           WORLD_SIZE, torch.device("cpu"))
        dtype_error = None
    except DistributedError as e:
        dtype_error = str(e)
    result = {"choices": choices, "dtype_error": dtype_error}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    torch.save({"gathered": gathered, "own_rng": state}, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as a rank of `disttrain ddp` leaves: gloo's threads can abort interpreter shutdown


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("agreement")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # binds a free port
    mp.start_processes(rank_main, args=(store.port, str(out_dir)), nprocs=WORLD_SIZE,
                       start_method="forkserver")
    return [{**json.loads((out_dir / f"rank{r}.json").read_text()),
             **torch.load(out_dir / f"rank{r}.pt", weights_only=True)} for r in range(WORLD_SIZE)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_reads_the_same_answers_of_its_own_attempt(ranks):
    for rank in ranks:
        assert rank["choices"]["0"] == [[False, False], "gloo", "no rank has a GPU"]
        seen, backend, reason = rank["choices"]["1"]
        assert (seen, backend) == ([True, False], "gloo") and reason.startswith("rank 1 has no CUDA GPU")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_per_rank_state_of_different_names_and_sizes_is_gathered_intact(ranks):
    for rank in ranks:  # every rank holds every rank's state, as each had it
        for r, own in enumerate(ranks):
            assert rank["gathered"]["rng"][r]["python"] == own["own_rng"]["python"]
            assert torch.equal(rank["gathered"]["rng"][r]["torch"], own["own_rng"]["torch"])
        cuda = zip(rank["gathered"]["rng"][0]["cuda"], ranks[0]["own_rng"]["cuda"], strict=True)
        assert [torch.equal(gathered, own) for gathered, own in cuda] == [True, True]
        assert "cuda" not in rank["gathered"]["rng"][1]
        local = rank["gathered"]["local"]
        assert [t["shared"].tolist() for t in local] == [[[0.0] * 3] * 2, [[1.0] * 3] * 2]
        assert [t["sized"].tolist() for t in local] == [list(range(3)), list(range(7))]
        assert "only_rank1" not in local[0] and local[1]["only_rank1"].dtype == torch.bool
        assert "'shared' in different or unknown dtypes" in rank["dtype_error"]


def run_two_nodes(cli, tmp_path: Path, node_envs: list[dict[str, str]]) -> list:
    """`disttrain ddp --nnodes 2`, one rank per node, each node with its own environment."""
    args = ["ddp", "--world-size", 2, "--nnodes", 2, "--rdzv-endpoint", f"localhost:{unclaimed_port()}",
            "--timeout-s", 60, "--dataset", "digits", "--num-epochs", 1, "--max-train-samples", 256,
            "--max-test-samples", 100, "--batch-size", 32, "--num-threads", 1, "--checkpoint-interval", 2,
            "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt"]
    with ThreadPoolExecutor(len(node_envs)) as pool:
        results = list(pool.map(lambda env: cli(*args, timeout=150, env=env), node_envs))
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    return results


def summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "logs" / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_nodes_without_a_gpu_agree_on_gloo_and_train(cli, tmp_path):
    results = run_two_nodes(cli, tmp_path, [{"CUDA_VISIBLE_DEVICES": ""}] * 2)
    output = "".join(r.stdout + r.stderr for r in results)
    assert output.count("backend gloo: no rank has a GPU") == 1  # once, by rank 0
    assert (summary(tmp_path)["backend"], summary(tmp_path)["steps"]) == ("gloo", STEPS)
    checkpoint = torch.load(tmp_path / "ckpt" / "checkpoint_step00000004.pt", weights_only=True)
    assert len(checkpoint["rng"]) == 2


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for the GPU node")
def test_a_gpu_node_beside_a_cpu_node_trains_over_gloo_with_the_gpu_rank_on_its_gpu(cli, tmp_path):
    results = run_two_nodes(cli, tmp_path, [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": ""}])
    output = "".join(r.stdout + r.stderr for r in results)
    assert len(MIXED.findall(output)) == 1, output[-3000:]
    assert re.search(r"joined \(gloo on cuda:0,", results[0].stderr), results[0].stderr[-3000:]
    assert re.search(r"joined \(gloo on cpu,", results[1].stderr), results[1].stderr[-3000:]
    assert summary(tmp_path)["backend"] == "gloo" and summary(tmp_path)["steps"] == STEPS
    # The checkpoint holds both ranks' RNG states, CUDA's on the GPU rank only.
    checkpoint = torch.load(tmp_path / "ckpt" / "checkpoint_step00000004.pt", weights_only=True)
    assert sorted("cuda" in state for state in checkpoint["rng"]) == [False, True]
    final = torch.load(tmp_path / "ckpt" / "ddp_final.pt", weights_only=True)["model"]
    assert all(torch.isfinite(value).all() for value in final.values())
