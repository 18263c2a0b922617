"""benchmarks/compression.py's record of the learning rate: each run the rate it trained
with (SGD in async mode takes it over the workers), and the committed results' top-level
rate the one their runs took."""

import importlib.util
import json

import pytest
from conftest import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"


@pytest.fixture
def compression(monkeypatch):
    """The script as a module (it imports `common` from its own folder, as when run)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("compression_benchmark", BENCHMARKS / "compression.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sgd_in_async_mode_takes_the_rate_over_the_workers(compression):
    sgd = {"optimizer": "sgd", "learning_rate": 0.05, "momentum": 0.9}
    rate = compression.run_optimizer(sgd, "async")["learning_rate"]
    assert rate == pytest.approx(0.05 / compression.NUM_WORKERS)
    assert compression.run_optimizer(sgd, "sync") == sgd and compression.run_optimizer(sgd, None) == sgd
    adam = {**sgd, "optimizer": "adam", "learning_rate": 0.001}
    assert compression.run_optimizer(adam, "async") == adam


def test_the_top_level_rate_is_the_runs_own_or_null_where_they_differ(compression):
    given = {"optimizer": "sgd", "learning_rate": 0.05, "momentum": 0.9}
    async_only = {"ps-async": {"learning_rate": 0.025}, "ps-async-dgc": {"learning_rate": 0.025}}
    assert compression.recorded_optimizer(given, async_only) == {**given, "learning_rate": 0.025}
    mixed = {**async_only, "ps-sync": {"learning_rate": 0.05}}
    assert compression.recorded_optimizer(given, mixed)["learning_rate"] is None


@pytest.mark.parametrize("path", sorted((BENCHMARKS / "results").glob("compression_*.json")),
                         ids=lambda p: p.name)
def test_the_committed_results_record_the_rate_their_runs_trained_with(path):
    result = json.loads(path.read_text())
    rates = {run["learning_rate"] for entry in result["runs"].values() for run in entry["runs"]}
    assert rates == {result["optimizer"]["learning_rate"]}, (path.name, rates)
