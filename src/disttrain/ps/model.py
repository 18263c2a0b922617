"""The model as the parameter server sees it: built identically in every process of a
run from the config alone (no data set loaded), plus the checks of what the PS supports."""

from __future__ import annotations

import torch
from torch import nn

from disttrain.config import Config
from disttrain.data.datasets import SYNTHETIC_SHAPE
from disttrain.engine import seed_everything
from disttrain.errors import ConfigError
from disttrain.models import build_model

# (channels, height, width) of each data set's images; every one has ten classes.
INPUT_SHAPES = {"mnist": (1, 28, 28), "fashion_mnist": (1, 28, 28), "cifar10": (3, 32, 32),
                "digits": (1, 8, 8), "synthetic": SYNTHETIC_SHAPE}
NUM_CLASSES = 10


def build_initial_model(config: Config) -> nn.Module:
    """The model at step 0: the same weights in every process (seeded by training.seed)."""
    training = config.training
    seed_everything(training.seed)
    return build_model(training.model_architecture, INPUT_SHAPES[training.dataset], NUM_CLASSES, training)


def flat_vector(model: nn.Module) -> torch.Tensor:
    """All parameters concatenated in `named_parameters()` order (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_supported(config: Config) -> None:
    """Raises ConfigError for settings the parameter server does not offer yet."""
    if config.system.compression_enabled:
        raise ConfigError("system.compression_enabled: gradient compression is not available in the "
                          "parameter server yet; set it to false")
