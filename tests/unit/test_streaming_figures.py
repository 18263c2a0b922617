"""The slow-link figures of Streaming DiLoCo in docs/local-updates.md are those of the
committed benchmark JSON (benchmarks/results/slow_link_streaming_seed*.json), as
tools/streaming_figures.py writes them; other JSON gives other figures and verdicts."""

from __future__ import annotations

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def streaming_figures(tool):
    return tool("streaming_figures")


def run(accuracy, loss, peak, blocked, samples_per_s=500.0):
    return {"status": "ok", "final_accuracy": accuracy, "final_loss": loss, "samples_per_s": samples_per_s,
            "bytes_sent": 25_000_000, "exchange_bytes": {"peak": peak, "epoch_end": 1_686_568},
            "comm_blocked_share": blocked}


def result(seed, plain_accuracy, streaming_accuracy):
    return {"seed": seed, "rates": {"100mbit": {
        "ddp+local32": run(plain_accuracy, 0.05, 1_686_568, 0.10),
        "ddp+local32+stream4": run(streaming_accuracy, 0.06, 421_644, 0.02)}}}


def test_the_page_holds_the_committed_figures(streaming_figures):
    results = streaming_figures.committed()
    assert results, "no benchmarks/results/slow_link_streaming_seed*.json"
    page = (REPO_ROOT / "docs" / "local-updates.md").read_text()
    block = page.split(streaming_figures.BEGIN, 1)[1].split(streaming_figures.END, 1)[0]
    assert block == streaming_figures.render(results), "run: python tools/streaming_figures.py"


def test_the_figures_are_the_runs(streaming_figures):
    text = streaming_figures.render([("r1.json", result(1, 0.985, 0.984)),
                                     ("r2.json", result(2, 0.980, 0.981))])
    assert ("python benchmarks/slow_link.py --rates 100mbit --seed 1 "
            "--configs ddp+local32,ddp+local32+stream4 --output r1.json") in text
    assert "| ddp+local32 | 1 | 98.50% | 0.0500 | 1,686,568 B | 1,686,568 B | 10.0% | 500 | 25.0 |" in text
    assert ("| ddp+local32+stream4 | 2 | 98.10% | 0.0600 | 421,644 B (4.0x less) | 1,686,568 B | "
            "2.0% |") in text
    said = " ".join(text.split())
    assert "accuracy +0.00 points on average, within the 0.50 points between ddp+local32's seeds" in said
    assert "loss +0.0100 on average, not shown within the 0.0000" in said
    assert "peak bytes per exchange 4.0x to 4.0x less (about F = 4)" in said
    assert "blocked in exchanges 2.0% against 10.0%, 2.0% against 10.0% of the step" in said


def test_a_gap_beyond_the_seeds_or_one_seed_alone_is_not_called_noise(streaming_figures):
    apart = " ".join(streaming_figures.render([("a", result(1, 0.985, 0.970)),
                                               ("b", result(2, 0.983, 0.969))]).split())
    assert "accuracy -1.45 points on average, not shown within the 0.20 points" in apart
    alone = " ".join(streaming_figures.render([("a", result(1, 0.985, 0.985))]).split())
    assert "accuracy +0.00 points on average, not shown within" in alone
    assert streaming_figures.pairs(["ddp+local32", "ps-sync+local32+stream4", "ddp+local32+stream4"]) == [
        ("ddp+local32", "ddp+local32+stream4", 4)]
