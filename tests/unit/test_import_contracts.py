"""The import contracts are checked: `lint-imports` keeps every one on this tree, and on a
copy of the tree where one import breaks a contract, it names that contract as broken:
a strategy importing another, the core importing the CLI, a pure core reaching gRPC, a
socket or a servicer, gRPC outside the transport modules, torch.distributed outside DDP."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO_ROOT

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _load_contract_types():
    """tools/import_contracts.py, loaded from its file (tools/ is no package of the tests)."""
    path = REPO_ROOT / "tools" / "import_contracts.py"
    spec = importlib.util.spec_from_file_location("import_contracts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lint_imports(source_root: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(source_root)}
    # run from the config's folder: the contract types of tools/ are imported from there
    return subprocess.run([str(LINT_IMPORTS), str(config), "--no-cache"], cwd=config.parent,
                          env=env, capture_output=True, text=True, timeout=120)


def broken_section(output: str) -> str:
    """The part of lint-imports' report that details the broken contracts ('' if none)."""
    return output.split("Broken contracts", 1)[1] if "Broken contracts" in output else ""


def copy_tree(root: Path) -> Path:
    """The package, the contract types and the contracts, copied under `root`."""
    shutil.copytree(REPO_ROOT / "src" / "disttrain", root / "src" / "disttrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tools").mkdir()
    shutil.copy(REPO_ROOT / "tools" / "import_contracts.py", root / "tools" / "import_contracts.py")
    shutil.copy(REPO_ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.fixture
def tree_copy(tmp_path) -> Path:
    return copy_tree(tmp_path)


@pytest.mark.timeout(120)
def test_the_tree_keeps_every_contract():
    result = lint_imports(REPO_ROOT / "src", REPO_ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    contracts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"{len(contracts)} kept, 0 broken" in result.stdout


# The start of each contract's name in pyproject.toml.
PEERS, LAYERS, PS_PARTS = "Strategies are peers", "Layers", "The parameter server's parts"
PURE = "Pure cores import no transport"
GRPC, DISTRIBUTED = "gRPC only in the transport modules", "torch.distributed only in the DDP strategy"

# (module, the line appended to it, the contract it breaks)
BREAKAGES = [
    ("strategies/baseline.py", "import disttrain.strategies.ps.worker.client", PEERS),
    ("training/loop.py", "import disttrain.cli.flags", LAYERS),
    ("core/checkpoint.py", "from disttrain.metrics import keys", LAYERS),
    ("strategies/ps/worker/exchange.py", "import disttrain.strategies.ps.server.shard", PS_PARTS),
    ("strategies/ps/wire/codec.py", "import disttrain.strategies.ps.worker.client", PS_PARTS),
    # a pure core importing gRPC, a wire message or a servicer, itself or through a helper
    ("strategies/ps/server/members.py", "import grpc", PURE),
    ("coordinator/membership.py", "from disttrain.proto import coordinator_pb2", PURE),
    ("strategies/ps/server/barriers.py", "import disttrain.strategies.ps.server.servicer", PURE),
    ("training/rebalance.py", "from disttrain.core import deadlines", PURE),
    ("data/planned.py", "import socket", PURE),
    # gRPC in a module that is not a transport module
    ("metrics/summary.py", "import grpc", GRPC),
    ("training/loop.py", "from grpc_health.v1 import health", GRPC),
    # torch.distributed outside DDP, however it is spelled
    ("metrics/window.py", "import torch.distributed", DISTRIBUTED),
    ("strategies/ps/worker/exchange.py", "from torch import distributed", DISTRIBUTED),
    ("training/engine.py", "WORLD = torch.distributed.is_available()", DISTRIBUTED),
]


@pytest.fixture(scope="module")
def broken_tree(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict[tuple[str, str], int]]:
    """One copy of the tree with every breakage appended, checked once (lint-imports takes
    seconds, and it reports every broken contract with each import that breaks it): the
    result, and the line number of each (module, line) appended."""
    root = copy_tree(tmp_path_factory.mktemp("tree"))
    numbers = {}
    for module, line, _ in BREAKAGES:
        path = root / "src" / "disttrain" / module
        text = path.read_text()
        path.write_text(text + f"\n{line}  # noqa: E402\n")
        numbers[(module, line)] = text.count("\n") + 2
    return lint_imports(root / "src", root / "pyproject.toml"), numbers


def contract_section(output: str, prefix: str) -> str:
    """The part of the report on broken contracts under the contract whose name starts with
    `prefix`, up to the next contract's name, whitespace collapsed (the report wraps lines)."""
    text = " ".join(broken_section(output).split())
    contracts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    names = [" ".join(c["name"].split()) for c in contracts]
    (name,) = [n for n in names if n.startswith(prefix)]
    start = text.find(name)
    assert start >= 0, f"{prefix} is not named broken: {text[-3000:]}"
    ends = [text.find(other) for other in names if text.find(other) > start]
    return text[start:min(ends, default=len(text))]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("module, line, broken", BREAKAGES, ids=[f"{m}: {line}" for m, line, _ in BREAKAGES])
def test_breaking_a_contract_fails_the_check(broken_tree, module, line, broken):
    """The appended line itself is named under the contract it breaks, by its line number."""
    result, numbers = broken_tree
    assert result.returncode != 0
    number = numbers[(module, line)]
    section = contract_section(result.stdout, broken)
    if broken == DISTRIBUTED:  # this contract names the offending line
        named = f"line {number}: {line}" in section
    else:  # the others name each import of a chain: importer -> imported (l.N)
        importer = "disttrain." + module.removesuffix(".py").replace("/", ".")
        named = re.search(rf"{re.escape(importer)} -> \S+ \(l\.{number}\b", section) is not None
    assert named, section[-3000:] + result.stderr[-3000:]


def test_every_contract_has_a_breakage():
    contracts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    broken = {prefix for _, _, prefix in BREAKAGES}
    assert [c["name"] for c in contracts if not any(c["name"].startswith(p) for p in broken)] == []


@pytest.mark.timeout(120)
def test_an_allowed_module_that_no_longer_uses_torch_distributed_breaks_the_contract(tree_copy):
    powersgd = tree_copy / "src" / "disttrain" / "compression" / "powersgd.py"
    text = powersgd.read_text()
    # the import statement, whether on one line or in parentheses over several
    statement = re.search(r"^from torch\.distributed\S* import (\([^)]*\)|.*)$", text, re.MULTILINE)
    names = [n.strip() for n in statement[1].strip("()").replace("\n", " ").split(",") if n.strip()]
    powersgd.write_text(text.replace(statement[0], " = ".join([*names, "None"])))
    result = lint_imports(tree_copy / "src", tree_copy / "pyproject.toml")
    assert result.returncode != 0
    assert "disttrain.compression.powersgd is allowed to use torch.distributed but does not" in result.stdout


def test_uses_of_finds_every_spelling_and_nothing_else():
    source = '''"""Mentions torch.distributed in a docstring only."""
import torch
import torch.distributed as dist
from torch.distributed.elastic import rendezvous
from torch import distributed, nn
from torch.distributions import Normal

x = torch.distributed.is_available()
y = torch.nn.Linear(1, 1)
z = "torch.distributed"
'''
    uses = _load_contract_types().uses_of(source, "torch.distributed")
    assert [line for line, _ in uses] == [3, 4, 5, 8]
    assert uses[0][1] == "import torch.distributed as dist"
