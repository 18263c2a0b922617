"""Each compressor on its own: round-trip bounds, top-k's choice, error feedback,
unbiased stochastic rounding, edge tensors, dense fallback, state round trips, and the
decoder's refusal of malformed payloads."""

from __future__ import annotations

import math
import struct
import warnings

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from disttrain.compression import Compressor, InvalidPayload, topk_count
from disttrain.compression.schemes import all_finite

torch.set_num_threads(1)

SEGMENTS = [("conv.weight", 600), ("conv.bias", 4), ("fc.weight", 1200)]
NUMEL = sum(n for _, n in SEGMENTS)


def gradient(seed: int = 0, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def round_trip(compressor: Compressor, flat: torch.Tensor, segments=SEGMENTS) -> torch.Tensor:
    encoded = compressor.encode(flat, segments)
    out = torch.empty_like(flat)
    compressor.decode(encoded.data, segments, out)
    compressor.commit(encoded)
    return out


def segment_views(flat: torch.Tensor, segments=SEGMENTS):
    start = 0
    for name, n in segments:
        yield name, flat[start:start + n]
        start += n


finite_floats = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite_floats, min_size=1, max_size=300), st.booleans())
def test_quantization_error_is_within_half_a_step(values, stochastic):
    flat = torch.tensor(values, dtype=torch.float32)
    compressor = Compressor("quantization", error_feedback=False, rounding_seed=1 if stochastic else None)
    out = round_trip(compressor, flat, [("t", flat.numel())])
    if flat.numel() <= 2:  # too small to pay: sent dense, exactly
        assert torch.equal(out, flat)
        return
    step = (flat.max() - flat.min()).item() / 255
    bound = (1.0 if stochastic else 0.5) * step + 1e-6 * max(1.0, flat.abs().max().item())
    assert (out - flat).abs().max().item() <= bound


@pytest.mark.parametrize("scheme", ["quantization", "topk", "fp16", "bf16"])
@pytest.mark.parametrize("fill", [0.0, 3.25, -7.5])
def test_constant_and_zero_tensors_round_trip(scheme, fill):
    flat = torch.full((NUMEL,), fill)
    out = round_trip(Compressor(scheme, ratio=0.01, error_feedback=False), flat)
    assert torch.isfinite(out).all()
    if scheme == "topk":  # the k kept elements are exact, the others zero
        assert int((out == fill).sum()) >= topk_count(NUMEL, 0.01)
    else:
        assert torch.equal(out, flat)


@pytest.mark.parametrize("ratio", [0.01, 0.07, 0.3])
def test_topk_keeps_exactly_the_k_largest_of_the_whole_payload(ratio):
    flat = gradient(3)
    flat[:600] *= 10  # one tensor's gradients are larger: it gets more of the k
    out = round_trip(Compressor("topk", ratio=ratio, error_feedback=False), flat)
    k = topk_count(NUMEL, ratio)
    kept = out.nonzero().flatten()
    assert kept.numel() == k
    assert set(kept.tolist()) == set(flat.abs().topk(k).indices.tolist())
    assert torch.equal(out[kept], flat[kept])
    assert int((kept < 600).sum()) > k * 600 / NUMEL


def test_a_single_tiny_tensor_goes_dense():
    out = round_trip(Compressor("topk", ratio=0.5, error_feedback=False), gradient(1, 5), [("bias", 5)])
    assert torch.equal(out, gradient(1, 5))


def test_topk_count_uses_the_decimal_ratio():
    assert topk_count(100, 0.07) == 7 and topk_count(100, 0.01) == 1
    assert topk_count(5, 0.01) == 1 and topk_count(1_000_000, 0.001) == 1000


def test_error_feedback_sends_everything_over_many_steps():
    compressor = Compressor("topk", ratio=0.05)
    true_sum, sent_sum = torch.zeros(NUMEL), torch.zeros(NUMEL)
    for step in range(400):
        flat = gradient(step)
        true_sum += flat
        sent_sum += round_trip(compressor, flat)
    # What is still unsent is the residual, bounded, while the sums grow with the steps.
    residual = torch.cat([compressor.residuals[name] for name, _ in SEGMENTS if name in compressor.residuals])
    assert torch.allclose(true_sum - sent_sum, torch.cat(
        [compressor.residuals.get(name, torch.zeros(n)) for name, n in SEGMENTS]), atol=1e-3)
    assert (true_sum - sent_sum).norm() / true_sum.norm() < 0.25
    without = Compressor("topk", ratio=0.05, error_feedback=False)
    dropped = sum((gradient(s) - round_trip(without, gradient(s))) for s in range(400))
    assert (true_sum - sent_sum).norm() < dropped.norm() / 5
    assert residual.numel() > 0


def test_stochastic_rounding_is_unbiased():
    values = torch.linspace(-1.0, 1.0, 257)[1:-1] + 0.0013  # levels fall between the steps
    flat = torch.cat([torch.tensor([-1.0, 1.0]), values])  # fixed min and max: fixed grid
    compressor = Compressor("quantization", error_feedback=False, rounding_seed=7)
    trials = 4000
    total = sum(round_trip(compressor, flat, [("t", flat.numel())]) for _ in range(trials))
    mean = total / trials
    step = 2.0 / 255
    # Each value's mean error shrinks like step / sqrt(trials); 5 sigma over all of them.
    assert (mean - flat).abs().max().item() < 5 * step / 2 / math.sqrt(trials)
    nearest = round_trip(Compressor("quantization", error_feedback=False), flat, [("t", flat.numel())])
    assert (nearest - flat).abs().mean() > 10 * (mean - flat).abs().mean()


