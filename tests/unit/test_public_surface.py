"""benchmarks/ and tools/ use the project's public surface only, so that the package can be
reorganised behind its faces without breaking them.

The surface is declared, never inferred: a face is a package's `__init__` with an `__all__`
(or a strategy of one module, `strategies/NAME.py`, with its own), and it offers exactly
the names of its `__all__`. A script's `from disttrain.X import NAME` must name a face and
a name of its `__all__`; `import disttrain.X` must name a face. The scripts are parsed,
not run.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
from conftest import REPO_ROOT

SOURCE = REPO_ROOT / "src" / "disttrain"
SCRIPTS = sorted([*(REPO_ROOT / "benchmarks").glob("*.py"), *(REPO_ROOT / "tools").glob("*.py")])


def declared_all(path: Path) -> list[str] | None:
    """The names of a module's `__all__`, read from its source; None when it has none.

    Raises:
        ValueError: `__all__` is not a literal list or tuple of strings (a face is read
            without importing it, so it must be spelled out).
    """
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(target, ast.Name) and target.id == "__all__" for target in targets):
            try:
                names = ast.literal_eval(node.value)
            except ValueError as error:
                raise ValueError(f"{path}: spell __all__ out as a list of strings") from error
            if not all(isinstance(name, str) for name in names):
                raise ValueError(f"{path}: __all__ holds something other than names")
            return list(names)
    return None


def public_surface(source: Path = SOURCE) -> dict[str, set[str]]:
    """Face module name -> the names it offers, for every face under `source`."""
    candidates = [(".".join(init.parent.relative_to(source.parent).parts), init)
                  for init in source.rglob("__init__.py")]
    candidates += [(f"{source.name}.strategies.{path.stem}", path)
                   for path in (source / "strategies").glob("*.py") if path.name != "__init__.py"]
    surface = {}
    for module, path in candidates:
        names = declared_all(path)
        if names is not None:
            surface[module] = set(names)
    return surface


def _is_project(module: str) -> bool:
    return module == "disttrain" or module.startswith("disttrain.")


def private_imports(script: Path, surface: dict[str, set[str]]) -> list[str]:
    """Each import of `script` that reaches past the public surface, as `file:line: why`."""
    found = []
    fix = "import the names from the package's face, adding them to its __all__ if they belong there"

    def refuse(node: ast.AST, why: str) -> None:
        found.append(f"{script.name}:{node.lineno}: {why}")

    for node in ast.walk(ast.parse(script.read_text(), filename=str(script))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_project(alias.name) and alias.name not in surface:
                    refuse(node, f"import {alias.name}: not a face; {fix}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and _is_project(node.module):
            offered = surface.get(node.module)
            if offered is None:
                refuse(node, f"from {node.module} import ...: not a face; {fix}")
                continue
            for alias in node.names:
                if alias.name not in offered:
                    refuse(node, f"from {node.module} import {alias.name}: not in {node.module}.__all__; "
                                 "import it from the face that offers it, or add it there")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and _is_project(node.args[0].value) and node.args[0].value not in surface):
            refuse(node, f"import_module({node.args[0].value!r}): not a face; {fix}")
    return found


def test_the_scripts_are_found():
    names = {script.name for script in SCRIPTS}
    assert {"ps_load.py", "codec.py", "metrics_table.py", "proto.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_scripts_import_only_the_public_surface(script):
    assert private_imports(script, public_surface()) == []


# Lines a benchmark must not hold, each with what the check says of it.
PRIVATE_LINES = [
    ("from disttrain.strategies.ps.worker.client import PSClient",
     "from disttrain.strategies.ps.worker.client import ...: not a face"),
    ("import disttrain.core.auth", "import disttrain.core.auth: not a face"),
    ("from disttrain.strategies.ps import ShardState", "from disttrain.strategies.ps import ShardState: "
     "not in disttrain.strategies.ps.__all__"),
    ("from disttrain.training import train_step", "from disttrain.training import train_step: "
     "not in disttrain.training.__all__"),
    ("importlib.import_module('disttrain.strategies.ps.server.shard')",
     "import_module('disttrain.strategies.ps.server.shard'): not a face"),
]


@pytest.mark.parametrize("line, why", PRIVATE_LINES, ids=[line for line, _ in PRIVATE_LINES])
def test_a_benchmark_reaching_a_private_module_fails(tmp_path, line, why):
    benchmark = tmp_path / "ps_load.py"
    text = (REPO_ROOT / "benchmarks" / "ps_load.py").read_text()
    benchmark.write_text(f"{text}\n\ndef late():\n    {line}\n")
    last_line = len(benchmark.read_text().splitlines())
    found = private_imports(benchmark, public_surface())
    assert len(found) == 1 and found[0].startswith(f"ps_load.py:{last_line}: {why}"), found


def test_a_package_without_all_is_no_face(tmp_path):
    package = tmp_path / "disttrain"
    (package / "strategies" / "ps" / "worker").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "strategies" / "__init__.py").write_text("")
    (package / "strategies" / "baseline.py").write_text('__all__ = ["STRATEGY"]\nSTRATEGY = 1\n')
    (package / "strategies" / "ps" / "__init__.py").write_text('__all__ = ["PSClient"]\n')
    (package / "strategies" / "ps" / "worker" / "__init__.py").write_text('"""No face."""\n')
    assert public_surface(package) == {"disttrain.strategies.baseline": {"STRATEGY"},
                                       "disttrain.strategies.ps": {"PSClient"}}


@pytest.mark.timeout(120)
def test_every_face_offers_the_names_it_declares():
    missing = []
    for module, names in sorted(public_surface().items()):
        face = importlib.import_module(module)
        for name in sorted(names):
            # `from face import name` also finds a submodule named in __all__ but not yet imported
            if not hasattr(face, name) and importlib.util.find_spec(f"{module}.{name}") is None:
                missing.append(f"{module}.{name}")
    assert missing == []


def test_the_faces_the_scripts_rely_on_are_declared():
    surface = public_surface()
    assert {"PSClient", "RetryPolicy", "plan_shards", "flat_parameters", "start_servers", "ShardServer",
            "build_state"} <= surface["disttrain.strategies.ps"]
    assert surface["disttrain.strategies.ps.wire"] == {"codec", "service"}
    assert "disttrain.strategies.ps.worker" not in surface and "disttrain.strategies.ps.server" not in surface
