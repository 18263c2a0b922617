"""Which collective carries a compressed DDP gradient: the one rule that the DDP hooks
(`compression.ddp_collective: auto`) and `advise` share.

A payload that cannot be summed (int8 with its own scales, top-k's own indices) has three
ways to reach every rank, each with the bytes one rank receives per exchange of a bucket
of `dense` bytes whose payload is `payload` bytes, at `n` ranks:

- `gather`: every rank receives every other rank's payload: `(n - 1) * payload`.
- `two_phase` (int8 only, `two_phase`): chunks all-to-all, each averaged by its owner,
  the means all-gathered: `2 * (n - 1) / n * payload`, flat in n.
- `dense`: each rank decodes its own payload and the dense tensors are all-reduced (a
  ring): `2 * (n - 1) / n * dense`. The error feedback and the average are the payloads',
  only the transport is dense: what top-k pays once `(n - 1) * k` outgrows the tensor.

`cheapest` picks the fewest bytes; a tie goes to the one with fewer phases (gather, then
two-phase), since each phase pays the link's latency once more.
"""

from __future__ import annotations

GATHER, TWO_PHASE, DENSE = "gather", "two_phase", "dense"
COLLECTIVES = (GATHER, TWO_PHASE, DENSE)


def received_bytes(collective: str, n: int, payload: float, dense: float) -> float:
    """Bytes one of `n` ranks receives (and as many it sends) to combine one bucket.

    Raises:
        ValueError: an unknown collective, or fewer than one rank.
    """
    if n < 1:
        raise ValueError(f"a collective needs at least one rank, not {n}")
    if collective == GATHER:
        return (n - 1) * payload
    if collective == TWO_PHASE:
        return 2 * (n - 1) / n * payload
    if collective == DENSE:
        return 2 * (n - 1) / n * dense
    raise ValueError(f"unknown collective {collective!r}; one of {', '.join(COLLECTIVES)}")


def cheapest(n: int, payload: float, dense: float, two_phase: bool) -> str:
    """The collective that moves the fewest bytes at `n` ranks (`two_phase`: whether the
    payload can take the two-phase path: int8 rounded to nearest)."""
    options = [GATHER, TWO_PHASE, DENSE] if two_phase else [GATHER, DENSE]
    return min(options, key=lambda c: (received_bytes(c, n, payload, dense), options.index(c)))
