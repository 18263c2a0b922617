"""Small objects, complete at construction: no function or constructor in `src/` takes more
than six parameters (self and cls not counted, keyword-only ones counted); what travels
together is a typed value (a frozen dataclass named from the domain), not a longer list."""

from __future__ import annotations

import ast
from pathlib import Path

import disttrain

SOURCE = Path(disttrain.__file__).parent
MAX_PARAMETERS = 6
# The public Python API: its keywords are what a user writes, as with Hugging Face's Trainer.
USER_FACING = {("api.py", "fit"), ("api.py", "compare")}


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = function.args
    count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    first = (args.posonlyargs + args.args)[:1]
    return count - (1 if first and first[0].arg in ("self", "cls") else 0)


def long_signatures(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if parameters(node) > MAX_PARAMETERS:
                where = path.relative_to(root).as_posix()
                if (where, node.name) not in USER_FACING:
                    found.append(f"{where}:{node.lineno} {node.name} ({parameters(node)} parameters)")
    return sorted(found)


def test_no_function_in_the_source_takes_more_than_six_parameters():
    assert long_signatures(SOURCE) == []


def test_the_check_counts_keywords_and_leaves_self_out(tmp_path):
    (tmp_path / "m.py").write_text(
        "class A:\n"
        "    def __init__(self, a, b, c, d, e, f): ...\n"
        "    def many(self, a, b, c, d, e, *, f, g): ...\n"
        "def fit(a, b, c, d, e, f, g): ...\n")
    assert long_signatures(tmp_path) == ["m.py:3 many (7 parameters)", "m.py:4 fit (7 parameters)"]


def test_every_exception_still_names_a_function_of_the_source():
    names = {(path.relative_to(SOURCE).as_posix(), node.name) for path in SOURCE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
    assert USER_FACING <= names
