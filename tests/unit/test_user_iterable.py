"""An iterable data set of the user's own that lists its shards (`data.user_shards`): read
by shards through the plug-in mechanism, its items as `read_shard` gives them, its layout
the sampler's shard order; one without listed shards refused in one line."""

import textwrap

import pytest
import torch

from disttrain.config import TrainingConfig
from disttrain.core.errors import ConfigError
from disttrain.data import load_datasets
from disttrain.data.datasets import shard_layout

CORPUS = textwrap.dedent('''
    import torch
    from torch.utils.data import IterableDataset


    class Corpus(IterableDataset):
        """Shards named part-N, each PER_SHARD rows of 4 features and a label."""

        def __init__(self, num_shards, per_shard, seed, sized):
            self.shards = [f"part-{i}" for i in range(num_shards)]
            self.per_shard, self.seed = per_shard, seed
            if sized:
                self.shard_sizes = [per_shard] * num_shards

        def read_shard(self, shard):
            number = int(shard.split("-")[1])
            gen = torch.Generator().manual_seed(self.seed * 1000 + number)
            x = torch.randn(self.per_shard, 4, generator=gen)
            return list(zip(x, (x.sum(1) > 0).long()))

        def __iter__(self):
            for shard in self.shards:
                yield from self.read_shard(shard)


    def build(num_shards=6, per_shard=10, sized=True):
        return (Corpus(num_shards, per_shard, 1, sized), Corpus(2, per_shard, 2, sized),
                {"input_shape": [4], "num_classes": 2})


    class Plain(IterableDataset):
        def __iter__(self):
            yield torch.zeros(4), 0


    def plain():
        return Plain(), Plain(), {"input_shape": [4], "num_classes": 2}
''')


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.py"
    path.write_text(CORPUS)
    return path


def rows(seed: int, number: int, per_shard: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(per_shard, 4, generator=torch.Generator().manual_seed(seed * 1000 + number))
    return x, (x.sum(1) > 0).long()


@pytest.mark.parametrize("sized", [True, False])
def test_its_items_are_read_by_shards_and_its_layout_orders_the_sampler(corpus_file, sized):
    config = TrainingConfig(dataset=f"{corpus_file}:build", dataset_args={"sized": sized})
    train, test = load_datasets(config)
    assert len(train) == 60 and len(test) == 20
    x, y = train.batch(torch.tensor([59, 0, 13]))
    assert torch.equal(x, torch.stack([rows(1, 5)[0][9], rows(1, 0)[0][0], rows(1, 1)[0][3]]))
    assert torch.equal(y, torch.stack([rows(1, 5)[1][9], rows(1, 0)[1][0], rows(1, 1)[1][3]]))
    assert shard_layout(config).shard_sizes == (10,) * 6
    # a subset is a plain one: no layout, the sampler's plain permutation
    assert shard_layout(TrainingConfig(dataset=f"{corpus_file}:build", max_train_samples=30)) is None


def test_an_iterable_data_set_without_listed_shards_is_refused_in_one_line(corpus_file):
    with pytest.raises(ConfigError, match=r"^training.dataset: .*plain's train set is an iterable data set "
                                          r"with no listed shards, so its position cannot be checkpointed; "
                                          r"give it `shards` \(a list\) and `read_shard\(shard\)`"):
        load_datasets(TrainingConfig(dataset=f"{corpus_file}:plain"))
