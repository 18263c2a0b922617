"""Batches loaded by worker processes (`training.loader_workers`), with real spawned
workers: each is exactly what the data set's `batch` returns, in the loop's order; a
batch off the plan is loaded in place and the read-ahead goes on after it; the sampler's
position and torch's global random state are left alone, so resumes stay exact."""

from __future__ import annotations

import copy

import pytest
import torch

from disttrain.data import ArrayDataset, ShardedSampler
from disttrain.training.loading import PrefetchedBatches, prefetch

pytestmark = pytest.mark.timeout(120)


def dataset() -> ArrayDataset:
    generator = torch.Generator().manual_seed(0)
    return ArrayDataset("tiny", torch.randn(100, 1, 4, 4, generator=generator),
                        torch.randint(0, 10, (100,), generator=generator))


@pytest.mark.slow
def test_workers_serve_the_loops_batches_in_order_and_fall_back_off_the_plan():
    source, sampler = dataset(), ShardedSampler(100, seed=3)
    loader = prefetch(source, 2)
    assert isinstance(loader, PrefetchedBatches) and prefetch(source, 0) is None
    try:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            loader.start_epoch(lambda: list(copy.deepcopy(sampler).batches(16)))
            rng = torch.get_rng_state()
            for indices in sampler.batches(16):
                inputs, targets = loader.batch(indices)
                expected = source.batch(indices)
                assert torch.equal(inputs, expected[0]) and torch.equal(targets, expected[1])
            assert torch.equal(torch.get_rng_state(), rng)  # nothing drew from the global generator
        assert (loader.num_prefetched, loader.num_direct) == (14, 0)

        # Off the plan (a re-plan, a redone block): loaded here, then ahead again from the next.
        sampler.set_epoch(2)
        loader.start_epoch(lambda: list(copy.deepcopy(sampler).batches(16)))
        batches = sampler.batches(16)
        first = next(batches)
        odd = first[:5]
        assert torch.equal(loader.batch(odd)[0], source.batch(odd)[0])
        for indices in batches:
            assert torch.equal(loader.batch(indices)[1], source.batch(indices)[1])
        assert (loader.num_prefetched, loader.num_direct) == (14 + 6, 1)
    finally:
        loader.close()


USER_FILE = '''
import torch


class Squares:
    """A user's data set, defined in a file imported by path."""

    def __len__(self):
        return 40

    def batch(self, indices):
        return indices.float() ** 2, indices % 3


def make():
    return Squares()
'''


@pytest.mark.slow  # spawned loader processes
def test_a_data_set_from_a_users_file_loads_in_spawned_workers(tmp_path):
    from disttrain.data.plugins import DATASET_GROUP, load_factory

    (tmp_path / "squares.py").write_text(USER_FILE)
    source = load_factory(f"{tmp_path / 'squares.py'}:make", "training.dataset", DATASET_GROUP)()
    loader = prefetch(source, 1)
    sampler = ShardedSampler(40, seed=1)
    try:
        loader.start_epoch(lambda: list(copy.deepcopy(sampler).batches(8)))
        for indices in sampler.batches(8):
            assert torch.equal(loader.batch(indices)[0], indices.float() ** 2)
        assert loader.num_prefetched == 5
    finally:
        loader.close()
