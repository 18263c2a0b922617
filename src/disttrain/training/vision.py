"""`torchvision:NAME`: any model of `torchvision.models`, built for the data set's classes,
from the optional extra `vision` (`pip install 'disttrain[vision]'`).

The weights are drawn afresh (no download, `weights=None`) from `training.seed`. For a
ResNet-family model on inputs of 64 pixels or less the stem becomes the usual small-image
one (a 3x3 convolution of stride 1, no max-pool), and its first convolution takes the data
set's channels.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from disttrain.core.errors import ConfigError
from disttrain.data import DatasetDescription
from disttrain.data.vision import import_torchvision
from disttrain.training.resnet import SMALL_IMAGE

KEY = "training.model_architecture"


def torchvision_model(name: str, description: DatasetDescription, args: dict[str, Any]) -> nn.Module:
    """torchvision's model `name` for `description`'s images and classes.

    Raises:
        ConfigError: torchvision is not installed (naming the extra), `name` is not one of
            its models, the data set is not an image classification one, or the builder fails.
    """
    torchvision = import_torchvision(KEY, f"torchvision:{name}")
    available = torchvision.models.list_models()
    if name not in available:
        raise ConfigError(f"{KEY}: torchvision has no model {name!r}; use one of "
                          f"{', '.join(sorted(available)[:12])}, ... (torchvision.models.list_models())")
    if description.task != "classification" or len(description.input_shape) != 3:
        raise ConfigError(f"{KEY}: torchvision:{name} classifies images, but the data set is a "
                          f"{description.task} one of inputs {description.input_shape}")
    try:
        model = torchvision.models.get_model(name, weights=None, num_classes=description.num_classes, **args)
    except Exception as e:  # torchvision's builder: its message names the bad argument
        raise ConfigError(f"{KEY}: torchvision:{name} raised {type(e).__name__}: {e}") from e
    channels, height, width = description.input_shape
    conv1 = getattr(model, "conv1", None)
    if isinstance(conv1, nn.Conv2d) and isinstance(getattr(model, "maxpool", None), nn.Module):
        if max(height, width) <= SMALL_IMAGE:
            model.conv1 = nn.Conv2d(channels, conv1.out_channels, 3, stride=1, padding=1, bias=False)
            model.maxpool = nn.Identity()
        elif channels != conv1.in_channels:
            model.conv1 = nn.Conv2d(channels, conv1.out_channels, conv1.kernel_size, conv1.stride,
                                    conv1.padding, bias=False)
    return model
