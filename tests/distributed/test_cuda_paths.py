"""Paths that change when the model lives on a CUDA device, with real parts: a worker's
device tensors pushed to and pulled from a real parameter-server shard (the CPU variant
runs everywhere, the CUDA one where a GPU is), and a loader's batches in pinned memory
for copies to the GPU. The GPU check (tools/gpu_check.sh) runs the `gpu` ones."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from disttrain.data import ArrayDataset, ShardedSampler
from disttrain.training.loading import prefetch

pytestmark = pytest.mark.timeout(120)

TOOLS = Path(__file__).resolve().parents[2] / "tools"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


def ps_wire():
    """tools/gpu_ps_wire.py, loaded from its file (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("gpu_ps_wire", TOOLS / "gpu_ps_wire.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_a_shard_takes_gradients_from_device_tensors_and_answers_into_them(tmp_path, device, transport):
    result = ps_wire().exchange(tmp_path, torch.device(device), transport, hidden_size=64)
    assert result["matches"], result  # every step: the SGD update, in a tensor still on the device
    assert result["device"].startswith(device) and result["parameters"] > 0 and result["gb_per_s"] > 0


@pytest.mark.gpu
@needs_cuda
def test_loader_workers_hand_a_cuda_run_pinned_batches_equal_to_the_data_sets():
    generator = torch.Generator().manual_seed(0)
    source = ArrayDataset("tiny", torch.randn(64, 1, 4, 4, generator=generator),
                          torch.randint(0, 10, (64,), generator=generator))
    sampler = ShardedSampler(64, seed=1)
    loader = prefetch(source, 1, device_type="cuda")
    try:
        loader.start_epoch(lambda: list(copy.deepcopy(sampler).batches(16)))
        for indices in sampler.batches(16):
            inputs, targets = loader.batch(indices)
            assert inputs.is_pinned() and targets.is_pinned()
            on_gpu = inputs.to("cuda", non_blocking=True)
            expected = source.batch(indices)
            assert torch.equal(on_gpu.cpu(), expected[0]) and torch.equal(targets, expected[1])
        assert loader.num_prefetched == 4
    finally:
        loader.close()
