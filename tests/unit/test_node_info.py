"""What a node tells the coordinator about itself: its machine (GPU count and model from
torch when it is loaded, never importing it) and its balance state as heartbeat fields."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from disttrain.coordinator.node_info import balance_fields, capabilities


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


def test_balance_fields_name_the_heartbeat_fields_and_default_to_unknown():
    assert balance_fields({"batch": 96, "speed": 812.5, "plans": 2}) == {
        "batch_size": 96, "warmup_speed": 812.5, "plans": 2}
    assert balance_fields({"speed": 300}) == {"batch_size": 0, "warmup_speed": 300.0, "plans": 0}
    assert balance_fields({}) == balance_fields(None) == {"batch_size": 0, "warmup_speed": 0.0, "plans": 0}
    with pytest.raises(TypeError, match="dict"):
        balance_fields([96, 812.5, 2])
