"""What a node tells the coordinator about itself: its machine (GPU count and model from
torch when it is loaded, never importing it) and its heartbeat, built from its typed
progress and balance state."""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

from disttrain.coordinator.node_info import capabilities, heartbeat_message
from disttrain.coordinator.reports import BalanceState, NodeProgress


def fake_torch(count: int, name: str = "NVIDIA H100 80GB HBM3") -> SimpleNamespace:
    calls: list[str] = []

    def device_name(index: int) -> str:
        calls.append(f"name {index}")
        return name

    def device_count() -> int:
        calls.append("count")
        return count

    cuda = SimpleNamespace(is_available=lambda: count > 0, device_count=device_count,
                           get_device_name=device_name)
    return SimpleNamespace(cuda=cuda, calls=calls)


def test_capabilities_count_the_visible_gpus_when_torch_is_loaded(monkeypatch):
    torch = fake_torch(4)
    monkeypatch.setitem(sys.modules, "torch", torch)
    machine = capabilities()
    assert (machine.gpu, machine.gpu_count) == ("NVIDIA H100 80GB HBM3", 4)
    assert machine.cpus > 0 and machine.memory_bytes > 0
    assert torch.calls == ["name 0", "count"]  # the count once CUDA is up: its cached answer


def test_capabilities_without_cuda_or_without_torch_have_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(0))
    assert (capabilities().gpu, capabilities().gpu_count) == ("", 0)
    monkeypatch.delitem(sys.modules, "torch")
    assert (capabilities().gpu, capabilities().gpu_count) == ("", 0)
    assert "torch" not in sys.modules  # not imported only to describe the machine


def test_the_heartbeat_carries_the_progress_and_the_balance_state():
    progress = NodeProgress(epoch=2, step=40, samples=1280, work_s=3.5, balance=BalanceState(96, 812.5, 2))
    before = time.time()
    message = heartbeat_message("rank1", "rank", progress, generation=7, throughput=320.0, step_time_s=0.1)
    assert (message.node_id, message.role, message.epoch, message.step, message.generation) == (
        "rank1", "rank", 2, 40, 7)
    assert (message.throughput, message.step_time_s, message.pid) == (320.0, 0.1, os.getpid())
    assert (message.batch_size, message.warmup_speed, message.plans) == (96, 812.5, 2)
    assert before <= message.timestamp <= time.time()


def test_a_heartbeat_without_a_balance_state_says_unknown():
    message = heartbeat_message("server0", "server", NodeProgress(0, 12, 0), generation=1)
    assert message.step == 12 and (message.throughput, message.step_time_s) == (0.0, 0.0)
    assert (message.batch_size, message.warmup_speed, message.plans) == (0, 0.0, 0)
