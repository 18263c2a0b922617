"""The workloads benchmark's tables in docs/benchmarks.md (the streamed push; the sync PS
against a plain torch DDP loop) are those of the committed JSON (benchmarks/results/), as
tools/workloads_figures.py writes them; other JSON gives other figures."""

from __future__ import annotations

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", ["streamed-push", "torch-ddp"])
def test_the_page_holds_the_committed_figures(tool, name):
    figures = tool("workloads_figures")
    render, committed = figures.TABLES[name]
    begin, end = figures.markers(name)
    page = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    block = page.split(begin, 1)[1].split(end, 1)[0]
    assert block == render(committed()), "run: python tools/workloads_figures.py"


def test_the_streamed_push_figures_are_the_runs(tool):
    figures = tool("workloads_figures")

    def run(step, blocked, share, samples):
        return {"step_time_s": step, "compute_s": step - blocked, "comm_s": blocked,
                "overlapped_share": share, "samples_per_s": samples}

    result = {"servers": 1, "results": {"resnet18": {"ps_sync_overlap": run(2.0, 0.2, 0.8, 16.0),
                                                     "ps_sync_no_overlap": run(1.6, 0.3, None, 20.0)}}}
    text = figures.render_streamed_push({"after": result})
    assert "| after (resnet18, 1 shard) | overlap (streamed) | 2.000 | 1.800 | 0.200 | 80% | 0.80 |" in text
    assert "| after (resnet18, 1 shard) | plain | 1.600 | 1.300 | 0.300 | 0% | 1.00 |" in text


def test_the_torch_ddp_figures_are_the_runs(tool):
    figures = tool("workloads_figures")

    def run(steps, repeats, ratios):
        workload = {"steps_per_process": steps}
        return {"repeats": repeats, "workloads": {"resnet18": workload, "gpt_small": workload},
                "ps_vs_ddp": {model: {s: {"torch_ddp_ratio": r}
                                      for s, r in zip(figures.STRATEGIES, pair, strict=True)}
                              for model, pair in zip(figures.MODELS, ratios, strict=True)}}

    text = figures.render_torch_ddp([run(12, 2, [(0.5, 1.25), (1.0, 2.0)]),
                                     run(30, 3, [(0.75, 1.5), (1.1, 3.0)])])
    heading = "| samples/s over torch DDP's | run 1 (12 steps, 2 repeats) | run 2 (30 steps, 3 repeats) |"
    assert heading in text
    assert "| ResNet-18, `ps_sync_no_overlap` | 1.25 | 1.50 |" in text
    assert "| `gpt_small`, `ps_sync` (overlap trial) | 1.00 | 1.10 |" in text
