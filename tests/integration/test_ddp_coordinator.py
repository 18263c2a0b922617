"""`disttrain ddp` under a coordinator: every rank registers as rank<R>, heartbeats,
reports its latest metrics and its end; a rank killed mid-run and restarted by the
elastic agent registers again and is counted as restarted (with a recovery record),
while the run still ends bit-identical to one never interrupted, and `--resume` starts
a registry of its own; `disttrain status` shows the ranks and their latest loss from the
registry; a coordinator given with --coordinator is used instead of one of the run's
own, and one that cannot be reached does not stop training."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from disttrain.config import Config
from disttrain.coordinator.registry import read_status
from disttrain.coordinator.service import CoordinatorServer

# Two epochs with dropout (per-rank RNG) and Adam; checkpoints every 3 steps, the kill at 7.
ARGS = ["--world-size", 2, "--dataset", "digits", "--max-train-samples", 512, "--max-test-samples", 64,
        "--num-epochs", 2, "--batch-size", 32, "--seed", 3, "--optimizer", "adam",
        "--checkpoint-interval", 3, "--set", "training.log_interval=2"]
STEPS = 2 * 512 // 2 // 32
RANKS = ["rank0", "rank1"]


def dirs(run_dir: Path) -> list:
    return ["--log-dir", run_dir / "logs", "--checkpoint-dir", run_dir / "ckpt"]


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "ckpt" / "ddp_final.pt", weights_only=True)["model"]


def assert_same_model(expected_dir: Path, trained_dir: Path) -> None:
    expected, trained = final_model(expected_dir), final_model(trained_dir)
    assert expected.keys() == trained.keys()
    assert all(torch.equal(expected[name], trained[name]) for name in expected)


def nodes_by_id(registry: Path) -> dict[str, dict]:
    return {node["node_id"]: node for node in read_status(registry, max_events=100).nodes}


def event_kinds(registry: Path, node_id: str) -> list[str]:
    return [e["kind"] for e in read_status(registry, max_events=100).events if e["node_id"] == node_id]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """An uninterrupted run (the reference for the others)."""
    run_dir = tmp_path_factory.mktemp("whole")
    return run_cli("ddp", *ARGS, *dirs(run_dir), timeout=100), run_dir


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_registers_heartbeats_and_ends_done(cli, whole_run):
    result, run_dir = whole_run
    assert result.returncode == 0, result.stderr[-3000:]
    registry = run_dir / "logs" / "cluster.db"
    nodes = nodes_by_id(registry)
    assert sorted(nodes) == RANKS
    final_accuracy = json.loads((run_dir / "logs" / "summary.json").read_text())["final_accuracy"]
    for rank, name in enumerate(RANKS):
        node = nodes[name]
        assert (node["role"], node["rank"], node["state"], node["restarts"]) == ("rank", rank, "done", 0)
        assert node["step"] == STEPS and node["epoch"] == 1 and node["throughput"] > 0
        assert node["last_heartbeat"] is not None
        assert event_kinds(registry, name) == ["joined", "done"]
        # its latest metrics, sent with its final heartbeat: the last window's and evaluation's
        metrics = node["metrics"]
        assert math.isfinite(metrics["loss/train"]) and metrics["accuracy/test"] == final_accuracy, metrics
        assert node["metrics_step"] == STEPS
    assert read_status(registry).recoveries == []

    shown = cli("status", "--registry", registry, "--json", timeout=30)
    assert shown.returncode == 0, shown.stderr[-3000:]
    status = json.loads(shown.stdout)
    assert [(n["node_id"], n["state"], n["restarts"], n["step"]) for n in status["nodes"]] == \
        [(name, "done", 0, STEPS) for name in RANKS]
    assert all(n["heartbeat_age_s"] >= 0 and n["throughput"] > 0 for n in status["nodes"])
    assert [n["metrics"] for n in status["nodes"]] == [nodes[name]["metrics"] for name in RANKS]
    assert status["recoveries"] == []
    table = cli("status", "--registry", registry, timeout=30)
    assert table.returncode == 0 and "rank1  rank  1" in table.stdout, table.stdout
    loss = f"{nodes['rank1']['metrics']['loss/train']:.4f}"
    assert loss in next(line for line in table.stdout.splitlines() if line.startswith("rank1")), table.stdout


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_killed_rank_is_counted_restarted_and_the_run_ends_bit_identical(cli, tmp_path, whole_run):
    reference, reference_dir = whole_run
    assert reference.returncode == 0, reference.stderr[-3000:]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "cluster.db").write_text("an earlier run's registry")  # a fresh run replaces it
    result = cli("ddp", *ARGS, "--max-restarts", 1, "--inject", "kill:rank=1:step=7:attempt=0",
                 *dirs(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "injected fault: kill at step 7" in result.stderr
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert (summary["restarts"], summary["resumed_from_step"], summary["steps"]) == (1, 6, STEPS)
    assert_same_model(reference_dir, tmp_path)

    registry = tmp_path / "logs" / "cluster.db"
    nodes = nodes_by_id(registry)
    assert sorted(nodes) == RANKS
    for name in RANKS:
        node = nodes[name]
        assert (node["state"], node["restarts"], node["step"]) == ("done", 1, STEPS), node
        kinds = event_kinds(registry, name)
        assert kinds[0] == "joined" and kinds[-1] == "done"
        assert kinds.count("failed") == 1 and kinds.count("restarted") == 1
        assert kinds.index("failed") < kinds.index("restarted")
    # each rank's restart is one recovery record: its end reported (by the rank as it failed,
    # or by its next process: no detection delay) or, when that took longer, its heartbeats missed
    recoveries = read_status(registry).recoveries
    assert sorted(r.node_id for r in recoveries) == RANKS, recoveries
    for recovery in recoveries:
        assert recovery.recover_s > 0, recoveries
        assert (recovery.detect_s > 0) == recovery.reason.startswith("no heartbeat for"), recoveries

    # --resume is a launch of its own, with its own registry: its ranks join afresh (the
    # earlier launch's restarts and failures are in its log, not counted again).
    resumed = cli("ddp", *ARGS, "--resume", *dirs(tmp_path), timeout=100)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    nodes = nodes_by_id(registry)
    assert [(nodes[name]["state"], nodes[name]["restarts"]) for name in RANKS] == [("done", 0)] * 2
    assert all(event_kinds(registry, name) == ["joined", "done"] for name in RANKS)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_report_to_the_coordinator_given(cli, tmp_path):
    registry = tmp_path / "external.db"
    server = CoordinatorServer(Config().coordinator, "127.0.0.1:0", registry)
    try:
        result = cli("ddp", *ARGS, "--coordinator", server.address, *dirs(tmp_path / "run"), timeout=100)
        assert result.returncode == 0, result.stderr[-3000:]
        nodes = {node.node_id: node for node in server.state.membership.members()}
    finally:
        server.stop()
    assert sorted(nodes) == RANKS
    assert all((n.state, n.restarts, n.step) == ("done", 0, STEPS) for n in nodes.values())
    assert not (tmp_path / "run" / "logs" / "cluster.db").exists()  # no coordinator of its own


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_unreachable_coordinator_does_not_stop_training(cli, tmp_path, whole_run):
    reference, reference_dir = whole_run
    assert reference.returncode == 0, reference.stderr[-3000:]
    with socket.socket() as closed:  # bound, never listening: every connection is refused
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        result = cli("ddp", *ARGS, "--coordinator", address, *dirs(tmp_path), timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank0 is not registered with the coordinator (training goes on" in result.stderr
    assert_same_model(reference_dir, tmp_path)
    assert not (tmp_path / "logs" / "cluster.db").exists()
