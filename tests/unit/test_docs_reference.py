"""The generated reference pages are the code's: docs/reference/config.md names every key
of the config schema with its type, default, rule, the strategies that act on it and its
flags, and docs/reference/flags.md every flag of every command, both as
tools/docs_reference.py writes them from the schema, the usage rules and the parsers."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def reference():
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import docs_reference
    yield docs_reference
    sys.path.remove(str(REPO_ROOT / "tools"))
    sys.modules.pop("docs_reference", None)


@pytest.fixture(scope="module")
def pages(reference):
    return reference.pages()


def test_the_committed_pages_are_what_the_code_gives(reference, pages):
    for path, text in pages.items():
        stale = f"{path.relative_to(REPO_ROOT)} is stale: run python tools/docs_reference.py"
        assert path.read_text() == text, stale


def test_every_key_of_the_schema_has_a_row(reference):
    keys = [key.name for key in reference.schema_keys()]
    assert {"training.batch_size", "ps.overlap", "compression.pull_dense_every",
            "coordinator.address"} <= set(keys)
    assert reference.missing_keys(reference.CONFIG_PAGE.read_text()) == []


def test_a_key_missing_from_the_page_is_found(reference):
    page = reference.CONFIG_PAGE.read_text()
    without = "\n".join(line for line in page.splitlines() if not line.startswith("| `ps.staleness` |"))
    assert reference.missing_keys(without) == ["ps.staleness"]


def test_every_flag_of_every_command_has_a_row(reference):
    page = reference.FLAGS_PAGE.read_text()
    assert reference.missing_flags(page) == []
    names = [name for name, _ in reference.commands(reference.build_parser())]
    assert {"baseline", "ps", "ps-server", "ps-worker", "ddp", "compare", "token new"} <= set(names)


def test_a_flag_missing_from_the_page_is_found(reference):
    page = reference.FLAGS_PAGE.read_text()
    ddp = page.split("\n## disttrain ddp\n", 1)
    without = ddp[0] + "\n## disttrain ddp\n" + ddp[1].replace("| `--world-size` |", "| `--world-sighs` |", 1)
    assert reference.missing_flags(without) == ["ddp --world-size"]


def test_each_row_says_what_the_schema_and_the_parsers_say(reference):
    page = reference.CONFIG_PAGE.read_text()
    row = {line.split(" | ")[0].strip("| `"): line for line in page.splitlines() if line.startswith("| `")}
    assert "| `training.batch_size` | int | `64` | must be > 0 | baseline, ps, ddp | `--batch-size` |" in page
    assert "`--workers`, `--world-size`" in row["system.num_workers"]
    original = "Also spelled `system.aggregation_mode` (the original config's spelling)."
    assert original in row["ps.aggregation_mode"]
    assert "system.staleness" not in row["ps.staleness"]  # never the original config's
    assert "| must be in (0, 1] |" in row["compression.ratio"]


@pytest.mark.parametrize("key, acted_on_by", [
    ("training.batch_size", "baseline, ps, ddp"),
    ("training.momentum", "baseline, ps, ddp (with `training.optimizer: sgd`)"),
    ("ps.staleness", "ps (with `ps.aggregation_mode: ssp`)"),
    ("compression.ratio", "ps, ddp (with `compression.enabled: true`, `compression.type: topk`)"),
    ("compression.powersgd_rank", "ddp (with `compression.enabled: true`, `compression.type: powersgd`)"),
    ("compression.pull_ratio", "ps (with `compression.pull: topk`)"),
    ("coordinator.reassign_after", "ps"),
    ("coordinator.max_restarts", "ps"),
    ("training.outer_momentum", "ps, ddp (with `training.sync_every: 4`)"),
    ("system.architecture", "`disttrain train` (picks the strategy)"),
])
def test_the_strategies_acting_on_a_key_come_from_the_usage_rules(reference, key, acted_on_by):
    by_name = {k.name: k for k in reference.schema_keys()}
    assert reference.acted_on_by(by_name[key]) == acted_on_by


def test_every_key_is_acted_on_by_some_run(reference):
    assert [key.name for key in reference.schema_keys() if reference.acted_on_by(key) == "none"] == []


@pytest.mark.slow  # the reference built three times: seconds; make test runs it
def test_the_check_mode_names_a_stale_page(reference, monkeypatch, tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    monkeypatch.setattr(reference, "CONFIG_PAGE", stale)
    monkeypatch.setattr(reference, "FLAGS_PAGE", tmp_path / "flags.md")
    assert reference.main(["--check"]) == 1
    assert "is stale" in capsys.readouterr().err and stale.read_text() == "old\n"
    assert reference.main([]) == 0 and reference.main(["--check"]) == 0
