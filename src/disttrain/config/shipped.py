"""The configs shipped inside the package (the repository's `configs/` folder is the same
files), found by name so an installed package runs `--config example` anywhere.

A shipped config's name is its file name without `.yaml`, and without `_config` where the
file name ends so (`example_config.yaml` is `example`); its description is its first
comment line.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

SUFFIX = ".yaml"
NAME_SUFFIX = "_config"


@dataclass(frozen=True)
class ShippedConfig:
    """One shipped config: its name, file and one-line description."""

    name: str
    path: Path
    description: str


def shipped_folder() -> Path:
    """The folder of the shipped configs inside the installed package."""
    return Path(str(files("disttrain") / "configs"))  # installed packages are folders on disk


def shipped_configs() -> list[ShippedConfig]:
    """Every shipped config, sorted by name."""
    configs = [ShippedConfig(_name(path), path, _description(path))
               for path in shipped_folder().glob(f"*{SUFFIX}")]
    return sorted(configs, key=lambda config: config.name)


def find_shipped(name: str) -> Path | None:
    """The file of the shipped config called `name` (its name, or its file name without
    `.yaml`); None when `name` is not a bare name or no shipped config has it."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    for config in shipped_configs():
        if name in (config.name, config.path.stem, config.path.name):
            return config.path
    return None


def _name(path: Path) -> str:
    stem = path.stem
    return stem[:-len(NAME_SUFFIX)] if stem.endswith(NAME_SUFFIX) and stem != NAME_SUFFIX else stem


def _description(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""
