"""Data sets and the sharded, resumable sampler."""

from disttrain.data.datasets import ArrayDataset, load_datasets
from disttrain.data.sampler import ShardedSampler, epoch_permutation

__all__ = ["ArrayDataset", "ShardedSampler", "epoch_permutation", "load_datasets"]
