"""Models and a tiny registry, so `training.model_architecture` picks one by name.

Every builder takes the input shape `(channels, height, width)` and the number of classes,
plus the training section for model-specific knobs, and returns an `nn.Module`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from disttrain.config import TrainingConfig
from disttrain.core.errors import ConfigError
from disttrain.data import dataset_shape
from disttrain.training.seeding import seed_everything

InputShape = tuple[int, int, int]
ModelBuilder = Callable[[InputShape, int, TrainingConfig], nn.Module]

_REGISTRY: dict[str, ModelBuilder] = {}


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator: make a builder selectable as `model_architecture: <name>`."""

    def decorate(builder: ModelBuilder) -> ModelBuilder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = builder
        return builder

    return decorate


def registered_models() -> list[str]:
    return sorted(_REGISTRY)


def build_model(name: str, input_shape: InputShape, num_classes: int,
                training: TrainingConfig | None = None) -> nn.Module:
    """Build the registered model `name` for inputs of `input_shape`.

    Raises:
        ConfigError: `name` is not registered.
    """
    if name not in _REGISTRY:
        raise ConfigError(f"training.model_architecture: {name!r} is not a registered model; use "
                          f"one of {', '.join(registered_models())}")
    return _REGISTRY[name](input_shape, num_classes, training or TrainingConfig())


def init_model(training: TrainingConfig) -> nn.Module:
    """The model of `training` at step 0, the same in every process and strategy: built
    for the data set's shape from the table (no data loaded), weights from `training.seed`.

    Raises:
        ConfigError: unknown model. DataError: unknown data set.
    """
    seed_everything(training.seed)
    input_shape, num_classes = dataset_shape(training.dataset)
    return build_model(training.model_architecture, input_shape, num_classes, training)


class SimpleCNN(nn.Module):
    """Two 3x3 convolutions (32, 64 filters) each followed by 2x2 max-pooling, then
    fully connected 128 -> classes with dropout 0.5. Adapts to 1x28x28, 3x32x32, 1x8x8."""

    def __init__(self, input_shape: InputShape, num_classes: int = 10, dropout: float = 0.5):
        super().__init__()
        channels, height, width = input_shape
        self.conv1 = nn.Conv2d(channels, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(64 * (height // 4) * (width // 4), 128)
        self.fc2 = nn.Linear(128, num_classes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = self.dropout(torch.relu(self.fc1(x)))
        return self.fc2(x)


class MLP(nn.Module):
    """Flatten, then `num_layers` hidden layers of `hidden_size` with ReLU (with
    `batch_norm`, BatchNorm after each hidden layer's linear map: a small model with
    buffers). Its width sets how large the gradients are relative to the compute, which
    communication benchmarks need."""

    def __init__(self, input_shape: InputShape, num_classes: int, hidden_size: int, num_layers: int,
                 batch_norm: bool = False):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = input_shape[0] * input_shape[1] * input_shape[2]
        for _ in range(num_layers):
            layers += [nn.Linear(width, hidden_size), *([nn.BatchNorm1d(hidden_size)] if batch_norm else []),
                       nn.ReLU()]
            width = hidden_size
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@register_model("simplecnn")
def _simplecnn(input_shape: InputShape, num_classes: int, training: TrainingConfig) -> nn.Module:
    return SimpleCNN(input_shape, num_classes)


@register_model("mlp")
def _mlp(input_shape: InputShape, num_classes: int, training: TrainingConfig) -> nn.Module:
    return MLP(input_shape, num_classes, training.mlp_hidden_size, training.mlp_num_layers)


@register_model("mlp_bn")
def _mlp_bn(input_shape: InputShape, num_classes: int, training: TrainingConfig) -> nn.Module:
    return MLP(input_shape, num_classes, training.mlp_hidden_size, training.mlp_num_layers, batch_norm=True)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
