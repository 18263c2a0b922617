"""Models adapt to every input shape and are selectable by name."""

import pytest
import torch

from disttrain.config import TrainingConfig
from disttrain.training.models import SimpleCNN, build_model, count_parameters, registered_models


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (1, 8, 8)])
def test_simplecnn_adapts_to_input_shape(shape):
    model = build_model("simplecnn", shape, 10)
    assert model(torch.zeros(2, *shape)).shape == (2, 10)


def test_simplecnn_layout_matches_the_seed():
    model = SimpleCNN((1, 28, 28))
    assert model.conv1.out_channels == 32 and model.conv2.out_channels == 64
    assert model.fc1.out_features == 128 and model.dropout.p == 0.5
    # The first linear layer dominates: what the parameter-server sharding must split.
    assert model.fc1.weight.numel() / count_parameters(model) > 0.9


def test_mlp_width_is_configurable():
    small = build_model("mlp", (1, 8, 8), 10, TrainingConfig(mlp_hidden_size=16, mlp_num_layers=1))
    wide = build_model("mlp", (1, 8, 8), 10, TrainingConfig(mlp_hidden_size=512, mlp_num_layers=3))
    assert count_parameters(wide) > 50 * count_parameters(small)


def test_registry():
    assert {"simplecnn", "mlp"} <= set(registered_models())
    with pytest.raises(ValueError, match="is not a registered model"):
        build_model("transformer", (1, 8, 8), 10)
