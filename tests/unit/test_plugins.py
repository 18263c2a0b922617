"""A user's model and data set by spec (PATH.py:NAME, module:NAME, entry point): found,
built the same in every process, and each way one can fail a one-line ConfigError that
names what was looked for, with exit code 2 and nothing started."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from disttrain import cli
from disttrain.config import TrainingConfig, load_config
from disttrain.core.errors import ConfigError
from disttrain.data import DatasetDescription, MappedDataset, ShardedSampler, describe_dataset, load_datasets
from disttrain.training.models import init_model
from tests.plugin_files import write_plugin


@pytest.fixture
def plugin(tmp_path):
    return write_plugin(tmp_path)


def training(plugin, model="model", dataset="data", **fields) -> TrainingConfig:
    return TrainingConfig(model_architecture=f"{plugin}:{model}", dataset=f"{plugin}:{dataset}", **fields)


def test_a_model_and_data_set_from_a_file_build_the_same_in_every_process(plugin):
    config = training(plugin, model_args={"hidden": 5}, seed=3)
    first, again = init_model(config), init_model(config)
    assert first[0].out_features == 5 and first[2].out_features == 2
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters(), strict=True))
    other_seed = init_model(training(plugin, model_args={"hidden": 5}, seed=4))
    assert not torch.equal(first[0].weight, other_seed[0].weight)
    assert describe_dataset(config) == DatasetDescription.classification((8,), 2)


def test_a_user_data_set_batches_by_index_and_keeps_its_subsets(plugin):
    train, test = load_datasets(training(plugin, max_train_samples=50))
    assert isinstance(train, MappedDataset) and len(train) == 50 and len(test) == 64
    inputs, targets = train.batch(torch.tensor([3, 0, 7]))
    assert inputs.shape == (3, 8) and inputs.dtype == torch.float32 and targets.dtype == torch.int64
    assert torch.equal(inputs[1], train[0][0]) and int(targets[2]) == train[7][1]
    again, _ = load_datasets(training(plugin, max_train_samples=50))
    assert torch.equal(again.batch(torch.arange(50))[0], train.batch(torch.arange(50))[0])


def test_a_resumed_sampler_goes_on_with_the_next_items_of_a_user_data_set(plugin):
    train, _ = load_datasets(training(plugin))
    whole = ShardedSampler(len(train), world_size=2, rank=1, seed=5)
    expected = [train.batch(b)[1] for b in whole.batches(16)]
    first = ShardedSampler(len(train), world_size=2, rank=1, seed=5)
    batches = first.batches(16)
    seen = [train.batch(next(batches))[1] for _ in range(2)]
    resumed = ShardedSampler(len(train), world_size=2, rank=1, seed=5)
    resumed.load_state_dict(first.state_dict())
    seen += [train.batch(b)[1] for b in resumed.batches(16)]
    assert len(seen) == len(expected) and all(torch.equal(a, b) for a, b in zip(seen, expected, strict=True))


def test_a_package_module_factory_is_found(tmp_path, monkeypatch):
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write_plugin(package, "models.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = init_model(TrainingConfig(model_architecture="userpkg.models:model",
                                      dataset="userpkg.models:data", model_args={"hidden": 3}))
    assert model[0].in_features == 8 and model[0].out_features == 3


def write_distribution(site, entry_points: str) -> None:
    """An installed distribution as pip leaves one: a package and its dist-info."""
    package = site / "userplug"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    write_plugin(package, "zoo.py")
    info = site / "userplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: userplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


def test_an_installed_entry_point_is_found_by_name(tmp_path, monkeypatch):
    write_distribution(tmp_path / "site", """
        [disttrain.models]
        tiny-classifier = userplug.zoo:model
        [disttrain.datasets]
        tiny-vectors = userplug.zoo:data
        """)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    config = load_config(None, {"training.model_architecture": "tiny-classifier",
                                "training.dataset": "tiny-vectors"})
    model = init_model(config.training)
    assert model[0].in_features == 8 and model[2].out_features == 2
    assert len(load_datasets(config.training)[0]) == 192


# argv after the strategy -> the one line the run must fail with.
MODEL_ERRORS = {
    "file missing": ("{tmp}/nowhere.py:model", "file {tmp}/nowhere.py does not exist"),
    "module missing": ("no_such_package.models:model", "no module named 'no_such_package.models'"),
    "name missing": ("{plugin}:nothing", "has no 'nothing'; define `def nothing(...)` there"),
    "not callable": ("{plugin}:NOT_CALLABLE", "is a int, not a callable factory"),
    "factory raises": ("{plugin}:raises", ":raises raised RuntimeError: the factory says no"),
    "not a module": ("{plugin}:not_a_module", "returned a str, not a torch.nn.Module"),
    "no trainable parameters": ("{plugin}:frozen", "returned a model with no trainable parameters"),
    "integer parameters": ("{plugin}:integer_parameters", "parameter 'steps' is torch.int64, not "
                           "floating point"),
    "mixed dtypes": ("{plugin}:mixed_dtypes", "parameters mix float32, float64; give them one dtype"),
    "unknown name": ("transformer", "'transformer' is not a registered model; use one of gpt_small, mlp"),
    "bad model_args": ("simplecnn", "simplecnn raised TypeError"),
}
DATASET_ERRORS = {
    "file missing": ("{tmp}/nowhere.py:data", "training.dataset: file {tmp}/nowhere.py does not exist"),
    "factory raises": ("{plugin}:raises", "training.dataset: {plugin}:raises raised TypeError"),
    "not a triple": ("{plugin}:no_description", "returned a tuple; return a tuple (train, test, "
                     "description)"),
    "empty": ("{plugin}:empty_data", "training.dataset: {plugin}:empty_data's train set is empty"),
    "no entry point": ("imagenet", "training.dataset: 'imagenet' must be one of mnist"),
}


def run_failing(argv, tmp_path, capsys) -> str:
    folders = ["--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    assert cli.main([*argv, *folders]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()  # nothing started
    return lines[0]


@pytest.mark.parametrize("case", list(MODEL_ERRORS))
def test_each_model_error_is_one_line_and_exit_2(case, plugin, tmp_path, capsys):
    spec, message = (text.format(tmp=tmp_path, plugin=plugin) for text in MODEL_ERRORS[case])
    data = f"{plugin}:data"
    extra = []
    if case == "bad model_args":  # a built-in model's builder raising is shown the same way
        data, extra = "digits", ["--set", "training.model_args={width: 3}"]
    line = run_failing(["baseline", "--model", spec, "--dataset", data, *extra], tmp_path, capsys)
    assert "training.model_architecture: " in line and message in line, line


def test_a_factorys_bug_is_shown_at_its_file_and_line(tmp_path, capsys):
    user = tmp_path / "mine.py"
    user.write_text("def build(description):\n    settings = {}\n    return settings['width']\n")
    line = run_failing(["baseline", "--model", f"{user}:build", "--dataset", "digits"], tmp_path, capsys)
    assert line.endswith(f":build raised KeyError: 'width' (at {user}:3, in build)"), line


@pytest.mark.parametrize("case", list(DATASET_ERRORS))
def test_each_data_set_error_is_one_line_and_exit_2(case, plugin, tmp_path, capsys):
    spec, message = (text.format(tmp=tmp_path, plugin=plugin) for text in DATASET_ERRORS[case])
    line = run_failing(["baseline", "--model", f"{plugin}:model", "--dataset", spec], tmp_path, capsys)
    assert message in line, line


def test_a_model_for_another_task_is_a_clear_error(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("abc " * 100)
    line = run_failing(["baseline", "--model", "simplecnn", "--dataset", f"text:{text}"], tmp_path, capsys)
    assert "simplecnn classifies images" in line and "language-model" in line
    line = run_failing(["baseline", "--model", "gpt_small", "--dataset", "digits"], tmp_path, capsys)
    assert "gpt_small is a language model" in line


def test_torchvision_without_the_extra_names_it(tmp_path, capsys):
    if "torchvision" in sys.modules or _importable("torchvision"):
        pytest.skip("torchvision is installed: the error without it cannot be shown")
    argv = ["baseline", "--model", "torchvision:resnet18", "--dataset", "digits"]
    line = run_failing(argv, tmp_path, capsys)
    assert "pip install 'disttrain[vision]'" in line


def _importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def test_a_description_must_say_what_the_data_set_is():
    assert DatasetDescription.coerce({"task": "language-model", "vocab_size": 256, "seq_len": 16},
                                     "x") == DatasetDescription.language_model(256, 16)
    with pytest.raises(ValueError, match="lacks 'seq_len'"):
        DatasetDescription.coerce({"task": "language-model", "vocab_size": 256}, "x")
    with pytest.raises(ValueError, match="x: task 'regression' must be one of"):
        DatasetDescription.coerce({"task": "regression", "input_shape": [3], "num_classes": 1}, "x")
    with pytest.raises(ValueError, match="the description is a list"):
        DatasetDescription.coerce([1, 2], "x")


def test_model_args_must_be_a_mapping_of_keyword_names():
    with pytest.raises(ConfigError, match="training.model_args: 3 is not a mapping"):
        load_config(None, {"training.model_args": 3})
    with pytest.raises(ConfigError, match="must be a mapping of keyword names"):
        load_config(None, {"training.model_args": {"not a name": 1}})


def test_mlp_takes_any_classification_input(plugin):
    model = init_model(TrainingConfig(model_architecture="mlp", dataset=f"{plugin}:data",
                                      mlp_hidden_size=4, mlp_num_layers=1))
    assert model(torch.zeros(3, 8)).shape == (3, 2)


def torchvision_or_skip():
    """torchvision, or a skip with the reason: not installed (the `vision` extra), or a build
    that does not import against this torch."""
    try:
        import torchvision
    except ModuleNotFoundError:
        pytest.skip("torchvision is not installed (the `vision` extra)")
    except Exception as e:  # a build for another torch: its operators fail to register
        pytest.skip(f"torchvision does not import against this torch ({type(e).__name__}: {e})")
    return torchvision


def test_a_torchvision_model_gets_the_classes_and_the_small_image_stem():
    torchvision_or_skip()
    from disttrain.training.models import build_for
    gray = DatasetDescription.classification((1, 32, 32), 7)
    model = build_for("torchvision:resnet18", gray, TrainingConfig())
    assert model.conv1.kernel_size == (3, 3) and model.conv1.in_channels == 1
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 7)
    with pytest.raises(ConfigError, match="torchvision has no model 'resnet7'"):
        build_for("torchvision:resnet7", DatasetDescription.classification((3, 32, 32), 7), TrainingConfig())


def test_the_torchvision_adaptation_on_a_stand_in_zoo(monkeypatch):
    """The zoo's models built for the data set (classes, small-image stem, channels), with a
    stand-in for torchvision.models where torchvision cannot be imported here."""
    import types

    from disttrain.training.vision import torchvision_model

    class ImagenetLike(torch.nn.Module):
        def __init__(self, num_classes):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 4, 7, stride=2, padding=3, bias=False)
            self.maxpool = torch.nn.MaxPool2d(3, stride=2, padding=1)
            self.fc = torch.nn.Linear(4, num_classes)

    models = types.SimpleNamespace(list_models=lambda: ["imagenet_like", "resnet18"],
                                   get_model=lambda name, weights, num_classes: ImagenetLike(num_classes))
    package = types.ModuleType("torchvision")
    package.models = models
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.models", models)
    small = torchvision_model("imagenet_like", DatasetDescription.classification((1, 32, 32), 5), {})
    assert small.conv1.kernel_size == (3, 3) and small.conv1.in_channels == 1 and small.fc.out_features == 5
    assert isinstance(small.maxpool, torch.nn.Identity)
    large = torchvision_model("imagenet_like", DatasetDescription.classification((1, 224, 224), 5), {})
    assert large.conv1.kernel_size == (7, 7) and large.conv1.in_channels == 1
    assert isinstance(large.maxpool, torch.nn.MaxPool2d)
    with pytest.raises(ConfigError, match="torchvision has no model 'vgg1'"):
        torchvision_model("vgg1", DatasetDescription.classification((3, 32, 32), 5), {})
    with pytest.raises(ConfigError, match="classifies images, but the data set is a language-model"):
        torchvision_model("resnet18", DatasetDescription.language_model(256, 8), {})


def test_dataset_args_reach_the_data_set_factory(plugin):
    train, _ = load_datasets(training(plugin, dataset_args={"num_train": 40}))
    assert len(train) == 40
    with pytest.raises(ConfigError, match="raised TypeError: .*unexpected keyword argument 'size'"):
        load_datasets(training(plugin, dataset_args={"size": 3}))
