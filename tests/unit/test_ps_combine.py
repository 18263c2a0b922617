"""The server's weighted gradient sum: exact against the plain formula, whatever the
chunk boundaries of each gradient (one piece from shared memory, 1 MB pieces off the wire)."""

import pytest
import torch

from disttrain.strategies.ps.server.aggregation import Contribution
from disttrain.strategies.ps.server.update import combine


@pytest.mark.parametrize("weights", [[1.0], [0.25, 0.75], [0.2, 0.3, 0.5], [0.5, 0.25]])
def test_weighted_sum_over_misaligned_chunks(weights):
    torch.manual_seed(0)
    gradients = [torch.randn(1000) for _ in weights]
    splits = [1000, 300, 128]
    contributions = [Contribution(rank, w, list(g.split(splits[rank % 3])))
                     for rank, (w, g) in enumerate(zip(weights, gradients, strict=True))]
    expected = sum(w * g for w, g in zip(weights, gradients, strict=True))
    out = torch.full((1000,), float("nan"))
    torch.testing.assert_close(combine(contributions, out), expected, rtol=0, atol=1e-6)


def test_one_whole_unweighted_gradient_is_used_without_a_copy():
    gradient = torch.randn(10)
    assert combine([Contribution(0, 1.0, [gradient])], torch.empty(10)) is gradient
