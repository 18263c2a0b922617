"""Which configuration to run at each size: every candidate predicted, the fastest chosen,
and the cheapest of those within a margin (10%) of it.

"Cheapest" is `Candidate.cost_key`: fewer extra machines (parameter-server shards) first,
then a more exact gradient (no compression before half precision, before int8, before
top-k), then fewer local steps between exchanges, then synchronous before asynchronous,
then fewer bytes on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from disttrain.advise.costmodel import (
    COMPRESSIONS,
    DDP_ONLY,
    OUTER_COMPRESSIONS,
    PULL_COMPRESSIONS,
    STRATEGIES,
    Candidate,
    CostModel,
    Prediction,
)

WORKER_COUNTS = tuple(2**i for i in range(11))  # 1 ... 1,024
CHEAPEST_MARGIN = 0.10


def candidates(num_workers: int, max_servers: int = 64, sync_every: Sequence[int] = (1,),
               compressions: Iterable[str] = COMPRESSIONS,
               pulls: Iterable[str] = ("none",), outers: Iterable[str] = ("none",)) -> list[Candidate]:
    """Every configuration worth predicting at `num_workers`: DDP; the parameter server,
    sync and async, with 1, 2, 4 ... shards (at most `max_servers` and no more than the
    workers); each compression (PowerSGD: DDP only); each local-step count H of
    `sync_every` for the sync ones; each pull compression of `pulls` for the parameter
    server at H = 1 (sync and async); at H > 1, Streaming DiLoCo's 2, 4 ... H fragments
    (the parameter server's: no more than its shards), without the run's compression
    each delay tau of 1, 2, 4 ... below H, and for DDP each pseudo-gradient compression
    of `outers` (without the run's compression, which it replaces)."""
    shard_counts = [s for s in (2**i for i in range(11)) if s <= min(max_servers, num_workers)]
    pulls, outers = tuple(pulls), tuple(outers)
    found = []
    for compression in compressions:
        ps = compression not in DDP_ONLY
        for h in sync_every:
            fragment_counts = [f for f in (2**i for i in range(11)) if f <= h]
            delays = (0, *(d for d in (2**i for i in range(11)) if d < h)) if compression == "none" else (0,)
            outer_options = outers if compression == "none" else ("none",)
            if h == 1:
                found.append(Candidate("ddp", compression))
            else:
                found.extend(Candidate("ddp", compression, 0, h, fragments=f, outer=outer, delay=d)
                             for f in fragment_counts for outer in outer_options for d in delays)
            if ps and h == 1:
                found.extend(Candidate("ps-sync", compression, s, h, pull)
                             for s in shard_counts for pull in pulls)
            elif ps:
                found.extend(Candidate("ps-sync", compression, s, h, fragments=f, delay=d)
                             for s in shard_counts for f in fragment_counts if f <= s for d in delays)
        if ps:
            found.extend(Candidate("ps-async", compression, s, 1, pull) for s in shard_counts
                         for pull in pulls)
    return found


@dataclass(frozen=True)
class Advice:
    """One size of run: the fastest configuration, the cheapest near it, and the best of
    each strategy."""

    num_workers: int
    fastest: Prediction
    cheapest: Prediction
    best_by_strategy: dict[str, Prediction]
    num_candidates: int

    def to_dict(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "fastest": self.fastest.to_dict(),
                "cheapest_within_10pct": self.cheapest.to_dict(),
                "best_by_strategy": {k: v.to_dict() for k, v in self.best_by_strategy.items()},
                "num_candidates": self.num_candidates}


def choose(predictions: Sequence[Prediction],
           margin: float = CHEAPEST_MARGIN) -> tuple[Prediction, Prediction]:
    """(fastest, cheapest within `margin` of the fastest's samples/s).

    Raises:
        ValueError: no predictions.
    """
    if not predictions:
        raise ValueError("no configuration to choose from")
    fastest = max(predictions, key=lambda p: (p.samples_per_s, [-k for k in p.candidate.cost_key()]))
    near = [p for p in predictions if p.samples_per_s >= (1 - margin) * fastest.samples_per_s]
    cheapest = min(near, key=lambda p: (p.candidate.cost_key(), p.bytes_per_step, -p.samples_per_s))
    return fastest, cheapest


@dataclass(frozen=True)
class CompressionChoices:
    """The compressions advice considers: of pushes, of pulls and of pseudo-gradients (None:
    each one the workload has a measured cost of, and none; compact top-k wherever top-k
    is measured)."""

    pushes: tuple[str, ...] | None = None
    pulls: tuple[str, ...] | None = None
    outers: tuple[str, ...] | None = None


def advise(model: CostModel, worker_counts: Sequence[int] = WORKER_COUNTS, max_servers: int = 64,
           sync_every: Sequence[int] = (1,),
           choices: CompressionChoices = CompressionChoices()) -> list[Advice]:
    """Predict every candidate at each size in `worker_counts` (with at most `max_servers`
    shards, each local-step count of `sync_every`, each compression of `choices`) and
    choose."""
    compressions, pulls, outers = choices.pushes, choices.pulls, choices.outers
    workload = model.workload
    measured = set(workload.compression) | ({"topk-compact"} if "topk" in workload.compression else set())
    if compressions is None:
        compressions = [c for c in COMPRESSIONS if c == "none" or c in measured]
    if pulls is None:
        pulls = [p for p in PULL_COMPRESSIONS if p == "none" or (p in workload.pull_compression
                                                                  and workload.shapes)]
    if outers is None:
        outers = [o for o, scheme in OUTER_COMPRESSIONS.items() if o == "none" or scheme in measured]
    compressions, pulls, outers = tuple(compressions), tuple(pulls), tuple(outers)
    advice = []
    for n in worker_counts:
        found = candidates(n, max_servers, sync_every, compressions, pulls, outers)
        predictions = [model.predict(c, n) for c in found]
        fastest, cheapest = choose(predictions)
        best = {strategy: max((p for p in predictions if p.candidate.strategy == strategy),
                              key=lambda p: p.samples_per_s) for strategy in STRATEGIES}
        advice.append(Advice(n, fastest, cheapest, best, len(predictions)))
    return advice
