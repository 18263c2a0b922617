"""DGC's training rules in the top-k compressor and the compact top-k payload: the rules
against a small reference computation written from the paper, the compact block's round
trip and its refusal of malformed bytes (generated), its bytes, the config's checks, and
a resumed compressor going on bit for bit."""

from __future__ import annotations

import math
import struct

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from disttrain.compression import Compressor, InvalidPayload, topk_count
from disttrain.compression.compact import decode_block, encode_block
from disttrain.compression.dgc import DgcRules
from disttrain.config import CompressionConfig
from disttrain.config.loading import ConfigError, config_from_dict

torch.set_num_threads(1)

SEGMENTS = [("conv.weight", 600), ("conv.bias", 4), ("fc.weight", 1200)]
NUMEL = sum(n for _, n in SEGMENTS)


def gradient(seed: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def reference(gradients: list[torch.Tensor], ratio: float, rules: DgcRules, half: bool) -> list[torch.Tensor]:
    """What each step sends, computed element by element from the paper's algorithm, over
    the whole flat gradient as one block (top-k's payload), with each tensor clipped alone."""
    u = torch.zeros(NUMEL, dtype=torch.float64)
    v = torch.zeros(NUMEL, dtype=torch.float64)
    sent = []
    for step, g in enumerate(gradients):
        g = g.double().clone()
        start = 0
        for _, n in SEGMENTS:
            norm = math.sqrt(sum(float(x) ** 2 for x in g[start:start + n]))
            if rules.clip_norm and norm > rules.clip_norm:
                g[start:start + n] *= rules.clip_norm / norm
            start += n
        u = rules.momentum * u + g if rules.momentum else g
        v = v + u
        share = ratio
        if step < rules.warmup_steps:
            share = rules.warmup_ratio * (ratio / rules.warmup_ratio) ** (step / rules.warmup_steps)
        k = math.ceil(NUMEL * share)
        kept = sorted(range(NUMEL), key=lambda i: -abs(float(v[i])))[:k]
        out = torch.zeros(NUMEL, dtype=torch.float64)
        for i in kept:
            out[i] = float(torch.tensor(float(v[i])).half()) if half else v[i]
        v = v - out
        if rules.momentum and rules.masking:
            u[kept] = 0.0
        sent.append(out)
    return sent


@pytest.mark.parametrize("rules, half", [
    (DgcRules(momentum=0.9), False),
    (DgcRules(momentum=0.9, masking=False, clip_norm=2.0), False),
    (DgcRules(momentum=0.5, clip_norm=5.0, warmup_steps=4, warmup_ratio=0.3), False),
    (DgcRules(momentum=0.9, warmup_steps=3), True),
])
def test_rules_match_the_reference_computation(rules, half):
    gradients = [gradient(seed) for seed in range(7)]
    compressor = Compressor("topk", 0.02, rules=rules, compact=half)
    expected = reference(gradients, 0.02, rules, half)
    for step, g in enumerate(gradients):
        encoded = compressor.encode(g, SEGMENTS)
        out = torch.empty(NUMEL)
        compressor.decode(encoded.data, SEGMENTS, out)
        compressor.commit(encoded)
        torch.testing.assert_close(out.double(), expected[step], rtol=1e-5, atol=1e-6, msg=f"step {step}")


def test_warmup_ramps_the_share_kept_exponentially():
    rules = DgcRules(warmup_steps=4, warmup_ratio=0.25)
    shares = [rules.ratio_at(step, 0.01) for step in range(6)]
    assert shares[0] == 0.25 and shares[4:] == [0.01, 0.01]
    assert all(a / b == pytest.approx(25 ** 0.25) for a, b in zip(shares[:4], shares[1:4], strict=False))
    compressor = Compressor("topk", 0.01, rules=rules)
    kept = []
    for step in range(6):
        encoded = compressor.encode(gradient(step), SEGMENTS)
        out = torch.empty(NUMEL)
        compressor.decode(encoded.data, SEGMENTS, out)
        compressor.commit(encoded)
        kept.append(int((out != 0).sum()))
    assert kept == [topk_count(NUMEL, share) for share in shares]


def test_a_refused_payload_leaves_velocity_and_warmup_as_they_were():
    compressor = Compressor("topk", 0.01, rules=DgcRules(momentum=0.9, warmup_steps=5))
    compressor.commit(compressor.encode(gradient(0), SEGMENTS))
    before = {name: value.clone() for name, value in compressor.velocities.items()}, dict(compressor.steps)
    compressor.encode(gradient(1), SEGMENTS)  # not committed: the server refused it
    assert dict(compressor.steps) == before[1]
    for name, value in before[0].items():
        assert torch.equal(compressor.velocities[name], value)


def test_a_resumed_compressor_goes_on_bit_for_bit():
    rules = DgcRules(momentum=0.9, clip_norm=3.0, warmup_steps=4)
    whole, first = (Compressor("topk", 0.01, rules=rules, compact=True) for _ in range(2))
    for step in range(3):
        whole.commit(whole.encode(gradient(step), SEGMENTS))
        first.commit(first.encode(gradient(step), SEGMENTS))
    resumed = Compressor("topk", 0.01, rules=rules, compact=True)
    resumed.load_state_dict(first.state_dict())
    for step in range(3, 7):
        a, b = whole.encode(gradient(step), SEGMENTS), resumed.encode(gradient(step), SEGMENTS)
        assert a.data == b.data, f"step {step}"
        whole.commit(a)
        resumed.commit(b)


def test_local_clipping_scales_by_the_workers():
    section = CompressionConfig(enabled=True, type="topk", local_clip_norm=4.0)
    assert DgcRules.of(section, 4).clip_norm == 2.0
    assert DgcRules.of(CompressionConfig(type="topk"), 4) is None  # no rule asked for


# -- the compact block ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), share=st.floats(0.0005, 1.0), seed=st.integers(0, 2 ** 16),
       half=st.booleans())
