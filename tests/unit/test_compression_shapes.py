"""Every compression scheme on the parameter server's codec path handles every parameter
shape: 0-d scalars, zero-size tensors, 1-d, 3-d and 4-d (convolution) tensors, many tiny
ones beside one huge one, cut into shards anywhere. A property test over shapes: the
worker's payload of each shard decodes on the server (`PushDecoder`, as a push is read)
to what the worker says it sent, so with error feedback the decoded gradient plus the
residual the worker keeps is the gradient, element for element; segments too small to
compress travel exactly; fp16 and bf16 are within their precision, quantization within
half a level of each slice's range."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from disttrain.compression import Compressor
from disttrain.compression.schemes import goes_dense
from disttrain.config import CompressionConfig
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.server.validation import PushDecoder
from disttrain.strategies.ps.wire.codec import Payload
from disttrain.strategies.ps.wire.payloads import GradientEncoder, shard_segments
from disttrain.strategies.ps.wire.sharding import plan_shards

torch.set_num_threads(1)

SCHEMES = ("quantization", "topk", "fp16", "bf16")
SHAPES = st.lists(st.one_of(
    st.just(()),  # 0-d
    st.tuples(st.integers(0, 50)),  # 1-d, zero-size included
    st.tuples(st.integers(1, 5), st.integers(0, 5), st.integers(1, 4)),  # 3-d, zero-size included
    st.tuples(st.integers(1, 8), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3)),  # 4-d conv
    st.tuples(st.integers(5_000, 50_000)),  # one large beside tiny ones
), min_size=1, max_size=12)


class Shapes(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(shape)) for shape in shapes])


def push_and_decode(scheme: str, ratio: float, shapes, num_shards: int, gradient: torch.Tensor):
    """The worker's encoder and the servers' decoders of a run: each shard's payload as a
    push carries it, read back by that shard's decoder. Returns (plans, encoder, decoded
    flat gradient)."""
    plans = plan_shards(Shapes(shapes), num_shards)
    encoder = GradientEncoder(Compressor(scheme, ratio=ratio, error_feedback=True), plans)
    section = CompressionConfig(enabled=True, type=scheme, ratio=ratio)
    shards = list(range(num_shards))
    encoded = encoder.encode(gradient, shards)
    decoded = torch.empty_like(gradient)
    for plan, payload in zip(plans, encoded, strict=True):
        decoder = PushDecoder(plan, section)
        header = pb.GradientMessage(worker_id="w0", step=1, shard=plan.shard, num_samples=1, compressed=True,
                                    compression_type=scheme)
        assert payload.nbytes == decoder.compressed_nbytes
        received = decoder.decode(Payload(header, None, [memoryview(payload.data)]))
        decoded[plan.offset:plan.offset + plan.numel] = torch.cat(list(received))
    encoder.commit(encoded, [pb.PushReply(outcome=pb.PushReply.APPLIED)] * num_shards)
    return plans, encoder, decoded


def residual_of(encoder: GradientEncoder, plans, numel: int) -> torch.Tensor:
    """The worker's residuals laid out as the flat gradient (zero where none is kept)."""
    flat = torch.zeros(numel)
    for plan in plans:
        offset = plan.offset
        for name, n in shard_segments(plan):
            if name in encoder.compressor.residuals:
                flat[offset:offset + n] = encoder.compressor.residuals[name]
            offset += n
    return flat


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(SCHEMES), st.sampled_from([0.01, 0.1, 0.5]), SHAPES, st.integers(1, 4),
       st.integers(0, 2 ** 31 - 1))
def test_every_scheme_decodes_any_shape_set_on_the_codec_path(scheme, ratio, shapes, num_shards, seed):
    total = sum(torch.zeros(shape).numel() for shape in shapes)
    if total < num_shards:
        return  # refused by the plan (tested with sharding)
    gradient = torch.randn(total, generator=torch.Generator().manual_seed(seed)) * 3
    plans, encoder, decoded = push_and_decode(scheme, ratio, shapes, num_shards, gradient)
    assert torch.isfinite(decoded).all()
    # what was not sent is kept: decoded + residual is the gradient (to float32 rounding)
    residual = residual_of(encoder, plans, total)
    torch.testing.assert_close(decoded + residual, gradient, rtol=0, atol=1e-5)
    for plan in plans:
        offset = plan.offset
        segments = shard_segments(plan)
        for name, n in segments:
            sent, want = decoded[offset:offset + n], gradient[offset:offset + n]
            if scheme != "topk" and goes_dense(scheme, n, 4, ratio):
                assert torch.equal(sent, want), name  # too small to compress: exact
            elif scheme in ("fp16", "bf16"):
                rtol = 2 ** -7 if scheme == "bf16" else 2 ** -10
                torch.testing.assert_close(sent, want, rtol=rtol, atol=1e-6)
            elif scheme == "quantization":
                step = float(want.max() - want.min()) / 255
                assert float((sent - want).abs().max()) <= 0.5 * step + 1e-5, name
            offset += n
    if scheme == "topk":  # k of each shard's payload, the largest, sent exactly
        for plan in plans:
            part = slice(plan.offset, plan.offset + plan.numel)
            kept = decoded[part].nonzero().flatten()
            assert torch.equal(decoded[part][kept], gradient[part][kept])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_huge_tensor_beside_a_scalar_and_a_conv_goes_through_every_scheme(scheme):
    shapes = [(), (16, 3, 3, 3), (3_000_000,), (7,)]
    total = 1 + 16 * 27 + 3_000_000 + 7
    gradient = torch.randn(total, generator=torch.Generator().manual_seed(1))
    plans, encoder, decoded = push_and_decode(scheme, 0.01, shapes, 3, gradient)
    assert all(len(plan.slices) >= 1 for plan in plans) and sum("params.2" in p.names for p in plans) == 3
    residual = residual_of(encoder, plans, total)
    torch.testing.assert_close(decoded + residual, gradient, rtol=0, atol=1e-5)
    if scheme == "quantization":  # the scalar goes dense: 8 bytes of range would not pay
        assert decoded[0] == gradient[0]
