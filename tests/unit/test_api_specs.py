"""The Python API's pieces without a run: a callable turned into the spec other processes
import it by (or refused in one line saying what to do instead), keyword arguments turned
into config keys, strategy names into a command and its keys."""

from __future__ import annotations

import functools
import sys
import types
from pathlib import Path

import pytest
from torch import nn

import disttrain
from disttrain.api import config_layer, factory_spec, resolve_keys, strategy_settings
from disttrain.core.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

HERE = Path(__file__).resolve()
PS_FLAGS = {"servers": ("ps.num_servers", None), "max_restarts": ("coordinator.max_restarts", None),
            "no_overlap": ("ps.overlap", False)}


def build(description, hidden=8):
    return nn.Linear(4, hidden)


class Net(nn.Module):
    def __init__(self, description):
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def build(self, description):
        return self.layer

    @staticmethod
    def make(description):
        return nn.Linear(4, 2)


def always(module):
    return True


def never(module):
    return False


def refusal(factory, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        factory_spec(factory, "model", **kwargs)
    (line,) = caught.value.problems
    return line


def test_a_function_of_a_module_others_import_is_named_by_its_module():
    assert factory_spec(build, importable=always) == f"{__name__}:build"
    assert factory_spec(Net, "model", importable=always) == f"{__name__}:Net"


def test_a_function_of_a_module_only_this_process_imports_is_named_by_its_file():
    assert factory_spec(build, importable=never) == f"{HERE}:build"


def test_a_spec_string_is_kept_as_it_is():
    assert factory_spec("my_model.py:build", importable=never) == "my_model.py:build"


def test_a_script_s_function_is_named_by_the_script_file(monkeypatch, tmp_path):
    script = tmp_path / "train.py"
    main = types.ModuleType("__main__")
    main.__file__ = str(script)

    def model(description):
        return nn.Linear(4, 2)

    model.__module__, model.__qualname__ = "__main__", "model"
    main.model = model
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert factory_spec(model, importable=always) == f"{script.resolve()}:model"
    # `python -m package.script` keeps the name it can be imported by
    main.__spec__ = types.SimpleNamespace(name="package.script")
    assert factory_spec(model, importable=always) == "package.script:model"
    # an interactive session: no file to name
    del main.__file__, main.__spec__
    line = refusal(model, importable=always)
    assert line.startswith("model: model is defined where no file holds it") and ".py file" in line


def test_a_lambda_is_refused_with_its_place_and_what_to_do():
    factory = lambda description: nn.Linear(4, 2)  # noqa: E731
    line = refusal(factory, importable=always)
    assert line.startswith("model: a lambda (at ") and f":{factory.__code__.co_firstlineno})" in line
    assert "define it at module level" in line


def test_a_nested_function_is_refused_naming_the_function_it_is_inside():
    def inner(description):
        return nn.Linear(4, 2)

    line = refusal(inner, importable=always)
    assert line.startswith("model: inner (at ")
    assert "defined inside test_a_nested_function_is_refused_naming_the_function_it_is_inside" in line


@pytest.mark.parametrize(("factory", "words"), [
    (Net(None).build, "the bound method Net.build cannot be imported"),
    (Net.make, "Net.make"),
    (Net(None), "a Net instance cannot reach the other processes"),
    (functools.partial(build, hidden=4), "a callable partial object is neither a spec string nor a function"),
    (3, "a int object is neither"),
])
def test_what_a_spec_cannot_name_is_refused_in_one_line(factory, words):
    line = refusal(factory, importable=always)
    assert words in line and "module level" in line, line


def test_a_function_its_module_no_longer_holds_is_refused(monkeypatch):
    original = build
    monkeypatch.setattr(sys.modules[__name__], "build", always)  # the name now holds another function
    line = refusal(original, importable=always)
    assert line == (f"model: {__name__}.build is not what its module holds under that name (renamed, "
                    f"redefined or deleted), so other processes cannot import it; pass the module's "
                    f"own build")


def test_keywords_become_config_keys():
    keys = resolve_keys({"model": build, "data": "digits", "workers": 3, "epochs": 2, "batch_size": 32,
                         "training": {"learning_rate": 0.1}, "servers": 2, "staleness": 1,
                         "no_overlap": True, "max_restarts": 0}, PS_FLAGS)
    assert keys == {"training.model_architecture": f"{HERE}:build", "training.dataset": "digits",
                    "system.num_workers": 3, "training.num_epochs": 2, "training.batch_size": 32,
                    "training.learning_rate": 0.1, "ps.num_servers": 2, "ps.staleness": 1,
                    "ps.overlap": False, "coordinator.max_restarts": 0}


def test_a_switch_given_false_is_not_given():
    assert resolve_keys({"no_overlap": False}, PS_FLAGS) == {}


@pytest.mark.parametrize(("given", "line"), [
    ({"batch_sise": 32}, "batch_sise: unknown config key, section or flag; did you mean batch_size? "),
    ({"max_restarts": 1}, "max_restarts: a key of several sections (ddp, coordinator); give it as "
                          "ddp={'max_restarts': ...}"),
    ({"training": 3}, "training: expected a mapping of its keys, e.g. training={...}; got 3"),
    ({"epochs": 2, "training": {"num_epochs": 3}}, "training['num_epochs']: sets training.num_epochs, "
                                                    "which epochs sets to 2 already; give it once"),
    ({"no_overlap": "yes"}, "no_overlap: a switch (--no-overlap); give True or False, not 'yes'"),
])
def test_a_bad_keyword_is_one_line(given, line):
    flags = {} if "max_restarts" in given else PS_FLAGS
    with pytest.raises(ConfigError) as caught:
        resolve_keys(given, flags)
    assert caught.value.problems[0].startswith(line), caught.value.problems


def test_every_bad_keyword_is_said_at_once():
    with pytest.raises(ConfigError) as caught:
        resolve_keys({"batch_sise": 32, "model": lambda d: d}, {})
    assert len(caught.value.problems) == 2


def test_a_config_mapping_is_a_layer_of_keys_with_its_factories_named(monkeypatch):
    assert config_layer("example") == ("example", {})
    layer = {"training": {"model_architecture": build}, "system": {"aggregation_mode": "ssp"}}
    assert config_layer(layer) == (
        None, {"training.model_architecture": f"{HERE}:build", "ps.aggregation_mode": "ssp"})
    with pytest.raises(ConfigError, match="trainig: unknown section; did you mean training"):
        config_layer({"trainig": {}})


@pytest.mark.parametrize(("name", "command", "keys"), [
    ("baseline", "baseline", {}),
    ("ps", "ps", {}),
    ("ps-async", "ps", {"ps.aggregation_mode": "async"}),
    ("ps+topk", "ps", {"compression.enabled": True, "compression.type": "topk"}),
    ("ddp+powersgd", "ddp", {"compression.enabled": True, "compression.type": "powersgd"}),
    ("ps-ssp+int8", "ps", {"ps.aggregation_mode": "ssp", "compression.enabled": True,
                           "compression.type": "quantization"}),
])
def test_a_strategy_name_is_a_command_and_its_keys(name, command, keys):
    assert strategy_settings(name) == (command, keys)


@pytest.mark.parametrize(("name", "line"), [
    ("horovod", "strategy: unknown strategy 'horovod'; use one of baseline, ps, ps-sync, ps-ssp, "
                "ps-async, ddp;"),
    ("baseline+topk", "strategy: 'baseline+topk': the baseline sends no gradients to compress"),
    ("ps-sync+powersgd", "strategy: 'ps-sync+powersgd': powersgd compresses DDP's all-reduce only"),
])
def test_a_bad_strategy_is_one_line(name, line):
    with pytest.raises(ConfigError) as caught:
        strategy_settings(name)
    assert str(caught.value).startswith(line)


def test_the_api_is_at_the_top_of_the_package():
    assert disttrain.fit is disttrain.api.fit and disttrain.ConfigError is ConfigError
    with pytest.raises(AttributeError, match="has no attribute 'fitt'"):
        disttrain.fitt  # noqa: B018