def test_compact_blocks_round_trip(n, share, seed, half):
    x = gradient(seed, n) * 10
    k = max(1, math.ceil(n * share))
    indices = torch.sort(torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]).values
    data, decoded, kept = encode_block(x, indices, half)
    assert len(data) < 4 * n or (kept is None and len(data) == 1 + 4 * n and n <= 4)
    out = torch.full((n,), float("nan"))
    assert decode_block(memoryview(data), 0, out, half, "x") == len(data)
    assert torch.equal(out, decoded)
    if kept is not None:
        assert set(kept.tolist()) <= set(indices.tolist())
        left = sorted(set(indices.tolist()) - set(kept.tolist()))
        if left:  # where all would not fit: the largest of them
            assert float(x[kept].abs().min()) >= float(x[left].abs().max())
        expected = torch.zeros(n)
        expected[kept] = x[kept].half().float() if half else x[kept]
        assert torch.equal(out, expected)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2 ** 16), cut=st.integers(0, 10 ** 6), flips=st.lists(
    st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)), max_size=4))
def test_compact_decode_refuses_malformed_bytes_or_stays_in_bounds(seed, cut, flips):
    """Any truncation or corruption either raises InvalidPayload or decodes into finite
    values inside the block: never another exception, never a write outside."""
    compressor = Compressor("topk", 0.05, compact=True)
    encoded = compressor.encode(gradient(seed), SEGMENTS)
    data = bytearray(encoded.data[:cut % (len(encoded.data) + 1)])
    for position, value in flips:
        if data:
            data[position % len(data)] = value
    out = torch.empty(NUMEL)
    try:
        compressor.decode(bytes(data), SEGMENTS, out)
    except InvalidPayload:
        return
    assert bool(torch.isfinite(out).all())


def sparse_block(count: int, gaps: bytes, values: list[float]) -> bytes:
    return struct.pack("<BII", 1, count, len(gaps)) + gaps + struct.pack(f"<{len(values)}e", *values)


