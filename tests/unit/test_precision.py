"""Mixed precision, one plan for every strategy: bf16 autocast on the CPU as well as on
CUDA, fp16 with loss scaling on CUDA only and never under the parameter server, and the
forward/backward it changes (a float32 loss, float32 gradients). GPU paths skip without CUDA."""

from __future__ import annotations

import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.core.errors import ConfigError
from disttrain.training.engine import build_optimizer, forward_backward
from disttrain.training.models import build_model
from disttrain.training.precision import Precision, plan_precision
from disttrain.training.stepping import OptimizerStep

pytestmark = pytest.mark.timeout(60)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_plans():
    assert not plan_precision("none", "cpu").enabled
    cpu = plan_precision("bf16", "cpu")
    assert cpu.autocast_dtype == torch.bfloat16 and not cpu.use_grad_scaler
    fp16 = plan_precision("fp16", "cuda")
    assert fp16.autocast_dtype == torch.float16 and fp16.use_grad_scaler
    assert plan_precision("bf16", "cpu", loss_scaling=False).enabled  # a PS worker's bf16


@pytest.mark.parametrize("args, fragment", [
    (("fp16", "cpu"), "fp16 runs on CUDA GPUs only"),
    (("fp16", "cuda", True, False), "fp16 needs loss scaling"),
    (("bf16", "cuda", False), "use fp16"),
    (("int8", "cpu"), "unknown mode 'int8'"),
])
def test_refusals_name_the_key(args, fragment):
    with pytest.raises(ConfigError, match=f"training.precision: .*{fragment}"):
        plan_precision(*args)


def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 1, 28, 28, generator=generator), torch.randint(0, 10, (16,), generator=generator)


def gradients_of(model, precision):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # the same dropout masks in every call
    result = forward_backward(model, *batch(), loss_scale=0.5, precision=precision)
    return result, [p.grad.clone() for p in model.parameters()]


def test_bf16_on_the_cpu_computes_the_forward_pass_in_bf16_and_keeps_float32_gradients():
    torch.manual_seed(0)
    model = build_model("simplecnn", (1, 28, 28), 10)
    full, full_grads = gradients_of(model, None)
    same, same_grads = gradients_of(model, Precision(plan_precision("none", "cpu")))
    assert same == full and all(torch.equal(a, b) for a, b in zip(same_grads, full_grads, strict=True))

    seen = []
    hook = model.fc1.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    half, half_grads = gradients_of(model, Precision(plan_precision("bf16", "cpu")))
    hook.remove()
    assert seen == [torch.bfloat16]  # autocast ran the layer in bf16 ...
    assert all(g.dtype == torch.float32 for g in half_grads)  # ... the gradients stay float32
    assert half.loss == pytest.approx(full.loss, rel=0.02) and half.loss != full.loss
    for a, b in zip(half_grads, full_grads, strict=True):  # the same direction, to bf16's 3 digits
        assert torch.nn.functional.cosine_similarity(a.reshape(-1), b.reshape(-1), dim=0) > 0.98


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_mixed_precision_step_on_gpu(mode):
    device = torch.device("cuda", 0)
    precision = Precision(plan_precision(mode, "cuda", torch.cuda.is_bf16_supported()), device)
    torch.manual_seed(0)
    model = build_model("simplecnn", (1, 28, 28), 10).to(device)
    training = config_from_dict({"training": {"optimizer": "sgd", "learning_rate": 0.01,
                                              "clip_grad_norm": 1.0}}).training
    stepper = OptimizerStep(build_optimizer(model.parameters(), training), training, precision.scaler)
    before = [p.detach().clone() for p in model.parameters()]
    inputs = torch.randn(8, 1, 28, 28, device=device)
    result = forward_backward(model, inputs, torch.randint(0, 10, (8,), device=device), precision=precision)
    stepper.step()
    assert torch.isfinite(torch.tensor(result.loss))
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert ("scale" in precision.state_dict()) == (mode == "fp16")
    assert stepper.last_grad_norm is not None and stepper.last_grad_norm < 1e4  # clipped after unscaling
