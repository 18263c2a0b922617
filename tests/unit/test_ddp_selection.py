"""DDP decisions that need no process group: backend, device, precision, learning rate,
micro-batch grouping, rank variables, config rules. GPU-only paths skip without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.core.errors import ConfigError, DistributedError
from disttrain.strategies.ddp.participant import scaled_learning_rate
from disttrain.strategies.ddp.runtime import (
    RankInfo,
    check_gpu_count,
    check_supported,
    check_world_size,
    is_peer_loss,
    node_backend,
    select_backend,
    select_device,
    started_by_elastic_agent,
)
from disttrain.training.engine import thread_count
from disttrain.training.loop import groups as accumulation_groups

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RANK_ENV = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "TORCHELASTIC_RESTART_COUNT": "3"}


def test_auto_backend_follows_cuda():
    assert select_backend("auto", cuda_available=True) == "nccl"
    assert select_backend("auto", cuda_available=False) == "gloo"
    assert select_backend("gloo", cuda_available=True) == "gloo"
    assert select_backend("nccl", cuda_available=True) == "nccl"


def test_nccl_without_gpu_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as info:
        select_backend("nccl", cuda_available=False)
    message = str(info.value)
    assert "nccl" in message and "--backend gloo" in message and "\n" not in message


def test_nccl_needs_one_gpu_per_rank_of_the_node():
    assert node_backend("auto", ranks_per_node=4, num_gpus=2) == "gloo"  # 2 ranks without a GPU
    assert node_backend("auto", ranks_per_node=2, num_gpus=2) == "nccl"
    assert node_backend("auto", ranks_per_node=2, num_gpus=0) == "gloo"
    with pytest.raises(ConfigError, match="one rank per GPU"):
        node_backend("nccl", ranks_per_node=4, num_gpus=2)
    check_gpu_count("nccl", ranks_per_node=2, num_gpus=2)
    check_gpu_count("gloo", ranks_per_node=8, num_gpus=0)
    with pytest.raises(ConfigError, match="4 ranks per node"):
        check_gpu_count("nccl", ranks_per_node=4, num_gpus=2)


def test_one_device_per_rank():
    assert select_device("nccl", local_rank=3) == torch.device("cuda", 3)
    assert select_device("gloo", local_rank=3) == torch.device("cpu")


def test_learning_rate_scaling():
    assert scaled_learning_rate(0.01, "none", 4) == 0.01
    assert scaled_learning_rate(0.01, "linear", 4) == pytest.approx(0.04)
    with pytest.raises(ConfigError):
        scaled_learning_rate(0.01, "sqrt", 4)


def test_accumulation_groups_keep_order_and_a_short_tail():
    batches = [torch.tensor([i]) for i in range(7)]
    groups = list(accumulation_groups(iter(batches), 3))
    assert [[int(b) for b in g] for g in groups] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [len(g) for g in accumulation_groups(iter(batches), 1)] == [1] * 7


def test_world_size_larger_than_the_data_is_a_config_error():
    with pytest.raises(ConfigError, match="world size 5 is larger than the 4 training samples"):
        check_world_size(4, world_size=5)
    check_world_size(5, world_size=5)


def test_rank_info_from_the_agent_variables():
    info = RankInfo.from_env(RANK_ENV)
    assert info == RankInfo(rank=1, world_size=4, local_rank=1, local_world_size=2, restart_count=3)
    assert not info.is_main and started_by_elastic_agent(RANK_ENV)
    assert not started_by_elastic_agent({"RANK": "0"})
    with pytest.raises(DistributedError, match="MASTER_PORT"):
        RankInfo.from_env({k: v for k, v in RANK_ENV.items() if k != "MASTER_PORT"})


def test_peer_loss_is_recognised():
    assert is_peer_loss(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert not is_peer_loss(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_loss(ValueError("Connection closed by peer"))


def test_ddp_config_rules():
    config = config_from_dict({"ddp": {"num_nodes": 2, "rdzv_endpoint": "node0:29400"}})
    assert config.ddp.num_nodes == 2
    with pytest.raises(ConfigError) as info:
        config_from_dict({"ddp": {"num_nodes": 2}})
    assert any("ddp.rdzv_endpoint" in p and "--rdzv-endpoint" in p for p in info.value.problems)
    for bad in ("node0", "node0:http", ":29400", "node0:70000"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            config_from_dict({"ddp": {"rdzv_endpoint": bad}})
    assert config_from_dict({"ddp": {"rdzv_endpoint": "[::1]:29400"}}).ddp.rdzv_endpoint


@pytest.mark.parametrize(("scheme", "refused"), [("topk", True), ("quantization", True), ("powersgd", True),
                                                 ("fp16", False), ("bf16", False)])
def test_stateful_compression_refuses_fp16_loss_scaling(scheme, refused):
    config = config_from_dict({"compression": {"enabled": True, "type": scheme},
                               "training": {"precision": "fp16"}})
    if refused:
        with pytest.raises(ConfigError, match=f"compression.type: {scheme} cannot take the overflowed"):
            check_supported(config)
    else:
        check_supported(config)
    check_supported(config.replace(training={"precision": "bf16"}))


def test_thread_count_divides_the_cores_among_the_ranks():
    assert thread_count(3, processes_per_machine=4) == 3
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert thread_count(0, processes_per_machine=1) == cores
    assert thread_count(0, processes_per_machine=cores * 2) == 1
