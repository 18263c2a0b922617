"""`make bench-quick` covers every benchmark, each has a quick mode, and each has the full
run's JSON shape recorded, which the quick runs of the slow tests are compared with.

The make targets are read as make expands them (`make -n`, nothing run), the scripts as
source (nothing imported): these checks take a second.
"""

import ast
import importlib.util
import json
import re
import shutil
import subprocess

import pytest
from conftest import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
SHAPES_TOOL = REPO_ROOT / "tools" / "bench_shapes.py"


def has_main(path) -> bool:
    """A benchmark script runs as `python benchmarks/NAME.py`; a helper module only is imported."""
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in ast.parse(path.read_text()).body)


def benchmark_scripts() -> set[str]:
    return {path.stem for path in BENCHMARKS.glob("*.py") if has_main(path)}


def make_dry_run(target: str) -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def loop_of(lines: list[str]) -> tuple[set[str], str]:
    """(the names the recipe's `for name in ...` loop runs, the command it runs for each)."""
    loops = [line for line in lines if line.startswith("for name in ")]
    assert len(loops) == 1, lines
    names, body = re.fullmatch(r"for name in ([^;]*); do (.*); done", loops[0]).groups()
    return set(names.split()), " ".join(body.split())


def test_the_benchmark_scripts_are_told_apart_from_the_helper_modules():
    scripts = benchmark_scripts()
    assert {"codec", "chaos", "ps_vs_allreduce"} <= scripts
    assert not {"common", "ps_helpers"} & scripts


@pytest.mark.parametrize("target, flags, folder", [
    pytest.param("bench-quick", "--quick ", "runs/bench-quick", id="bench-quick"),
    pytest.param("bench", "", "runs/bench", id="bench")])
def test_the_target_runs_every_benchmark_script(target, flags, folder):
    lines = make_dry_run(target)
    names, body = loop_of(lines)
    assert names == benchmark_scripts(), "the Makefile's BENCHMARKS leaves a script out or runs a helper"
    assert f"benchmarks/$name.py {flags}--output {folder}/$name.json || exit 1" in body
    assert any(line.endswith(f"tools/bench_shapes.py {folder}") for line in lines), lines


@pytest.mark.parametrize("name", sorted(benchmark_scripts()))
def test_every_benchmark_has_a_quick_mode(name):
    tree = ast.parse((BENCHMARKS / f"{name}.py").read_text())
    imports = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and node.module == "common" for alias in node.names}
    assert "parse_args" in imports, f"{name} does not take the common flags (--quick among them)"
    reads = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "quick"]
    assert reads, f"{name} accepts --quick but never reads it: its quick run would be its full run"


def test_common_flags_include_quick():
    tree = ast.parse((BENCHMARKS / "common.py").read_text())
    flags = {node.args[0].value for node in ast.walk(tree) if isinstance(node, ast.Call)
             and ast.unparse(node.func).endswith("add_argument") and isinstance(node.args[0], ast.Constant)}
    assert "--quick" in flags


def test_every_benchmark_has_its_full_json_shape_recorded():
    recorded = json.loads((BENCHMARKS / "shapes.json").read_text())
    missing = benchmark_scripts() - set(recorded)
    assert not missing, (f"no full-run shape for {sorted(missing)}: run `make bench`, then "
                         "`python tools/bench_shapes.py runs/bench --write`")
    for name, shape in recorded.items():
        assert {"benchmark", "environment"} <= set(shape), name


def load_shapes_tool():
    spec = importlib.util.spec_from_file_location("bench_shapes", SHAPES_TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shapes_differ_where_a_key_is_missing_at_any_depth():
    tool = load_shapes_tool()
    full = tool.shape({"ratio": 1.0, "sweep": [{"model": "a", "ratio": None}, {"model": "b", "ratio": 0.5}],
                       "runs": {"ps": {"accuracy": 0.9, "runs": [{"seed": 1}]}}})
    same = {"ratio": 2.0, "sweep": [{"model": "a", "ratio": 1.5}],
            "runs": {"ps": {"accuracy": 0.5, "runs": [{"seed": 1}, {"seed": 2}]}}}

    def against_full(document: dict) -> list[str]:
        return tool.differences(full, tool.shape(document))

    assert against_full(same) == []
    assert against_full({"ratio": 2.0, "runs": same["runs"]}) == ["the top level: missing key 'sweep'"]
    assert against_full({**same, "sweep": [{"model": "a"}]}) == ["sweep[]: missing key 'ratio'"]
    assert against_full({**same, "runs": {"ps": {"accuracy": 0.5, "runs": [{"seed": 1, "wall_s": 3}]}}}) == [
        "runs.ps.runs[]: extra key 'wall_s'"]
    assert against_full({**same, "runs": None}) == []  # null: a figure left out
    assert against_full({**same, "runs": [1]}) == ["runs: a list where the full run has an object"]


def test_a_list_item_shape_is_the_union_of_its_items():
    tool = load_shapes_tool()
    assert tool.shape([{"a": 1}, {"b": {"c": 2}}, {"b": None}]) == [{"a": None, "b": {"c": None}}]
    assert tool.differences(tool.shape({"x": []}), tool.shape({"x": [{"a": 1}]})) == []
