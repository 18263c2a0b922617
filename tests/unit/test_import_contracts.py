"""The layering is a checked contract: `lint-imports` keeps it on this tree and fails on
a copy of the tree where a strategy imports another or the core imports the CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO_ROOT

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(source_root: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(source_root)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(config), "--no-cache"], cwd=config.parent,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree_copy(tmp_path) -> Path:
    shutil.copytree(REPO_ROOT / "src" / "disttrain", tmp_path / "src" / "disttrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.timeout(120)
def test_the_tree_keeps_every_contract():
    result = lint_imports(REPO_ROOT / "src", REPO_ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout[-3000:]
    contracts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"{len(contracts)} kept, 0 broken" in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module, line, broken", [
    ("strategies/baseline.py", "import disttrain.strategies.ps.worker.client", "Strategies are peers"),
    ("training/loop.py", "import disttrain.cli.flags", "Layers"),
    ("core/checkpoint.py", "from disttrain.metrics import keys", "Layers"),
    ("strategies/ps/worker/exchange.py", "import disttrain.strategies.ps.server.shard", "server.s parts"),
    ("strategies/ps/wire/codec.py", "import disttrain.strategies.ps.worker.client", "server.s parts"),
])
def test_breaking_a_contract_fails_the_check(tree_copy, module, line, broken):
    path = tree_copy / "src" / "disttrain" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402\n")
    result = lint_imports(tree_copy / "src", tree_copy / "pyproject.toml")
    assert result.returncode != 0
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout, result.stdout[-3000:]
