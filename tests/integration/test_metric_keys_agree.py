"""Every strategy and recovery mode logs the same metric keys: one short run of each from
the CLI on the shipped digits (baseline; parameter server sync, async and ssp; DDP with
restart and live recovery; local updates on each transport and recovery policy), every
process's training and evaluation records compared, save the keys only some modes can
have (`ONLY_SOME`, each with its reason)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain.metrics.keys import SUMMARY, SYNC_MODE_ONLY
from disttrain.metrics.logger import METRICS_FILE, read_metrics

COMMON_ARGS = ["--dataset", "digits", "--max-train-samples", 128, "--max-test-samples", 32,
               "--num-epochs", 1, "--batch-size", 16, "--num-threads", 1, "--seed", 1,
               "--set", "training.log_interval=2"]
MODES: dict[str, list] = {
    "baseline": ["baseline"],
    "ps-sync": ["ps", "--workers", 2, "--aggregation-mode", "sync"],
    "ps-async": ["ps", "--workers", 2, "--aggregation-mode", "async"],
    "ps-ssp": ["ps", "--workers", 2, "--aggregation-mode", "ssp"],
    "ddp-restart": ["ddp", "--world-size", 2, "--ddp-recovery", "restart"],
    "ddp-live": ["ddp", "--world-size", 2, "--ddp-recovery", "live", "--timeout-s", 60],
    "ps-sync-local": ["ps", "--workers", 2, "--aggregation-mode", "sync", "--sync-every", 2],
    "ddp-restart-local": ["ddp", "--world-size", 2, "--ddp-recovery", "restart", "--sync-every", 2],
    "ddp-live-local": ["ddp", "--world-size", 2, "--ddp-recovery", "live", "--timeout-s", 60,
                       "--sync-every", 2],
}
PROCESSES = {"baseline": {"baseline"}, "ps-sync": {"worker0", "worker1"}, "ps-async": {"worker0", "worker1"},
             "ps-ssp": {"worker0", "worker1"}, "ddp-restart": {"rank0", "rank1"},
             "ddp-live": {"rank0", "rank1"}, "ps-sync-local": {"worker0", "worker1"},
             "ddp-restart-local": {"rank0", "rank1"}, "ddp-live-local": {"rank0", "rank1"}}

EXCHANGING = frozenset(MODES) - {"baseline"}
PS = frozenset({"ps-sync", "ps-async", "ps-ssp", "ps-sync-local"})
DDP = frozenset({"ddp-restart", "ddp-live", "ddp-restart-local", "ddp-live-local"})
LOCAL = frozenset({"ps-sync-local", "ddp-restart-local", "ddp-live-local"})
# Training-record keys only some modes can have: the modes that log each, and why.
ONLY_SOME: dict[str, tuple[frozenset[str], str]] = {
    "time/comm_blocked_s": (EXCHANGING, "the baseline exchanges nothing"),
    "time/comm_overlapped_s": (EXCHANGING, "the baseline exchanges nothing"),
    "comm/bytes_sent": (PS, "gradient bytes pushed to the servers: a parameter-server worker's"),
    "comm/bytes_received": (PS, "parameter bytes pulled from the servers: a parameter-server worker's"),
    "comm/bytes_allreduced": (DDP, "gradient bytes handed to all-reduce: a DDP rank's"),
    "ps/staleness": (PS, "versions a pushed gradient is behind the servers: parameter server only"),
    "ps/rejected_pushes": (PS, "pushes a shard turned away as too stale: parameter server only"),
    **{key: (frozenset({"ps-sync", "ps-sync-local"}), "the step agreement across shards: sync mode only")
       for key in SYNC_MODE_ONLY},
    "local/rounds": (LOCAL, "rounds of local updates that ended: local updates only"),
    "local/exchange_bytes": (LOCAL - PS, "the largest pseudo-gradient all-reduced (a worker counts its "
                             "pushes in comm/bytes_sent)"),
}
RECORD_FIELDS = {"step", "epoch", "time"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Each mode's log folder, after one short run of it."""
    from tests.conftest import run_cli
    folders = {}
    for mode, args in MODES.items():
        folder = tmp_path_factory.mktemp(mode)
        result = run_cli(*args, *COMMON_ARGS, "--log-dir", folder / "logs", "--checkpoint-dir",
                         folder / "ckpt", timeout=120)
        assert result.returncode == 0, f"{mode}: {result.stderr[-3000:]}"
        folders[mode] = folder / "logs"
    return folders


def record_keys(folder: Path) -> dict[str, tuple[set[str], set[str]]]:
    """Per process of a run: the metric keys of its training records and of its evaluation
    records (those with `loss/test`), each process having at least one of each."""
    keys = {}
    for path in sorted(folder.glob(f"*/{METRICS_FILE}")):
        records = read_metrics(path)
        training = [set(r) - RECORD_FIELDS for r in records if "loss/test" not in r]
        evaluation = [set(r) - RECORD_FIELDS for r in records if "loss/test" in r]
        assert training and evaluation, \
            f"{path}: {len(training)} training, {len(evaluation)} evaluation records"
        keys[path.parent.name] = (set().union(*training), set().union(*evaluation))
    return keys


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_mode_logs_the_same_metric_keys(runs):
    logged = {mode: record_keys(folder) for mode, folder in runs.items()}
    for mode, processes in logged.items():
        assert set(processes) == PROCESSES[mode], mode
    every_training = set().union(*(t for processes in logged.values() for t, _ in processes.values()))
    common = every_training - set(ONLY_SOME)
    assert {"loss/train", "accuracy/train", "throughput/samples_per_s", "time/step_s", "time/compute_s",
            "optim/learning_rate", "progress/samples", "progress/train_time_s"} <= common
    evaluation_keys = {"loss/test", "accuracy/test", "time/eval_s", "progress/samples",
                       "progress/train_time_s"}
    for mode, processes in logged.items():
        expected = common | {key for key, (modes, _) in ONLY_SOME.items() if mode in modes}
        for process, (training, evaluation) in processes.items():
            assert training == expected, (f"{mode} {process}: missing {sorted(expected - training)}, "
                                          f"extra {sorted(training - expected)}")
            assert evaluation == evaluation_keys, f"{mode} {process}: {sorted(evaluation)}"
        summary = json.loads((runs[mode] / "summary.json").read_text())
        assert set(SUMMARY) <= set(summary), f"{mode} summary lacks {sorted(set(SUMMARY) - set(summary))}"