@pytest.mark.parametrize("data, reason", [
    (b"", "before the block's kind"),
    (b"\x07", "neither dense"),
    (sparse_block(0, b"", []), "count 0"),
    (sparse_block(11, bytes(11), [1.0] * 11), "outside [1, 10]"),
    (sparse_block(2, b"\x01\x80", [1.0, 2.0]), "inside a varint"),
    (sparse_block(2, b"\x01", [1.0, 2.0]), "cannot hold"),
    (sparse_block(2, b"\x01\x02\x03", [1.0, 2.0]), "3 varints, expected 2"),
    (sparse_block(1, b"\x0a", [1.0]), "gap of 10"),
    (sparse_block(2, b"\x05\x05", [1.0, 2.0]), "reach 11"),
    (sparse_block(1, b"\x80\x80\x80\x80\x80\x00", [1.0]), "cannot hold"),
    (sparse_block(2, b"\x00\x00", [1.0, float("inf")]), "NaN or infinite"),
    (sparse_block(2, b"\x00\x00", [1.0]), "needs"),
    (b"\x00" + struct.pack("<10f", *[1.0] * 9, float("nan")), "NaN or infinite"),
])
def test_compact_decode_names_what_is_wrong(data, reason):
    with pytest.raises(InvalidPayload, match=reason.replace("[", r"\[").replace("]", r"\]")):
        decode_block(memoryview(data), 0, torch.empty(10), True, "x")


def test_compact_payload_rejects_trailing_bytes_unless_padded():
    compressor = Compressor("topk", 0.05, compact=True)
    encoded = compressor.encode(gradient(0), SEGMENTS)
    out = torch.empty(NUMEL)
    with pytest.raises(InvalidPayload, match="its blocks end at byte"):
        compressor.decode(encoded.data + b"\x00", SEGMENTS, out)
    compressor.decode(encoded.data + bytes(7), SEGMENTS, out, padded=True)  # as read from shared memory
    assert int((out != 0).sum()) == topk_count(NUMEL, 0.05)


def test_compact_payload_bytes():
    """Bytes measured: at ratio 0.01 of 1M elements the compact block takes well under half
    of the fixed one (int32 indices and fp32 values: 8 bytes an element kept)."""
    n = 1_000_000
    x = gradient(1, n)
    fixed = Compressor("topk", 0.01).encode(x, [("w", n)]).nbytes
    compact = Compressor("topk", 0.01, compact=True).encode(x, [("w", n)]).nbytes
    k = topk_count(n, 0.01)
    assert fixed == 4 + 8 * k
    assert compact < 0.45 * fixed  # 2 bytes of fp16 and 1-2 bytes of gap per element kept
    assert 4 * n / compact > 100  # against dense float32 (measured: 122x, 3.3 bytes an element kept)


# -- config ---------------------------------------------------------------------------------


def test_momentum_correction_refuses_a_second_momentum():
    with pytest.raises(ConfigError, match="training.optimizer: sgd and training.momentum: 0"):
        config_from_dict({"compression": {"enabled": True, "type": "topk", "momentum_correction": 0.9},
                      "training": {"optimizer": "sgd", "momentum": 0.9}})
    config = config_from_dict({"compression": {"enabled": True, "type": "topk", "momentum_correction": 0.9},
                           "training": {"optimizer": "sgd", "momentum": 0.0}})
    assert Compressor.from_config(config.compression, 0).rules == DgcRules(momentum=0.9)


def test_dgc_keys_are_checked():
    with pytest.raises(ConfigError, match="error_feedback"):
        config_from_dict({"compression": {"enabled": True, "type": "topk", "momentum_correction": 0.9,
                                      "error_feedback": False},
                      "training": {"optimizer": "sgd", "momentum": 0.0}})
    with pytest.raises(ConfigError, match="warmup_ratio"):
        config_from_dict({"compression": {"enabled": True, "type": "topk", "ratio": 0.5, "warmup_steps": 3}})
