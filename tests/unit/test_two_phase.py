"""The arithmetic of the two-phase int8 all-reduce (`compression.two_phase`): chunks padded
to a multiple of the ranks, each quantized within half a level of its own scale, the
owner's mean added in rank order, and bytes per rank that stay flat as ranks are added
while the all-gather's grow with them."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.compression import two_phase


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 9), st.integers(0, 2**16))
def test_every_chunk_is_within_half_a_level_of_its_own_scale(numel, world_size, seed):
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * (1 + seed % 7)
    codes, scales = two_phase.quantize_chunks(flat, world_size)
    size = two_phase.chunk_size(numel, world_size)
    assert codes.shape == (world_size, size) and codes.dtype == torch.int8 and scales.shape == (world_size,)
    back = two_phase.dequantize_rows(codes, scales).reshape(-1)
    assert (back[numel:] == 0).all()  # the padding
    error = (back[:numel] - flat).abs().view(-1)
    bound = torch.repeat_interleave(scales, size)[:numel] / 2 + 1e-6
    assert (error <= bound).all()


def test_a_chunk_of_zeros_keeps_a_scale_of_one_and_decodes_to_zeros():
    codes, scales = two_phase.quantize_rows(torch.zeros(2, 3))
    assert scales.tolist() == [1.0, 1.0] and (two_phase.dequantize_rows(codes, scales) == 0).all()


def test_the_owner_averages_what_each_rank_sent():
    codes = torch.tensor([[127, -127, 0], [127, 127, 64]], dtype=torch.int8)
    scales = torch.tensor([0.5, 1.0])
    assert two_phase.mean_of_chunks(codes, scales).tolist() == [(63.5 + 127) / 2, (-63.5 + 127) / 2, 32.0]


def test_bytes_per_rank_stay_flat_while_an_all_gathers_grow():
    numel = 1_000_000
    two = [two_phase.received_bytes(numel, n) for n in (2, 4, 8, 64)]
    gathered = [(n - 1) * numel for n in (2, 4, 8, 64)]  # every other rank's int8 payload
    assert two == sorted(two) and two[-1] < 2 * two[0]  # 2P(n-1)/n: from P at 2 ranks to under 2P
    assert two[0] == gathered[0] + 8  # equal at two ranks, but the scales
    assert gathered[-1] / two[-1] > 30


def test_the_two_phase_collective_with_stochastic_rounding_is_refused_in_one_line():
    import pytest

    from disttrain.config import config_from_dict
    from disttrain.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"compression\.stochastic_rounding: the two-phase collective "
                                          r"\(compression\.ddp_collective: two_phase\) rounds to nearest"):
        config_from_dict({"compression": {"enabled": True, "ddp_collective": "two_phase",
                                          "stochastic_rounding": True}})
