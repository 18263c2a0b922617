"""One backend for every rank of a run whose nodes are not all CUDA.

With `ddp.backend: auto` each rank would otherwise pick NCCL when it sees CUDA and gloo
when it does not, and a machine with GPUs beside one without would start a process group
whose ranks disagree: it fails or hangs. NCCL needs every rank on a GPU. So before the
process group starts, every rank publishes through the rendezvous store whether it has a
GPU of its own, reads every rank's answer, and applies the same rule: all on a GPU, NCCL;
otherwise gloo, with each rank that has a GPU still computing on it (gloo all-reduces GPU
tensors by staging them through the host, so a GPU rank and a CPU rank run the same host
algorithm over TCP).

`decide_backend` is the pure rule (every rank's flag in, backend and reason out);
`exchange_flags` is the one store round it needs, keyed by restart so that a group the
elastic agent restarted never reads the answers of the attempt before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from disttrain.core.errors import DistributedError

MAX_NAMED_RANKS = 4  # a reason names this many ranks without a GPU, then counts the rest


@dataclass(frozen=True)
class BackendChoice:
    """The backend every rank uses, and why, in words for the user."""

    backend: str
    reason: str


def has_own_gpu(cuda_available: bool, num_gpus: int, local_rank: int) -> bool:
    """Whether this rank gets a GPU of its own: GPU `local_rank` of its node exists."""
    return cuda_available and local_rank < num_gpus


def decide_backend(has_gpu: Sequence[bool]) -> BackendChoice:
    """The backend of `ddp.backend: auto`, from every rank's `has_own_gpu`, in rank order.

    Raises:
        ValueError: no ranks.
    """
    if not has_gpu:
        raise ValueError("decide_backend needs the flag of at least one rank")
    if all(has_gpu):
        return BackendChoice("nccl", "every rank has a GPU")
    if not any(has_gpu):
        return BackendChoice("gloo", "no rank has a GPU")
    without = [rank for rank, flag in enumerate(has_gpu) if not flag]
    return BackendChoice("gloo", f"{describe_ranks(without)} no CUDA GPU (NCCL needs every rank on a "
                                 "GPU); GPU ranks compute on their GPU and all-reduce through the host")


def describe_ranks(ranks: Sequence[int]) -> str:
    """`rank 1 has`, `ranks 1, 3 have`, `ranks 0, 1, 2, 3 and 5 more have`."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} has"
    named = ", ".join(str(rank) for rank in ranks[:MAX_NAMED_RANKS])
    rest = len(ranks) - MAX_NAMED_RANKS
    return f"ranks {named}{f' and {rest} more' if rest > 0 else ''} have"


def store_prefix(restart_count: int) -> str:
    """The store keys of one attempt of the group (`TORCHELASTIC_RESTART_COUNT`)."""
    return f"disttrain/backend/restart{restart_count}/"


def exchange_flags(store: dist.Store, rank: int, world_size: int, has_gpu: bool,
                   timeout_s: float) -> list[bool]:
    """Publish this rank's flag and return every rank's, in rank order.

    A barrier on the store: call it on every rank of the group, with a store already
    prefixed by `store_prefix` (keys are the ranks).

    Raises:
        DistributedError: some rank did not publish within `timeout_s`.
    """
    store.set(str(rank), b"1" if has_gpu else b"0")
    keys = [str(r) for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as e:  # DistStoreError on a timeout, DistNetworkError on a lost store
        raise DistributedError(f"{_missing(store, keys)} did not say whether they have a GPU within "
                               f"{timeout_s:g}s; check that every node started") from e
    return [store.get(key) == b"1" for key in keys]


def _missing(store: dist.Store, keys: list[str]) -> str:
    try:
        missing = [int(key) for key in keys if not store.check([key])]
    except RuntimeError:  # the store itself went away
        return "some ranks"
    return f"rank(s) {', '.join(map(str, missing))}" if missing else "some ranks"
