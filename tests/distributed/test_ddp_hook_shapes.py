"""Every DDP compression hook handles every parameter shape: 0-d scalars, zero-size
tensors, 1-d, 3-d and 4-d (convolution) tensors, a large one beside tiny ones, in one
bucket or cut into many. A property test over shapes, inside real DDP on a one-rank gloo
group in this process: each step's gradient reaches every parameter with its shape and
finite values, and what a scheme leaves out is kept: with error feedback, the gradients
of T steps plus the residual left equal T times the true gradient (the average of one
rank is its own); fp16 and bf16 are within their precision.

PowerSGD views each gradient as a matrix `(shape[0], -1)`; a 0-d or zero-size one could
not be (they raised inside PyTorch's hook): `MatrixBucket` gives the hook views it can take.
A bucket of zero-size gradients alone compresses to an empty payload, which the gathering
hooks now send as an empty tensor.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from disttrain.compression.ddp_hooks import build_ddp_hook, run_hook
from disttrain.config import CompressionConfig
from disttrain.strategies.ddp.comm_hooks import CommStats, register_comm_hook

pytestmark = pytest.mark.timeout(300)

STEPS = 3  # PowerSGD all-reduces plainly at steps 1-2, then compresses
SHAPES = st.lists(st.one_of(
    st.just(()),  # 0-d
    st.tuples(st.integers(0, 40)),  # 1-d, zero-size included
    st.tuples(st.integers(0, 5), st.integers(1, 5), st.integers(1, 4)),  # 3-d, zero-size included
    st.tuples(st.integers(1, 8), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3)),  # 4-d conv
    st.tuples(st.integers(20, 60), st.integers(20, 60)),  # a matrix PowerSGD compresses
    st.tuples(st.integers(5_000, 40_000)),  # a large one beside tiny ones
), min_size=1, max_size=8)


@pytest.fixture(scope="module")
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Shapes(nn.Module):
    """Parameters of the given shapes; the loss is linear in them, so every step's true
    gradient is the same fixed tensor (`coefficients`)."""

    def __init__(self, shapes, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.params = nn.ParameterList([nn.Parameter(torch.zeros(shape)) for shape in shapes])
        self.coefficients = [torch.randn(shape, generator=generator) for shape in shapes]

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip(self.params, self.coefficients, strict=True)) * scale


def residuals(hook, scheme: str) -> dict[str, torch.Tensor]:
    """What the hook kept back, by parameter name (absent: nothing kept)."""
    state = hook.state_dict()
    prefix = f"{scheme}/error/" if scheme == "powersgd" else f"{scheme}/residual/"
    return {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["quantization", "topk", "fp16", "bf16", "powersgd"]), SHAPES,
       st.sampled_from([25.0, 0.001]), st.integers(0, 1000))
@example("powersgd", [()], 25.0, 0)  # a scalar: PyTorch's hook has no shape[0] to view it by
@example("powersgd", [(0, 3), (5,)], 25.0, 0)  # zero-size: no unique -1 in (0, -1)
@example("quantization", [(0,)], 25.0, 0)  # a bucket of zero-size gradients: an empty payload
@example("topk", [(0,), (0, 2, 2)], 0.001, 0)
def test_every_hook_takes_any_shape_set(one_rank_group, scheme, shapes, bucket_cap_mb, seed):
    module = Shapes(shapes, seed)
    model = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    section = CompressionConfig(enabled=True, type=scheme, ratio=0.1, powersgd_rank=1, error_feedback=True)
    hook = build_ddp_hook(section, module.named_parameters(), seed=3, rank_seed=3)
    register_comm_hook(model, CommStats(), run_hook, hook)
    sums = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        model(torch.tensor(1.0)).backward()
        for total, p in zip(sums, module.params, strict=True):
            assert p.grad is not None and p.grad.shape == p.shape and torch.isfinite(p.grad).all()
            total += p.grad.double()
    kept = residuals(hook, scheme)
    for (name, p), total, true in zip(module.named_parameters(), sums, module.coefficients, strict=True):
        if scheme in ("fp16", "bf16"):  # no error feedback: each step within the type's precision
            rtol = 2 ** -7 if scheme == "bf16" else 2 ** -10
            torch.testing.assert_close(p.grad, true, rtol=rtol, atol=1e-6)
            continue
        residual = kept.get(name, torch.zeros(p.numel())).double().view(p.shape)
        torch.testing.assert_close(total + residual, STEPS * true.double(), rtol=0, atol=1e-4, msg=name)
