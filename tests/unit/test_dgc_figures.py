"""The DGC figures of docs/compression.md are those of the committed benchmark JSON
(benchmarks/results/compression_dgc_*.json), as tools/dgc_figures.py writes them; other
JSON gives other figures, each seed's row read from its own runs."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def dgc_figures(tool):
    return tool("dgc_figures")


def run(seed, accuracy, wire_bytes_sent, ratio=1.0):
    return {"seed": seed, "accuracy": accuracy, "wire_bytes_sent": wire_bytes_sent,
            "compression_ratio": ratio}


def result(dense_accuracy, dgc_accuracy, met):
    dense = [run(0, dense_accuracy, 800e6), run(1, dense_accuracy, 800e6)]
    dgc = [run(0, dgc_accuracy, 4e6, 210.0), run(1, dgc_accuracy, 4e6, 230.0)]
    drop = 100 * (dense_accuracy - dgc_accuracy)
    return {"seeds": [0, 1],
            "runs": {"ps-async": {"accuracy": dense_accuracy, "wire_bytes_sent": 800e6, "runs": dense},
                     "ps-async-dgc": {"accuracy": dgc_accuracy, "wire_bytes_sent": 4e6, "runs": dgc}},
            "checks": {"ps-async-dgc": {"wire_share_of_dense": 4e6 / 800e6, "bytes_share_of_dense": 1 / 220,
                                        "fewer_bytes_x": 200.0, "mean_accuracy_drop_points": drop,
                                        "met": met}}}


def test_the_page_holds_the_committed_figures(dgc_figures):
    results = dgc_figures.committed()
    assert results, "no benchmarks/results/compression_dgc_*.json"
    page = (REPO_ROOT / "docs" / "compression.md").read_text()
    block = page.split(dgc_figures.BEGIN, 1)[1].split(dgc_figures.END, 1)[0]
    assert block == dgc_figures.render(results), "run: python tools/dgc_figures.py"


def test_the_figures_are_the_runs(dgc_figures):
    text = dgc_figures.render([("benchmarks/results/compression_dgc_async.json", result(0.985, 0.981, True))])
    assert ("python benchmarks/compression.py --dgc --seeds 0,1 --only ps-async,ps-async-dgc "
            "--output benchmarks/results/compression_dgc_async.json") in text
    assert "| PS async | 0 | 98.50% | 98.10% | +0.40 | 800.0 MB | 4.0 MB | 200x | 210x |" in text
    assert "| PS async | 1 | 98.50% | 98.10% | +0.40 | 800.0 MB | 4.0 MB | 200x | 230x |" in text
    assert "| **PS async, mean** | | 98.50% | 98.10% | +0.40 | 800.0 MB | 4.0 MB | 200x | 220x |" in text
    assert "PS async: met (200x fewer bytes, +0.40 points)" in " ".join(text.split())
    missed = dgc_figures.render([("x.json", result(0.985, 0.970, False))])
    assert "PS async: missed (200x fewer bytes, +1.50 points)" in " ".join(missed.split())
