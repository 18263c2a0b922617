"""Shipped configs: the repository's configs/ is the packaged folder, every shipped config
validates, a bare name given to --config finds one, the wheel's package data holds them."""

import fnmatch
import tomllib
from pathlib import Path

import pytest
import torch

from disttrain.config import load_config
from disttrain.config.shipped import find_shipped, shipped_configs, shipped_folder
from disttrain.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_repository_configs_folder_is_the_packaged_one():
    assert (ROOT / "configs").resolve() == shipped_folder().resolve()
    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == \
        sorted(c.path.name for c in shipped_configs())


def test_every_shipped_config_validates_and_has_a_description():
    configs = shipped_configs()
    assert len(configs) >= 7
    for config in configs:
        assert load_config(config.name).training.batch_size > 0
        assert config.description and "\n" not in config.description


def test_names_resolve_to_shipped_files():
    assert find_shipped("example").name == "example_config.yaml"
    assert find_shipped("example_config") == find_shipped("example")
    assert find_shipped("ps_sync_mnist").name == "ps_sync_mnist.yaml"
    assert find_shipped("ps_sync_mnist.yaml").name == "ps_sync_mnist.yaml"
    for not_a_name in ("nope", "", "../configs/ps_sync_mnist", "configs/ps_sync_mnist", ".hidden"):
        assert find_shipped(not_a_name) is None


def test_a_file_of_that_name_wins_over_the_shipped_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("example").write_text("training:\n  batch_size: 7\n")
    assert load_config("example").training.batch_size == 7
    assert load_config("ps_sync_mnist").system.num_workers == 2  # no such file: the shipped one


def test_unknown_name_is_one_line_naming_the_shipped_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_config("exampel")
    assert len(error.value.problems) == 1
    assert "'exampel' does not exist or is not a file, nor the name of a shipped config" in str(error.value)
    assert "example" in str(error.value) and "disttrain configs" in str(error.value)


def test_package_data_ships_every_config_and_the_typing_marker():
    package = ROOT / "src" / "disttrain"
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = [str(p.relative_to(package)) for p in package.joinpath("configs").iterdir()] + ["py.typed"]
    assert (package / "py.typed").is_file()
    for name in shipped:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns["disttrain"]), name
