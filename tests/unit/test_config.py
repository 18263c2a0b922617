"""Config schema: defaults, precedence, sections and the original config's `system.*`
spellings, renamed and unknown keys, the original rules, error lines."""

import dataclasses
import json

import pytest

from disttrain import cli
from disttrain.config import Config, config_from_dict, load_config, parse_set_expression
from disttrain.config.loading import RENAMED
from disttrain.core.errors import ConfigError


def test_defaults_validate():
    config = config_from_dict({})
    assert config.training.batch_size == 64
    assert config.system.architecture == "baseline"


def test_precedence_file_then_flags_then_set(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  batch_size: 32\n  learning_rate: 0.5\n  num_epochs: 3\n")
    config = load_config(path, {"training.batch_size": 16, "training.learning_rate": 0.25},
                         ["training.batch_size=128"])
    assert config.training.batch_size == 128  # --set wins over the flag and the file
    assert config.training.learning_rate == 0.25  # the flag wins over the file
    assert config.training.num_epochs == 3  # the file wins over the default


def test_json_files_load(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"system": {"num_workers": 4, "aggregation_mode": "ssp"}}))
    config = load_config(path)
    assert config.system.num_workers == 4 and config.ps.aggregation_mode == "ssp"


# Every field of the original config, spelled as its README gives it.
ORIGINAL_CONFIG = """
training:
  batch_size: 32
  learning_rate: 0.01
  num_epochs: 3
  dataset: mnist
  model_architecture: simplecnn
  checkpoint_interval: 50
system:
  num_workers: 4
  architecture: parameter_server
  aggregation_mode: async
  compression_enabled: true
  compression_type: topk
  compression_ratio: 0.1
  heartbeat_interval: 2.0
  heartbeat_timeout: 9.0
  checkpoint_dir: ckpt
  log_dir: logs
"""


def test_the_original_configs_system_keys_reach_their_components(tmp_path):
    path = tmp_path / "original.yaml"
    path.write_text(ORIGINAL_CONFIG)
    config = load_config(path)
    assert (config.training.batch_size, config.training.checkpoint_interval) == (32, 50)
    assert (config.system.num_workers, config.system.architecture) == (4, "parameter_server")
    assert (config.system.checkpoint_dir, config.system.log_dir) == ("ckpt", "logs")
    assert config.ps.aggregation_mode == "async"
    assert (config.compression.enabled, config.compression.type, config.compression.ratio) == (
        True, "topk", 0.1)
    assert (config.coordinator.heartbeat_interval, config.coordinator.heartbeat_timeout) == (2.0, 9.0)
    assert config == config_from_dict(config.to_dict())  # saved in the components' spelling


def test_a_later_layer_overrides_either_spelling(tmp_path):
    path = tmp_path / "original.yaml"
    path.write_text("system:\n  aggregation_mode: sync\n  compression_ratio: 0.5\n")
    config = load_config(path, {"ps.aggregation_mode": "ssp"}, ["system.compression_ratio=0.25"])
    assert (config.ps.aggregation_mode, config.compression.ratio) == ("ssp", 0.25)


def test_one_key_given_twice_in_one_file_is_refused():
    with pytest.raises(ConfigError, match="ps.aggregation_mode: the config also sets it as "
                                          "system.aggregation_mode"):
        config_from_dict({"system": {"aggregation_mode": "sync"}, "ps": {"aggregation_mode": "async"}})
    assert config_from_dict({"system": {"aggregation_mode": "ssp"},
                             "ps": {"aggregation_mode": "ssp"}}).ps.aggregation_mode == "ssp"


@pytest.mark.parametrize("renamed", sorted(RENAMED))
def test_a_renamed_key_is_one_line_naming_its_spelling_now(renamed):
    section, _, key = renamed.partition(".")
    with pytest.raises(ConfigError) as info:
        config_from_dict({section: {key: 1}})
    assert info.value.problems == [
        f"{renamed}: unknown key; it is {RENAMED[renamed]} now (write that instead)"]


def test_a_config_file_with_a_renamed_key_fails_its_check_with_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "setup_logging", lambda *args, **kwargs: None)
    path = tmp_path / "old.yaml"
    path.write_text("system:\n  num_workers: 2\n  staleness: 3\n")
    assert cli.main(["ps", "--config", str(path), "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--log-dir", str(tmp_path / "logs"), "--check-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        "error: system.staleness: unknown key; it is ps.staleness now (write that instead)"]


def test_nothing_writes_into_a_config():
    config = config_from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.system.num_workers = 8
    changed = config.replace(system={"num_workers": 8}, ps={"staleness": 0})
    assert (changed.system.num_workers, changed.ps.staleness) == (8, 0)
    assert config.system.num_workers == 2


def test_a_config_run_by_a_strategy_names_it():
    for strategy, architecture in (("baseline", "baseline"), ("ps", "parameter_server"), ("ddp", "ddp")):
        assert Config().run_by(strategy).system.architecture == architecture


@pytest.mark.parametrize("raw, fragment", [
    ({"training": {"batch_size": -5}}, "training.batch_size: -5 must be > 0"),
    ({"training": {"batch_size": "big"}}, "training.batch_size: 'big' is not an integer"),
    ({"training": {"batchsize": 3}}, "did you mean training.batch_size"),
    ({"trainng": {}}, "trainng: unknown section; did you mean training"),
    ({"training": {"dataset": "imagenet"}}, "training.dataset: 'imagenet' must be one of"),
    ({"training": {"model_architecture": " "}}, "must not be empty"),
    ({"system": {"compression_ratio": 0.0}}, "must be in (0, 1]"),
    ({"system": {"compression_ratio": 1.5}}, "must be in (0, 1]"),
    ({"system": {"compression_enabled": "yes"}}, "is not a boolean"),
    ({"system": {"heartbeat_interval": 5.0, "heartbeat_timeout": 5.0}},
     "system.heartbeat_timeout: 5.0 must be greater than system.heartbeat_interval"),
    ({"system": {"aggregation_mode": "lazy"}}, "system.aggregation_mode: 'lazy' must be one of sync"),
    ({"ps": {"aggregation_mode": "lazy"}}, "ps.aggregation_mode: 'lazy' must be one of sync"),
    ({"ps": {"backup_workers": 2}}, "ps.backup_workers: 2 must be less than system.num_workers"),
    ({"coordinator": {"heartbeat_timeout": 0.5}},
     "coordinator.heartbeat_timeout: 0.5 must be greater than coordinator.heartbeat_interval"),
    ({"system": {"compresion_ratio": 0.1}}, "did you mean system.compression_ratio"),
    ({"training": {"learning_rate": float("nan")}}, "must be a finite number"),
])
def test_bad_values_name_field_value_and_rule(raw, fragment):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert any(fragment in line for line in info.value.problems), info.value.problems


def test_every_problem_is_reported_once_per_line():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"training": {"batch_size": 0, "num_epochs": -1, "typo": 1}})
    assert len(info.value.problems) == 3


def test_set_expressions_are_typed():
    assert parse_set_expression("training.batch_size=128") == ("training.batch_size", 128)
    assert parse_set_expression("system.compression_enabled=true") == (
        "system.compression_enabled", True)
    assert parse_set_expression("training.max_train_samples=null") == (
        "training.max_train_samples", None)
    with pytest.raises(ConfigError):
        parse_set_expression("batch_size=3")


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("training: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listing)


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, {"training.dataset": "synthetic", "system.num_workers": 3})
    config.save(tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == config and isinstance(again, Config)
