"""The backend the ranks of an `auto` run agree on: the pure rule from every rank's GPU
flag, the device each rank then computes on, and the store round (on an in-process
store): every rank's answer read, a missing rank named after the timeout, and answers of
an earlier attempt of the group never read."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from disttrain.core.errors import DistributedError
from disttrain.strategies.ddp.agreement import (
    decide_backend,
    describe_ranks,
    exchange_flags,
    has_own_gpu,
    store_prefix,
)
from disttrain.strategies.ddp.runtime import select_device

MIXED = "no CUDA GPU (NCCL needs every rank on a GPU); GPU ranks compute on their GPU and all-reduce " \
        "through the host"


@given(st.lists(st.booleans(), min_size=1, max_size=64))
def test_nccl_exactly_when_every_rank_has_a_gpu_and_the_reason_names_the_ranks_without(flags):
    choice = decide_backend(flags)
    assert choice.backend == ("nccl" if all(flags) else "gloo")
    if all(flags):
        assert choice.reason == "every rank has a GPU"
    elif not any(flags):
        assert choice.reason == "no rank has a GPU"
    else:
        without = [rank for rank, flag in enumerate(flags) if not flag]
        assert choice.reason.endswith(f" {MIXED}")
        head = choice.reason.removesuffix(f" {MIXED}")  # "rank 1 has", "ranks 0, 1, 2, 3 and 5 more have"
        assert head.endswith(" has" if len(without) == 1 else " have")
        numbers = [int(n) for n in re.findall(r"\d+", head)]
        assert numbers == (without if len(without) <= 4 else without[:4] + [len(without) - 4])
    assert decide_backend(list(flags)) == choice  # every rank, deciding alone, decides alike


def test_reasons_in_words():
    assert decide_backend([True, False]).reason == f"rank 1 has {MIXED}"
    assert decide_backend([False, True, False, True]).reason == f"ranks 0, 2 have {MIXED}"
    assert describe_ranks([0, 1, 2, 3, 4, 5]) == "ranks 0, 1, 2, 3 and 2 more have"
    with pytest.raises(ValueError):
        decide_backend([])


def test_a_rank_has_its_own_gpu_only_when_gpu_local_rank_exists():
    assert has_own_gpu(cuda_available=True, num_gpus=2, local_rank=1)
    assert not has_own_gpu(cuda_available=True, num_gpus=1, local_rank=1)
    assert not has_own_gpu(cuda_available=False, num_gpus=0, local_rank=0)


def test_a_gpu_rank_of_a_mixed_gloo_run_computes_on_its_gpu():
    assert select_device("gloo", 1, gpu_under_gloo=True) == torch.device("cuda", 1)
    assert select_device("gloo", 1) == torch.device("cpu")
    assert select_device("nccl", 1) == torch.device("cuda", 1)


def test_every_rank_reads_every_answer():
    store = dist.PrefixStore(store_prefix(0), dist.HashStore())
    store.set("1", b"0")  # rank 1 has answered: no GPU
    assert exchange_flags(store, rank=0, world_size=2, has_gpu=True, timeout_s=5) == [True, False]


def test_a_rank_that_never_answers_is_named_after_the_timeout():
    store = dist.PrefixStore(store_prefix(0), dist.HashStore())
    with pytest.raises(DistributedError, match=r"rank\(s\) 1, 2 did not say whether they have a GPU "
                                                r"within 0.2s"):
        exchange_flags(store, rank=0, world_size=3, has_gpu=False, timeout_s=0.2)


def test_a_restarted_group_does_not_read_the_answers_of_the_attempt_before():
    shared = dist.HashStore()  # the elastic agent's store outlives a restart of the ranks
    earlier = dist.PrefixStore(store_prefix(0), shared)
    earlier.set("1", b"1")
    assert exchange_flags(earlier, rank=0, world_size=2, has_gpu=True, timeout_s=5) == [True, True]
    with pytest.raises(DistributedError, match=r"rank\(s\) 1 did not"):
        exchange_flags(dist.PrefixStore(store_prefix(1), shared), rank=0, world_size=2, has_gpu=True,
                       timeout_s=0.2)
