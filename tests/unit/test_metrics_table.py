"""tools/metrics_table.py writes the vocabulary's tables into docs/metrics.md between its
markers, and touches nothing else."""

from __future__ import annotations

import pytest
from conftest import REPO_ROOT

from disttrain.metrics import keys

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def metrics_table(tool):
    return tool("metrics_table")


def test_it_points_at_the_metrics_page(metrics_table):
    assert metrics_table.PAGE == REPO_ROOT / "docs" / "metrics.md"


def test_it_writes_between_the_markers_alone(metrics_table, monkeypatch, tmp_path):
    page = tmp_path / "metrics.md"
    page.write_text(f"before\n{metrics_table.BEGIN}stale\n{metrics_table.END}after\n")
    monkeypatch.setattr(metrics_table, "PAGE", page)
    assert metrics_table.main() == 0
    assert page.read_text() == f"before\n{metrics_table.BEGIN}\n{keys.markdown()}\n{metrics_table.END}after\n"
    page.write_text("no markers\n")
    assert metrics_table.main() == 1 and page.read_text() == "no markers\n"
