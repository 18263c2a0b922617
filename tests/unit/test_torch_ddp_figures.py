"""The sync PS's figures against a plain torch DDP loop in docs/benchmarks.md are those of
the committed workloads JSON (benchmarks/results/ps_vs_torch_ddp_*.json), as
tools/torch_ddp_figures.py writes them; other JSON gives other figures."""

from __future__ import annotations

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)


def test_the_page_holds_the_committed_figures(tool):
    figures = tool("torch_ddp_figures")
    page = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    block = page.split(figures.BEGIN, 1)[1].split(figures.END, 1)[0]
    assert block == figures.render(figures.committed()), "run: python tools/torch_ddp_figures.py"


def test_the_figures_are_the_runs(tool):
    figures = tool("torch_ddp_figures")

    def run(steps, repeats, ratios):
        workload = {"steps_per_process": steps}
        return {"repeats": repeats, "workloads": {"resnet18": workload, "gpt_small": workload},
                "ps_vs_ddp": {model: {s: {"torch_ddp_ratio": r}
                                      for s, r in zip(figures.STRATEGIES, pair, strict=True)}
                              for model, pair in zip(figures.MODELS, ratios, strict=True)}}

    text = figures.render([run(12, 2, [(0.5, 1.25), (1.0, 2.0)]), run(30, 3, [(0.75, 1.5), (1.1, 3.0)])])
    heading = "| samples/s over torch DDP's | run 1 (12 steps, 2 repeats) | run 2 (30 steps, 3 repeats) |"
    assert heading in text
    assert "| ResNet-18, `ps_sync_no_overlap` | 1.25 | 1.50 |" in text
    assert "| `gpt_small`, `ps_sync` (overlap trial) | 1.00 | 1.10 |" in text
