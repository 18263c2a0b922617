"""The lock file `make` installs from agrees with pyproject.toml (the Dockerfile's use of it:
tests/integration/test_deploy_files.py)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCK = (REPO / "requirements.lock").read_text()


def pins() -> dict[str, str]:
    return {name.lower().replace("_", "-"): version
            for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", LOCK, re.M)}


def requirement_names(requirements: list[str]) -> list[str]:
    return [re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower().replace("_", "-") for line in requirements]


def test_lock_pins_every_dependency_of_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = requirement_names(project["dependencies"] + extras["test"] + extras["docs"])
    missing = [name for name in wanted if name not in pins()]
    assert wanted and not missing, f"not pinned in requirements.lock: {missing} (run make lock)"


def test_pyproject_gives_torch_a_range_and_the_lock_a_plain_version():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch = next(line for line in project["dependencies"] if line.startswith("torch"))
    assert ">=" in torch and "==" not in torch, "pyproject.toml: a range, so pip install . fits in"
    assert re.fullmatch(r"\d+\.\d+\.\d+", pins()["torch"]), "no local tag (+cpu): any index's build matches"

