"""The layout section of docs/architecture.md tells the tree as it is: it names every package of
src/disttrain (each folder with an `__init__.py`), and every folder or module it names
under src/disttrain exists."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO_ROOT

SOURCE = REPO_ROOT / "src" / "disttrain"
LAYOUT_PAGE = REPO_ROOT / "docs" / "architecture.md"
ROOT = "src/disttrain/"
# An entry of the tree: a folder or module name at the start of its line, then its
# description after two spaces or more (a description's wrapped lines have no such name).
ENTRY = re.compile(r"^( *)(\S+/|\S+\.py)(?: {2,}|$)")


def layout_block(page: str) -> str:
    """The code block of the page's `## Layout` section."""
    section = page.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```\n", 2)[1]


def named_paths(block: str) -> set[str]:
    """Every path the tree names under src/disttrain/, relative to it (`strategies/ps/wire/`,
    `strategies/baseline.py`), from each entry's name and the indentation of its parents."""
    paths, parents = set(), []  # parents: (indent, path) of the entries enclosing this line
    for line in block.splitlines():
        match = ENTRY.match(line)
        if not match:
            continue
        indent, name = len(match[1]), match[2]
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = (parents[-1][1] if parents else "") + name
        parents.append((indent, path))
        if path.startswith(ROOT) and path != ROOT:
            paths.add(path.removeprefix(ROOT))
    return paths


def packages(source: Path = SOURCE) -> set[str]:
    return {f"{init.parent.relative_to(source).as_posix()}/" for init in source.rglob("__init__.py")
            if init.parent != source}


def test_the_layout_names_every_package():
    named = named_paths(layout_block(LAYOUT_PAGE.read_text()))
    assert {f"strategies/ps/{part}/" for part in ("wire", "server", "worker", "run")} <= named
    assert sorted(packages() - named) == []


def test_everything_the_layout_names_exists():
    named = named_paths(layout_block(LAYOUT_PAGE.read_text()))
    assert sorted(path for path in named if not (SOURCE / path).exists()) == []


def test_a_package_missing_from_the_layout_is_found(tmp_path):
    block = """src/disttrain/
  core/         errors, logs
  strategies/   peers:
    baseline.py   one process
    ps/           the parameter server:
      wire/         codec, service
      run/          the processes
proto/disttrain/v1/   the wire contract
"""
    for package in ("core", "strategies", "strategies/ps", "strategies/ps/wire", "strategies/ps/run",
                    "strategies/ps/server"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    named = named_paths(block)
    assert named == {"core/", "strategies/", "strategies/baseline.py", "strategies/ps/",
                     "strategies/ps/wire/", "strategies/ps/run/"}
    assert packages(tmp_path) - named == {"strategies/ps/server/"}
