"""The weighted sum of pushed gradients that a shard applies: one pass per gradient."""

from __future__ import annotations

import torch

from disttrain.strategies.ps.server.aggregation import Contribution


def combine(contributions: list[Contribution], out: torch.Tensor) -> torch.Tensor:
    """The weighted sum of gradients (each a list of 1-D chunks), in rank order, so the
    result does not depend on the order they arrived in.

    A single unweighted gradient in one chunk is used as it is; otherwise `out` receives
    the running weighted mean: one `lerp` pass per gradient after the first two (a pass
    reads two streams and writes one, where multiply-then-add needs one pass more).
    """
    first = contributions[0]
    if len(contributions) == 1 and first.weight == 1.0 and len(first.payload) == 1:
        return first.payload[0]
    weights = [c.weight for c in contributions]
    for start, end, pieces in _aligned([c.payload for c in contributions]):
        target = out[start:end]
        if len(pieces) == 1:
            torch.mul(pieces[0], weights[0], out=target)
            continue
        seen = weights[0] + weights[1]
        torch.lerp(pieces[0], pieces[1], weights[1] / seen, out=target)
        for weight, piece in zip(weights[2:], pieces[2:], strict=True):
            seen += weight
            target.lerp_(piece, weight / seen)
        if abs(seen - 1.0) > 1e-9:  # the rules normalise the weights; this is for callers that don't
            target.mul_(seen)
    return out


def _aligned(payloads: list[list[torch.Tensor]]):
    """Walk several chunked 1-D tensors of one length together: yield (start, end, views)
    for each range inside one chunk of every payload (chunk boundaries may differ, e.g.
    one gradient in one piece from shared memory, another in 1 MB pieces from the wire)."""
    bounds = sorted({0} | {end for chunks in payloads for end in _chunk_ends(chunks)})
    cursors = [[0, 0] for _ in payloads]  # (chunk index, chunk start) per payload
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        views = []
        for chunks, cursor in zip(payloads, cursors, strict=True):
            while start >= cursor[1] + chunks[cursor[0]].numel():
                cursor[1] += chunks[cursor[0]].numel()
                cursor[0] += 1
            offset = start - cursor[1]
            views.append(chunks[cursor[0]][offset:offset + end - start])
        yield start, end, views


def _chunk_ends(chunks: list[torch.Tensor]) -> list[int]:
    ends, total = [], 0
    for chunk in chunks:
        total += chunk.numel()
        ends.append(total)
    return ends
