"""Data sets, their one table of shapes, and the sharded, resumable sampler."""

from disttrain.data.datasets import ArrayDataset, dataset_shape, load_datasets
from disttrain.data.sampler import ShardedSampler, epoch_permutation

__all__ = ["ArrayDataset", "ShardedSampler", "dataset_shape", "epoch_permutation", "load_datasets"]
