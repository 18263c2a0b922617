"""The epoch a parameter-server run stopped in, re-split for another number of workers
from wherever each worker stood (`run.resize`): pure, on sampler states.

The N old workers stopped in one epoch, worker `r` `p_r` samples into its shard (the same
`p` for all in sync mode; async and SSP workers may stand apart). What they handed out is
applied (the shards' ledgers say so, block by block); the rest of every shard is owed.
The M new workers each get a shard that starts with a whole number of their batches of
the samples handed out (`q_j` batches, spread as evenly as they go: the counts differ by
one at most) and goes on with their share of the owed samples, and each stands past its
handed-out part: its position is `q_j` batches, so the index of its next batch is its
next block's, and the ledger of the new numbering holds exactly its first `q_j` blocks.

Two kinds of samples leave the epoch's list, neither trained again nor lost:
- handed out, but short of a whole new batch (fewer than `B'`, where the old positions do
  not add up to whole batches of the new size): applied already, so simply not listed;
- owed, in the list's tail of fewer than M that equal shards cannot hold (as an epoch's
  permutation leaves its tail out): the only samples the epoch leaves unapplied, as a
  sync re-split does.

With every worker at one position this is `data.sampler.resplit_state(keep_position)`'s
split, sample for sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from disttrain.data import ShardedSampler


@dataclass(frozen=True)
class EpochSplit:
    """The re-split epoch: each new worker's sampler state and batches taken, and what
    the old workers had handed out and what the epoch still owes (sample counts)."""

    samplers: list[dict[str, Any]]
    batches_taken: list[int]
    handed_out: int
    owed: int
    left_out: int  # owed samples in the tail equal shards cannot hold


def old_shards(states: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples the old workers of `states` (one per rank, in rank order) handed out in
    their epoch and those they still owe, each in rank order.

    Raises:
        ValueError: the states are not of one layout and epoch, or one is invalid.
    """
    first = states[0]
    written = int(first["world_size"])
    if len(states) != written or sorted(int(s["rank"]) for s in states) != list(range(written)):
        raise ValueError(f"the sampler states are not one of each of the {written} ranks")
    epochs = sorted({int(s["epoch"]) for s in states})
    if len(epochs) != 1:
        raise ValueError(f"the workers stopped in different epochs ({epochs})")
    if any("plans" in s or "shares" in s for s in states):
        raise ValueError("a sampler state has a balance plan, which is made for its number of workers")
    done, rest = [], []
    for state in sorted(states, key=lambda s: int(s["rank"])):
        sampler = ShardedSampler(int(state["num_samples"]), world_size=written, rank=int(state["rank"]),
                                 seed=int(state["seed"]))
        sampler.load_state_dict(state)
        done.append(sampler.consumed())
        rest.append(sampler.remaining())
    return torch.cat(done), torch.cat(rest)


def spread(num_batches: int, world_size: int) -> list[int]:
    """`num_batches` over `world_size` workers, as evenly as they go (lower ranks first)."""
    share, extra = divmod(num_batches, world_size)
    return [share + (1 if rank < extra else 0) for rank in range(world_size)]


def resplit_positions(states: list[dict[str, Any]], world_size: int, batch_size: int) -> EpochSplit:
    """The epoch of the old workers' sampler `states` re-split over `world_size` workers
    of `batch_size` each (the module's docstring). At an epoch's start (every position 0,
    no re-split list) the new layout is the epoch's permutation.

    Raises:
        ValueError: see `old_shards`; or fewer samples are owed than the new workers' shards
            need to hold their handed-out batches evenly (near an epoch's end, with the old
            workers far apart).
    """
    first = states[0]
    base = {"num_samples": int(first["num_samples"]), "world_size": world_size, "seed": int(first["seed"]),
            "epoch": int(first["epoch"]), "position": 0}
    done, rest = old_shards(states)
    if not len(done) and all("order" not in s for s in states):
        num_samples = base["num_samples"]  # the epoch is its permutation, with its own tail
        return EpochSplit([{**base, "rank": rank} for rank in range(world_size)], [0] * world_size, 0,
                          num_samples, num_samples % world_size)
    taken = spread(len(done) // batch_size, world_size)
    length = (sum(taken) * batch_size + len(rest)) // world_size
    if taken[0] * batch_size > length:
        raise ValueError(f"the {len(rest)} samples the epoch still owes cannot fill {world_size} shards "
                         f"that start with {', '.join(map(str, taken))} batches of {batch_size} handed out")
    samplers, dealt_done, dealt_rest = [], 0, 0
    pieces = []
    for rank, batches in enumerate(taken):
        ahead, after = batches * batch_size, length - batches * batch_size
        pieces += [done[dealt_done:dealt_done + ahead], rest[dealt_rest:dealt_rest + after]]
        dealt_done, dealt_rest = dealt_done + ahead, dealt_rest + after
        samplers.append({**base, "rank": rank, "position": ahead})
    order = torch.cat(pieces)
    return EpochSplit([{**s, "order": order} for s in samplers], taken, len(done), len(rest),
                      len(rest) - dealt_rest)
