"""The order `make test` hands out the test files in: the slowest first, from the seconds
`tools/test_durations.py` reads from a `--durations` report into `tests/durations.json`."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import DURATIONS, REPO_ROOT, pytest_collection_modifyitems

from tools.test_durations import durations

REPORT = """\
============================== slowest durations ===============================
87.43s call     tests/integration/test_readme_blocks.py::test_the_runnable_blocks_run_as_written
56.79s setup    tests/integration/test_install.py::test_pip_install_then_train_on_digits
8.42s call     tests/integration/test_install.py::test_pip_install_then_train_on_digits
3.19s teardown tests/integration/test_ps_balance.py::test_a_worker[async-2]

(85 durations < 3s hidden.)
"""


def test_a_report_gives_each_file_its_seconds():
    assert durations(REPORT) == {"tests/integration/test_readme_blocks.py": 87.43,
                                 "tests/integration/test_install.py": 56.79 + 8.42,
                                 "tests/integration/test_ps_balance.py": 3.19}


class Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid


def test_the_slowest_files_come_first_each_in_its_own_order():
    seconds = json.loads(DURATIONS.read_text())
    slow, slower = sorted(seconds, key=seconds.get)[-2:]
    new = "tests/unit/test_new.py"  # not timed yet: after every timed file
    items = [Item(f"{file}::{name}") for file, name in ((new, "a"), (slow, "b"), (slower, "c"), (slow, "d"),
                                                        (new, "e"))]
    pytest_collection_modifyitems(items)
    assert [item.nodeid.rsplit("::", 1)[1] for item in items] == ["c", "b", "d", "a", "e"]


def test_every_file_timed_is_a_test_file_of_the_tree():
    stale = [name for name in json.loads(DURATIONS.read_text()) if not (REPO_ROOT / name).is_file()]
    assert not stale, f"{stale} are gone: run tools/test_durations.py on a new report (its doc says how)"
    assert all(Path(name).name.startswith("test_") for name in json.loads(DURATIONS.read_text()))
