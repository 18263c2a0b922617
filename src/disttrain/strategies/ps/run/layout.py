"""The run's block layout, as a shard learns it: from the run's config (see `run_layout`)."""

from __future__ import annotations

from disttrain.config import Config, TrainingConfig
from disttrain.core.errors import ConfigError
from disttrain.data import load_datasets
from disttrain.data.datasets import synthetic_shape
from disttrain.strategies.ps.server.ledger import BlockLayout


def run_layout(config: Config, num_samples: int | None = None) -> BlockLayout:
    """The run's block layout, which the shard checks every push's block against
    (`server.ledger`): which worker may push which block, in every mode, for a balance
    plan (whatever its split: the global batches are fixed) and local-update rounds.

    It is computed here, from the run's config, as the workers number their blocks
    (`worker.blocks`: the training set's length after `training.max_train_samples`, the
    batch size, the workers, the balance and `training.sync_every`), never taken from a
    worker, which is the party it guards against. The config is what every documented
    deployment hands each `ps-server` already (the launcher its `config.yaml`, a server
    started by hand, in Compose or in Kubernetes its `--config`), so the layout needs no
    new channel and holds in each of them; a coordinator, by contrast, is optional (a
    shard may run without one), and a layout passed on a command line could disagree
    with the config the workers read. The one input the config does not spell is the
    training set's length (`train_length`): a synthetic set's is its `num_samples`, a
    built-in public set's (MNIST, Fashion-MNIST, CIFAR-10) its published size, so a shard
    of those needs no data on its host; any other set (the shipped digits, a plug-in, an
    image folder, text, torchvision's) the shard reads the way a worker does
    (`data.load_datasets`), keeping only its length, so its host needs the data set as
    the workers' hosts do. (The launcher computes it once before it starts any process, so a
    training set that makes no batch per worker stops the run there.)

    Args:
        num_samples: the training set's length, when the caller knows it (read otherwise).

    Raises:
        ConfigError: the training set does not make one batch per worker (or the
            data set's plug-in cannot be found or fails).
        DataError: the training set cannot be read.
    """
    training, system = config.training, config.system
    if num_samples is None:
        num_samples = train_length(config)
    balanced = system.balance != "none"
    layout = BlockLayout.of_run(system.num_workers, training.num_epochs, num_samples, training.batch_size,
                                balanced, round_length(training))
    if not layout.batches_per_epoch:
        need = training.batch_size * system.num_workers if balanced else system.num_workers
        raise ConfigError(f"training.dataset: {training.dataset}'s {num_samples} training samples (after "
                          f"training.max_train_samples) make no batch for each of {system.num_workers} "
                          f"workers{' under a balance plan' if balanced else ''} (at least {need} needed); "
                          "use more data or fewer workers" + (", or a smaller batch" if balanced else ""))
    return layout


def round_length(training: TrainingConfig) -> int:
    """The rounds a shard checks pushes' blocks against: H with local updates, 1 without;
    1 with Streaming DiLoCo's fragments too, whose rounds end at steps of their own (a
    shard accepts a push naming any of its worker's batches, and its ledger records it)."""
    if not training.local_update_mode or training.outer_fragments > 1:
        return 1
    return training.sync_every


# The training splits of the built-in public sets, whose downloads are checked against
# their published checksums: the workers read this many samples, and a shard need not
# read (or hold) the files to know it.
PUBLISHED_TRAIN_SAMPLES = {"mnist": 60_000, "fashion_mnist": 60_000, "cifar10": 50_000}


def train_length(config: Config) -> int:
    """The training set's length after `training.max_train_samples`, as a worker's sampler
    sees it: a synthetic set's `num_samples` and a built-in public set's published size,
    read from nothing; any other set's, read as a worker reads it."""
    training = config.training
    if training.dataset == "synthetic" or synthetic_shape(training.dataset) is not None:
        length = training.num_samples  # drawn, not read: `data.datasets.synthetic`
    elif training.dataset in PUBLISHED_TRAIN_SAMPLES:
        length = PUBLISHED_TRAIN_SAMPLES[training.dataset]
    else:
        length = len(load_datasets(training)[0])
    limit = training.max_train_samples
    return length if limit is None else min(length, limit)
