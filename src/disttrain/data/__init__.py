"""Data sets (built in, `text:FILE`, `image-folder:DIR`, `torchvision:NAME`, a user's
factory), what each is (`DatasetDescription`), and the sharded, resumable samplers (equal
shards, or global batches split by a balance plan)."""

from disttrain.data.datasets import ArrayDataset, dataset_shape, describe_dataset, load_datasets
from disttrain.data.description import CLASSIFICATION, LANGUAGE_MODEL, DatasetDescription
from disttrain.data.mapped import BatchedDataset, MappedDataset
from disttrain.data.planned import PlannedSampler
from disttrain.data.sampler import ShardedSampler, epoch_permutation

__all__ = ["CLASSIFICATION", "LANGUAGE_MODEL", "ArrayDataset", "BatchedDataset", "DatasetDescription",
           "MappedDataset", "PlannedSampler", "ShardedSampler", "dataset_shape", "describe_dataset",
           "epoch_permutation", "load_datasets"]
