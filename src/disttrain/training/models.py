"""Models: a registry of the shipped ones and the plug-ins, so `training.model_architecture`
picks any by name.

`training.model_architecture` is one of:
- a registered name: `simplecnn`, `mlp`, `resnet18`, `gpt_small`;
- `torchvision:NAME`, any model of `torchvision.models` (the `vision` extra);
- `PATH.py:FACTORY` or `package.module:FACTORY`, a user's factory;
- the name of an entry point of group `disttrain.models` (an installed package's).

Every builder and factory is called as `factory(description, **training.model_args)`,
`description` being the data set's `DatasetDescription` (task, input shape or vocabulary
and sequence length, classes), and returns an `nn.Module`. What it returns is checked
(a module, trainable floating-point parameters) before any process starts training.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from disttrain.config import TrainingConfig
from disttrain.core.errors import ConfigError
from disttrain.data import DatasetDescription, describe_dataset, plugins
from disttrain.training.engine import Objective, set_objective
from disttrain.training.seeding import seed_everything

InputShape = tuple[int, int, int]
KEY = "training.model_architecture"
TORCHVISION_PREFIX = "torchvision:"
# A registered builder: (description, training section, **model_args) -> module.
ModelBuilder = Callable[..., nn.Module]

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
    """Build model `name` for a classification data set of `input_shape` and `num_classes`.

    Raises:
        ConfigError: `name` is not registered, or a plug-in fails (see `build_for`).
    """
    return build_for(name, DatasetDescription.classification(input_shape, num_classes),
                     training or TrainingConfig())


def build_for(name: str, description: DatasetDescription, training: TrainingConfig) -> nn.Module:
    """Build model `name` (a registered name, `torchvision:NAME`, a factory's spec or an
    entry point's name) for a data set of `description`, with `training.model_args`.

    Raises:
        ConfigError: one line: no such model, file, module or name; the factory raised;
            it returned something other than a module, one with no trainable parameters,
            or one with parameters that are not floating point.
    """
    args: dict[str, Any] = dict(training.model_args)
    if name in _REGISTRY:
        model = plugins.call_factory(_REGISTRY[name], name, KEY, description, training, **args)
    elif name.startswith(TORCHVISION_PREFIX):
        from disttrain.training.vision import torchvision_model
        model = torchvision_model(name[len(TORCHVISION_PREFIX):], description, args)
    else:
        check_model_name(name)
        factory = plugins.load_factory(name, KEY, plugins.MODEL_GROUP)
        model = plugins.call_factory(factory, name, KEY, description, **args)
    return checked_model(model, name)


def check_model_name(name: str) -> None:
    """Check that `name` is spelled as a model can be (nothing imported or called).

    Raises:
        ConfigError: not a registered name, `torchvision:NAME`, a factory's spec or an
            installed entry point's name.
    """
    if (name in _REGISTRY or name.startswith(TORCHVISION_PREFIX) or plugins.is_factory_spec(name)
            or name in plugins.entry_point_names(plugins.MODEL_GROUP)):
        return
    raise ConfigError(f"{KEY}: {name!r} is not a registered model; use one of "
                      f"{', '.join(registered_models())}, torchvision:NAME, PATH.py:FACTORY, "
                      f"module:FACTORY or an entry point of group {plugins.MODEL_GROUP!r}")


def checked_model(model: Any, name: str) -> nn.Module:
    """`model` when every strategy can train it.

    Raises:
        ConfigError: not an `nn.Module`; no parameter with requires_grad; a parameter
            that is not floating point (gradients and the wire need floats); parameters of
            several dtypes.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{KEY}: {name} returned a {type(model).__name__}, not a torch.nn.Module; "
                          "return the model itself")
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError(f"{KEY}: {name} returned a model with no trainable parameters; give it "
                          "parameters with requires_grad=True")
    for parameter_name, parameter in model.named_parameters():
        if not parameter.is_floating_point():
            raise ConfigError(f"{KEY}: {name}'s parameter {parameter_name!r} is {parameter.dtype}, not "
                              "floating point; keep integer state in buffers (register_buffer)")
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    if len(dtypes) > 1:  # the parameter server keeps every parameter in one flat buffer
        raise ConfigError(f"{KEY}: {name}'s parameters mix {', '.join(dtypes)}; give them one dtype "
                          "(e.g. return model.float())")
    return model


