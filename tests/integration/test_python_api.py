"""`disttrain.fit` from Python: a user's factories, defined in a module of their own or in
the script that calls it, train under the baseline, the parameter server and DDP, and the
summary returned is the run's (every sample applied once; the accuracy is the saved
model's on the test set). Bad input is a ConfigError raised before anything starts."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

import disttrain
from disttrain.api import factory_spec
from disttrain.metrics.summary import RunSummary

pytestmark = pytest.mark.timeout(240)

SAMPLES = 256  # training samples of each run: 8 batches of 32 in one process, 4 per worker of two
BATCH = 32
FACTORIES = '''
import torch
from torch import nn


def digits_data():
    """disttrain's digits, as a user's map-style data sets of (image, label) pairs."""
    from disttrain.data.datasets import digits
    train, test = digits()
    description = {"task": "classification", "input_shape": [1, 8, 8], "num_classes": 10}
    return (torch.utils.data.TensorDataset(train.images, train.labels),
            torch.utils.data.TensorDataset(test.images, test.labels), description)


def small_mlp(description, hidden=32):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(),
                         nn.Linear(hidden, description.num_classes))


def broken(description):
    return {}["width"]
'''


@pytest.fixture
def factories(tmp_path, monkeypatch) -> ModuleType:
    """The user's module `api_factories`, imported from a folder only this process has on
    its path (as a test runner or a script's folder puts it), the test in another folder."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "api_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "api_factories", raising=False)
    module = importlib.import_module("api_factories")
    yield module
    sys.modules.pop("api_factories", None)


def test_a_function_is_named_as_a_fresh_process_finds_it(factories, tmp_path, monkeypatch):
    file = tmp_path / "user" / "api_factories.py"
    assert factory_spec(factories.small_mlp) == f"{file}:small_mlp"  # not on a fresh process's path
    monkeypatch.chdir(file.parent)  # a fresh process finds it by name from here
    assert factory_spec(factories.small_mlp) == "api_factories:small_mlp"
    from disttrain.data.datasets import digits
    assert factory_spec(digits) == "disttrain.data.datasets:digits"


def saved_model_accuracy(module: ModuleType, checkpoint: Path) -> float:
    """The accuracy of the run's saved model on the test set, computed here, apart from the run."""
    model = module.small_mlp(SimpleNamespace(num_classes=10))
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    _, test, _ = module.digits_data()
    inputs, labels = test.tensors
    with torch.no_grad():
        predicted = model.eval()(inputs).argmax(dim=1)
    return (predicted == labels).sum().item() / len(labels)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("strategy", "flags", "final_model", "steps"), [
    ("baseline", {}, "baseline_final.pt", SAMPLES // BATCH),
    # ps through fit: test_the_readme_example_runs_as_written
    pytest.param("ps-sync", {"servers": 2}, "parameter_server_final.pt", SAMPLES // BATCH // 2,
                 marks=pytest.mark.extended),
    ("ddp", {}, "ddp_final.pt", SAMPLES // BATCH // 2),
])
def test_fit_trains_a_user_s_factories_and_returns_the_run_s_summary(factories, tmp_path, strategy, flags,
                                                                      final_model, steps):
    summary = disttrain.fit(factories.small_mlp, factories.digits_data, strategy=strategy, workers=2,
                            epochs=1, max_train_samples=SAMPLES, num_threads=1, log_dir=tmp_path / "logs",
                            checkpoint_dir=tmp_path / "ckpt",
                            training={"batch_size": BATCH, "learning_rate": 0.01}, **flags)
    assert isinstance(summary, RunSummary) and summary.strategy == strategy
    assert summary.config["training"]["model_architecture"] == f"{factories.__file__}:small_mlp"
    assert summary.world_size == (1 if strategy == "baseline" else 2)
    assert summary.samples_processed == SAMPLES and summary.steps == steps
    if strategy == "ps-sync":  # from the shards' ledgers: every sample applied once
        assert summary.extra["samples_applied"] == SAMPLES
        assert summary.extra["samples_lost"] == summary.extra["samples_redone"] == 0
    assert summary.final_accuracy == saved_model_accuracy(factories, tmp_path / "ckpt" / final_model)
    assert summary.final_accuracy > 0.3  # trained: one in ten is chance
    assert RunSummary.read(tmp_path / "logs" / "summary.json").final_accuracy == summary.final_accuracy


SCRIPT = '''
import sys
import disttrain
from torch import nn


def model(description):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, description.num_classes))


if __name__ == "__main__":
    summary = disttrain.fit(model, "digits", strategy="ps", workers=2, epochs=1, servers=1,
                            max_train_samples=128, num_threads=1, log_dir=sys.argv[1] + "/logs",
                            checkpoint_dir=sys.argv[1] + "/ckpt")
    print("applied", summary.extra["samples_applied"], summary.config["training"]["model_architecture"])
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_script_s_own_function_reaches_the_workers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=200, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"applied 128 {script}:model" in done.stdout, done.stdout


@pytest.mark.parametrize(("model", "kwargs", "line"), [
    (lambda description: None, {}, "model: a lambda (at "),
    ("api_factories.py:small_mlp", {"batch_sise": 32},
     "batch_sise: unknown config key, section or flag; did you mean batch_size?"),
    ("api_factories.py:small_mlp", {"batch_size": 0}, "training.batch_size: 0 must be > 0"),
    ("api_factories.py:small_mlp", {"strategy": "horovod"}, "strategy: unknown strategy 'horovod'"),
    ("api_factories.py:broken", {}, "training.model_architecture: api_factories.py:broken raised "
                                    "KeyError: 'width' (at "),
])
def test_bad_input_is_a_config_error_raised_before_anything_starts(factories, tmp_path, monkeypatch,
                                                                   model, kwargs, line):
    monkeypatch.chdir(tmp_path / "user")
    with pytest.raises(disttrain.ConfigError) as caught:
        disttrain.fit(model, factories.digits_data, log_dir=tmp_path / "logs",
                      checkpoint_dir=tmp_path / "ckpt", **kwargs)
    problems = caught.value.problems
    assert len(problems) == 1 and problems[0].startswith(line), problems
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()


def test_the_line_of_a_lambda_says_where_it_is_and_what_to_do(factories, tmp_path):
    factory = lambda description: None  # noqa: E731
    with pytest.raises(disttrain.ConfigError) as caught:
        disttrain.fit(factory, factories.digits_data, log_dir=tmp_path / "logs")
    here = Path(__file__).resolve()
    shown = here.relative_to(Path.cwd()) if here.is_relative_to(Path.cwd()) else here
    assert str(caught.value) == textwrap.dedent(f"""\
        model: a lambda (at {shown}:{factory.__code__.co_firstlineno}) cannot be imported by other \
processes; define it at module level (def name(...)) and pass that function""")


README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(marker: str) -> str:
    """The body of the README's fenced block right after the line `<!-- MARKER -->`."""
    found = re.search(rf"^<!-- {re.escape(marker)} -->\n```\w*\n(.*?)^```$", README.read_text(), re.M | re.S)
    assert found, f"no block after <!-- {marker} --> in the README"
    return found[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_example_runs_as_written(tmp_path):
    (tmp_path / "my_model.py").write_text(readme_block("runnable: my_model.py"))
    (tmp_path / "train.py").write_text(readme_block("python example: train.py"))
    done = subprocess.run([sys.executable, "train.py"], capture_output=True, text=True, timeout=280,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = RunSummary.read(tmp_path / "runs" / "fit" / "summary.json")
    assert f"{summary.extra['samples_applied']} samples applied" in done.stdout
    assert summary.extra["samples_applied"] == summary.samples_processed == 4096
    assert summary.config["training"]["model_args"] == {"hidden": 32}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compare_runs_each_strategy_and_returns_their_summaries(factories, tmp_path):
    runs = disttrain.compare(factories.small_mlp, factories.digits_data, output_dir=tmp_path / "cmp",
                             strategies=["baseline", "ps-async"], workers=2, epochs=1,
                             max_train_samples=SAMPLES, num_threads=1)
    assert list(runs) == ["baseline", "ps-async"]
    assert [summary.strategy for summary in runs.values()] == ["baseline", "ps-async"]
    assert all(summary.samples_processed == SAMPLES for summary in runs.values())
    assert runs["ps-async"].extra["samples_applied"] == SAMPLES
    assert runs["ps-async"].config["ps"]["aggregation_mode"] == "async"
    assert (tmp_path / "cmp" / "report.html").is_file()


def test_compare_refuses_an_unknown_strategy_before_anything_starts(factories, tmp_path):
    with pytest.raises(disttrain.ConfigError, match="--strategies: unknown strategy 'horovod'"):
        disttrain.compare(factories.small_mlp, factories.digits_data, output_dir=tmp_path / "cmp",
                          strategies="baseline,horovod")
    assert not (tmp_path / "cmp").exists()
