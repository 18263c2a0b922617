"""Two test modules of one file name in different folders are named before any test runs
(pytest would refuse to collect the second, and only a whole-suite run would see it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _tool():
    path = REPO_ROOT / "tools" / "test_names.py"
    spec = importlib.util.spec_from_file_location("test_names_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tree_has_no_two_test_modules_of_one_name():
    assert _tool().collisions(REPO_ROOT / "tests") == {}


def test_a_name_used_in_two_folders_is_named_with_both_files(tmp_path):
    for folder in ("unit", "integration"):
        (tmp_path / "tests" / folder).mkdir(parents=True)
        (tmp_path / "tests" / folder / "test_same.py").write_text("")
    (tmp_path / "tests" / "unit" / "test_other.py").write_text("")
    found = _tool().collisions(tmp_path / "tests")
    assert found == {"test_same.py": ["tests/integration/test_same.py", "tests/unit/test_same.py"]}