def test_a_payload_is_never_larger_than_dense():
    tiny = [("bias", 2), ("scale", 1), ("w", 40)]
    flat = gradient(1, 43)
    for scheme, ratio in [("quantization", 1.0), ("topk", 0.9), ("topk", 1.0), ("fp16", 1.0)]:
        compressor = Compressor(scheme, ratio=ratio)
        encoded = compressor.encode(flat, tiny)
        assert encoded.nbytes <= encoded.dense_bytes
        compressor.commit(encoded)
        assert compressor.counters.dense_segments == (0 if scheme == "fp16" else encoded.dense_segments)
        assert scheme == "fp16" or encoded.dense_segments >= 1


@pytest.mark.parametrize("scheme", ["quantization", "topk"])
def test_state_survives_a_checkpoint_round_trip(scheme, tmp_path):
    first = Compressor(scheme, ratio=0.05, rounding_seed=3)
    for step in range(5):
        round_trip(first, gradient(step))
    torch.save(first.state_dict(), tmp_path / "state.pt")
    second = Compressor(scheme, ratio=0.05, rounding_seed=3)  # a resumed run's
    second.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    for step in range(5, 9):
        assert torch.equal(round_trip(first, gradient(step)), round_trip(second, gradient(step)))
    assert first.counters == second.counters
    with pytest.raises(ValueError, match="resume with compression.type=topk"):
        Compressor("quantization").load_state_dict(Compressor("topk").state_dict())


def test_rounding_noise_does_not_depend_on_the_order_tensors_are_encoded_in():
    first = Compressor("quantization", rounding_seed=5)
    second = Compressor("quantization", rounding_seed=5)
    flat = gradient(4)
    reordered = torch.cat([flat[600:1800], flat[:600]])  # the last tensor first
    by_name = [("a", 600), ("b", 1200)]
    for _ in range(3):
        one = round_trip(first, flat[:1800], by_name)
        other = round_trip(second, reordered, [("b", 1200), ("a", 600)])
        assert torch.equal(one, torch.cat([other[1200:], other[:1200]]))
    third = Compressor("quantization", rounding_seed=6)
    assert not torch.equal(round_trip(third, flat[:1800], by_name), one)


def test_an_uncommitted_payload_leaves_the_residual_alone():
    compressor = Compressor("topk", ratio=0.05)
    round_trip(compressor, gradient(0))
    before = {k: v.clone() for k, v in compressor.residuals.items()}
    compressor.encode(gradient(1), SEGMENTS)  # refused by a server: never committed
    assert all(torch.equal(before[k], compressor.residuals[k]) for k in before)


# -- malformed payloads ----------------------------------------------------------------------

def topk_payload(indices, values, count=None) -> bytes:
    count = len(indices) if count is None else count
    return (struct.pack("<I", count) + torch.tensor(indices, dtype=torch.int32).numpy().tobytes()
            + torch.tensor(values, dtype=torch.float32).numpy().tobytes())


@pytest.mark.parametrize(("payload", "message"), [
    (topk_payload([1, 2, 100], [1.0, 2.0, 3.0]), "outside \\[0, 100\\)"),
    (topk_payload([-1, 2, 3], [1.0, 2.0, 3.0]), "outside"),
    (topk_payload([5, 2, 3], [1.0, 2.0, 3.0]), "strictly ascending"),
    (topk_payload([2, 2, 3], [1.0, 2.0, 3.0]), "strictly ascending"),
    (topk_payload([1, 2, 3], [1.0, 2.0, 3.0], count=4), "count is 4, expected 3"),
    (topk_payload([1, 2, 3], [1.0, float("nan"), 3.0]), "NaN or infinite"),
    (topk_payload([1, 2, 3], [1.0, 2.0, 3.0])[:-1], "bytes, expected"),
    (topk_payload([1, 2, 3], [1.0, 2.0, 3.0]) + b"\0", "bytes, expected"),
], ids=["index-too-large", "negative-index", "unsorted", "duplicate", "count", "nan-value",
        "short", "long"])
def test_malformed_topk_payloads_are_refused(payload, message):
    with pytest.raises(InvalidPayload, match=message):
        Compressor("topk", ratio=0.03).decode(payload, [("w", 100)], torch.empty(100))


@pytest.mark.parametrize(("low", "scale", "message"), [
    (0.0, float("nan"), "must be finite"), (float("inf"), 0.1, "must be finite"),
    (0.0, -1.0, "scale >= 0"), (-1e38, 1e37, "overflow")])
def test_malformed_quantization_headers_are_refused(low, scale, message):
    payload = struct.pack("<ff", low, scale) + bytes(100)
    with pytest.raises(InvalidPayload, match=message):
        Compressor("quantization").decode(payload, [("w", 100)], torch.empty(100))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([torch.float32, torch.float64, torch.float16]),
       st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                          st.sampled_from([3e38, -3e38, 1.7e308, 6e4, 1e20])), max_size=40),
       st.sampled_from([(-1,), (2, -1), "strided"]))
def test_all_finite_answers_as_isfinite_does(dtype, values, shape):
    """The dot product's shortcut never changes the answer: huge finite values whose
    squares overflow, NaN, infinities, every float dtype, matrices and strided views."""
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)  # out of range: inf in float16/32
    if shape == "strided":
        tensor = tensor[::2]
    elif len(values) % 2 == 0 and values:
        tensor = tensor.reshape(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # squares that overflow are no warning to the user
        assert all_finite(tensor) == bool(torch.isfinite(tensor).all())


def test_all_finite():
    assert all_finite(torch.ones(10))
    assert not all_finite(torch.tensor([1.0, float("nan")]))
    assert not all_finite(torch.tensor([float("-inf")], dtype=torch.float16))
    assert not all_finite(torch.tensor([float("inf")], dtype=torch.bfloat16))
    assert all_finite(torch.tensor([3], dtype=torch.int64))