def init_model(training: TrainingConfig) -> nn.Module:
    """The model of `training` at step 0, the same in every process and strategy: built
    for the data set's description (no data loaded for the built-in sets), weights from
    `training.seed`.

    The model is given its objective (`training.loss`; see `engine.Objective`).

    Raises:
        ConfigError: unknown or failing model, data-set or loss plug-in. DataError: unknown data set.
    """
    description = describe_dataset(training)
    objective = Objective.of(training.loss)  # a loss function that cannot be found fails before the build
    seed_everything(training.seed)
    return set_objective(build_for(training.model_architecture, description, training), objective)


def _classification_shape(description: DatasetDescription, name: str) -> InputShape:
    """The (channels, height, width) of an image classification data set.

    Raises:
        ConfigError: the data set is not one (e.g. a language model's tokens).
    """
    if description.task != "classification" or len(description.input_shape) != 3:
        raise ConfigError(f"{KEY}: {name} classifies images of (channels, height, width), but the data "
                          f"set is a {description.task} one of inputs {description.input_shape}; pick a "
                          "model made for it (mlp for any classification input, gpt_small for text)")
    channels, height, width = description.input_shape
    return channels, height, width


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

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden_size: int, num_layers: int,
                 batch_norm: bool = False):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for _ in range(num_layers):
            layers += [nn.Linear(width, hidden_size), *([nn.BatchNorm1d(hidden_size)] if batch_norm else []),
                       nn.ReLU()]
            width = hidden_size
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@register_model("simplecnn")
def _simplecnn(description: DatasetDescription, training: TrainingConfig, **args: Any) -> nn.Module:
    return SimpleCNN(_classification_shape(description, "simplecnn"), description.num_classes, **args)


@register_model("mlp")
def _mlp(description: DatasetDescription, training: TrainingConfig, **args: Any) -> nn.Module:
    return _mlp_of(description, training, "mlp", args)


@register_model("mlp_bn")
def _mlp_bn(description: DatasetDescription, training: TrainingConfig, **args: Any) -> nn.Module:
    return _mlp_of(description, training, "mlp_bn", {"batch_norm": True, **args})


def _mlp_of(description: DatasetDescription, training: TrainingConfig, name: str,
            args: dict[str, Any]) -> nn.Module:
    if description.task != "classification":
        raise ConfigError(f"{KEY}: {name} classifies, but the data set is a {description.task} one; "
                          "pick a model made for it (gpt_small for text)")
    args = {"hidden_size": training.mlp_hidden_size, "num_layers": training.mlp_num_layers, **args}
    return MLP(description.input_shape, description.num_classes, **args)


@register_model("resnet18")
def _resnet18(description: DatasetDescription, training: TrainingConfig, **args: Any) -> nn.Module:
    from disttrain.training.resnet import ResNet18
    return ResNet18(_classification_shape(description, "resnet18"), description.num_classes, **args)


@register_model("gpt_small")
def _gpt_small(description: DatasetDescription, training: TrainingConfig, **args: Any) -> nn.Module:
    from disttrain.training.gpt import GPT, GPTConfig
    if description.task != "language-model":
        raise ConfigError(f"{KEY}: gpt_small is a language model, but the data set is a "
                          f"{description.task} one; train it on text:FILE or another language-model set")
    args = {"vocab_size": description.vocab_size, "block_size": description.seq_len, **args}
    return GPT(GPTConfig(**args))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
