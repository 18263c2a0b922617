"""The streamed push's figures in docs/benchmarks.md are those of the committed workloads
JSON (benchmarks/results/ps_streamed_push*.json), as tools/streamed_push_figures.py
writes them; other JSON gives other figures."""

from __future__ import annotations

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)


def test_the_page_holds_the_committed_figures(tool):
    figures = tool("streamed_push_figures")
    page = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    block = page.split(figures.BEGIN, 1)[1].split(figures.END, 1)[0]
    assert block == figures.render(figures.committed()), "run: python tools/streamed_push_figures.py"


def test_the_figures_are_the_runs(tool):
    figures = tool("streamed_push_figures")

    def run(step, blocked, share, samples):
        return {"step_time_s": step, "compute_s": step - blocked, "comm_s": blocked,
                "overlapped_share": share, "samples_per_s": samples}

    result = {"servers": 1, "results": {"resnet18": {"ps_sync_overlap": run(2.0, 0.2, 0.8, 16.0),
                                                     "ps_sync_no_overlap": run(1.6, 0.3, None, 20.0)}}}
    text = figures.render({"after": result})
    assert "| after (resnet18, 1 shard) | overlap (streamed) | 2.000 | 1.800 | 0.200 | 80% | 0.80 |" in text
    assert "| after (resnet18, 1 shard) | plain | 1.600 | 1.300 | 0.300 | 0% | 1.00 |" in text
