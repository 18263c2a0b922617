"""The DDP compression hooks on buckets in host memory on a machine that has a GPU: DDP
over gloo on the CPU of a GPU machine, or the CPU rank of a mixed group.

PyTorch's `powerSGD_hook` synchronizes CUDA whenever `torch.cuda.is_available()`, whatever
device the bucket is on, and `torch.cuda.synchronize(cpu device)` raises "Expected a cuda
device, but got: cpu": the project's first run on a GPU machine failed so (gloo on the
CPU beside an NCCL run). `torch.cuda.synchronize` raises before it touches any GPU (on a
CPU-only build of torch: "Torch not compiled with CUDA enabled"), so a machine without one
reproduces it by making `torch.cuda.is_available()` answer True for a real one-rank gloo
DDP run. Every scheme runs so, and must give the same
gradients, bit for bit, as the same run where CUDA is not available.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from disttrain.compression.ddp_hooks import build_ddp_hook, run_hook
from disttrain.config import CompressionConfig
from disttrain.strategies.ddp.comm_hooks import CommStats, register_comm_hook

pytestmark = pytest.mark.timeout(120)

STEPS = 4  # PowerSGD all-reduces plainly at steps 1-2, then compresses


@pytest.fixture(scope="module")
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def train(scheme: str, bucket_cap_mb: float) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each step's gradients and the hook's final state, on fixed batches."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    model = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    section = CompressionConfig(enabled=True, type=scheme, ratio=0.1, powersgd_rank=1, error_feedback=True)
    hook = build_ddp_hook(section, module.named_parameters(), seed=3, rank_seed=3)
    register_comm_hook(model, CommStats(), run_hook, hook)
    generator = torch.Generator().manual_seed(1)
    gradients = []
    for _ in range(STEPS):
        inputs = torch.randn(16, 32, generator=generator)
        targets = torch.randint(0, 10, (16,), generator=generator)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        gradients.append(torch.cat([p.grad.reshape(-1) for p in module.parameters()]))
    return gradients, hook.state_dict()


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.001], ids=["one_bucket", "several_buckets"])
@pytest.mark.parametrize("scheme", ["powersgd", "quantization", "topk", "fp16", "bf16"])
def test_a_hook_on_host_buckets_runs_where_cuda_is_available(one_rank_group, monkeypatch, scheme,
                                                              bucket_cap_mb):
    expected, expected_state = train(scheme, bucket_cap_mb)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gradients, state = train(scheme, bucket_cap_mb)
    monkeypatch.undo()
    for step, (got, want) in enumerate(zip(gradients, expected, strict=True)):
        assert torch.equal(got, want), f"step {step + 1}"
    assert state.keys() == expected_state.keys()
    for name, value in state.items():
        if not name.endswith("totals"):  # the totals hold seconds
            assert torch.equal(value, expected_state[name]), name
    if scheme == "powersgd":  # it did compress (steps 3 and 4), with error feedback left
        assert state["powersgd/iter"][0] == STEPS
        errors = [value for name, value in state.items() if name.startswith("powersgd/error/")]
        assert errors and any(value.abs().sum() > 0 for value in errors)
