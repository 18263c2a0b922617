"""Data sets, their one table of shapes, and the sharded, resumable samplers (equal shards, or
global batches split by a balance plan)."""

from disttrain.data.datasets import ArrayDataset, dataset_shape, load_datasets
from disttrain.data.planned import PlannedSampler
from disttrain.data.sampler import ShardedSampler, epoch_permutation

__all__ = ["ArrayDataset", "PlannedSampler", "ShardedSampler", "dataset_shape", "epoch_permutation",
           "load_datasets"]
