"""Run artifacts and the performance report made from them: what each artifact holds,
the check of its kind and shape, speed-up, per-process figures and their spread, a
language model's perplexity in place of accuracy."""

import dataclasses
import json
import re

import pytest
from run_folders import BASELINE, BATCH_SIZE, DDP, LM_BASELINE, LM_DDP, PS_SYNC, write_run

from disttrain.core.errors import InputFileError
from disttrain.report.artifacts import load_artifact, worker_digests, write_run_artifacts
from disttrain.report.digest import process_digest
from disttrain.report.perf import Artifacts, perf_report, perf_table
from disttrain.report.runs import read_processes

pytestmark = pytest.mark.timeout(60)


def artifacts_of(tmp_path, name, run):
    summary = write_run(tmp_path / name, run)
    return write_run_artifacts(summary.to_dict(), tmp_path / "artifacts")


def test_each_strategy_writes_its_artifacts_with_their_kind(tmp_path):
    assert [p.name for p in artifacts_of(tmp_path, "b", BASELINE)] == ["baseline.json"]
    assert [p.name for p in artifacts_of(tmp_path, "p", PS_SYNC)] == ["ps.json", "worker_metrics.json"]
    assert [p.name for p in artifacts_of(tmp_path, "d", DDP)] == [
        "ddp.json", "ddp_rank_0.json", "ddp_rank_1.json"]
    folder = tmp_path / "artifacts"
    baseline = load_artifact(folder / "baseline.json", "baseline", "--baseline-json")
    assert baseline["final_accuracy"] == BASELINE.accuracies[-1] and baseline["config"]["system"]["log_dir"]
    assert baseline["process"]["samples_per_s"] == pytest.approx(BATCH_SIZE / BASELINE.step_s)
    ps = load_artifact(folder / "ps.json", "ps", "--ps-json")
    assert ps["strategy"] == "ps-sync" and ps["staleness_histogram"] == {"0": 50, "1": 10}
    workers = worker_digests(load_artifact(folder / "worker_metrics.json", "worker_metrics", "--w"))
    assert [w["process"] for w in workers] == ["worker0", "worker1"]
    assert sum(w["samples"] for w in workers) == ps["samples_processed"]
    for worker in workers:
        assert worker["strategy"] == "ps-sync"
        assert worker["samples_per_s"] == pytest.approx(BATCH_SIZE / PS_SYNC.step_s)
        assert worker["step_time_s"] == pytest.approx(PS_SYNC.step_s)
        assert worker["comm_share"] == pytest.approx(PS_SYNC.comm_s / PS_SYNC.step_s)
        assert worker["wire_bytes_per_step"] == pytest.approx(
            PS_SYNC.scalars["comm/bytes_sent"] + PS_SYNC.scalars["comm/bytes_received"])
    assert workers[0]["final_accuracy"] == PS_SYNC.accuracies[-1] and workers[1]["final_accuracy"] is None
    rank1 = load_artifact(folder / "ddp_rank_1.json", "ddp_rank", "--ddp-rank-json")
    assert rank1["rank"] == 1 and rank1["wire_bytes_per_step"] == DDP.scalars["comm/bytes_allreduced"]


@pytest.mark.parametrize("change, fragment", [
    (lambda data: data.update(kind="ddp_rank"), "is a 'ddp_rank' artifact (ddp_rank_<R>.json), but --ps-json "
                                                "takes a 'ps' artifact (ps.json)"),
    (lambda data: data.pop("kind"), 'has no "kind"'),
    (lambda data: data.pop("final_accuracy"), 'has no "final_accuracy"'),
    (lambda data: data.update(train_time_s="fast"), '"train_time_s" should be a number'),
    (lambda data: data.update(strategy="ddp"), "says kind 'ps' but strategy 'ddp'"),
])
def test_a_wrong_or_malformed_artifact_is_refused_naming_the_file(tmp_path, change, fragment):
    path = artifacts_of(tmp_path, "p", PS_SYNC)[0]
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(InputFileError, match=re.escape(fragment)) as caught:
        load_artifact(path, "ps", "--ps-json")
    assert str(caught.value).startswith(f"{path}: ")


def test_a_worker_digest_without_its_figures_is_refused(tmp_path):
    path = artifacts_of(tmp_path, "p", PS_SYNC)[1]
    data = json.loads(path.read_text())
    del data["workers"][1]["samples_per_s"]
    path.write_text(json.dumps(data))
    with pytest.raises(InputFileError, match=r'workers\[1\]: "samples_per_s"'):
        load_artifact(path, "worker_metrics", "--worker-metrics-json")


def test_perf_report_speedups_and_the_spread_of_the_workers(tmp_path):
    slower = dataclasses.replace(PS_SYNC, step_s=PS_SYNC.step_s * 2)
    write_run(tmp_path / "fast", PS_SYNC)
    write_run(tmp_path / "slow", slower)
    workers = [process_digest("worker0", read_processes(tmp_path / "fast")["worker0"]),
               process_digest("worker1", read_processes(tmp_path / "slow")["worker1"])]
    baseline = {**write_run(tmp_path / "b", BASELINE).to_dict(), "kind": "baseline"}
    ps = {**write_run(tmp_path / "p", PS_SYNC).to_dict(), "kind": "ps"}
    report = perf_report(Artifacts(baseline=baseline, ps=ps, workers=workers))
    entries = {entry["kind"]: entry for entry in report["strategies"]}
    assert entries["baseline"]["speedup"] == pytest.approx(1.0)
    assert entries["ps"]["speedup"] == pytest.approx(PS_SYNC.samples_per_s / BASELINE.samples_per_s)
    assert entries["ps"]["scaling_efficiency"] == pytest.approx(entries["ps"]["speedup"] / 2)
    spread = report["processes"]["ps"]["spread"]
    assert (spread["slowest"], spread["fastest"]) == ("worker1", "worker0")
    assert spread["fastest_over_slowest"] == pytest.approx(2.0)
    assert spread["step_time_s"] == pytest.approx({"min": PS_SYNC.step_s, "max": slower.step_s})
    table = perf_table(report)
    assert "ps-sync" in table and "slowest worker1, fastest worker0: 2.00x" in table


def test_a_strategy_given_only_by_its_processes_is_summed_from_them(tmp_path):
    write_run(tmp_path / "d", DDP)
    ranks = [{**process_digest(name, records), "strategy": "ddp"}
             for name, records in read_processes(tmp_path / "d", "rank").items()]
    report = perf_report(Artifacts(ranks=ranks))
    (entry,) = report["strategies"]
    assert entry["from"] == "processes" and entry["workers"] == 2 and entry["speedup"] is None
    assert entry["samples_per_s"] == pytest.approx(DDP.samples_per_s)
    assert entry["final_accuracy"] == DDP.accuracies[-1]


def test_a_language_models_perf_report_shows_perplexity_and_its_times(tmp_path):
    baseline = {**write_run(tmp_path / "b", LM_BASELINE).to_dict(), "kind": "baseline"}
    write_run(tmp_path / "d", LM_DDP)
    ranks = [{**process_digest(name, records), "strategy": "ddp"}
             for name, records in read_processes(tmp_path / "d", "rank").items()]
    report = perf_report(Artifacts(baseline=baseline, ranks=ranks))
    entries = {entry["kind"]: entry for entry in report["strategies"]}
    assert entries["baseline"]["final_perplexity"] == pytest.approx(LM_BASELINE.perplexities[-1])
    assert entries["baseline"]["time_to_perplexity_s"] == pytest.approx({"32": 0.8, "16": 0.8, "8": 1.2,
                                                                         "4": None})
    assert entries["ddp"]["final_perplexity"] == pytest.approx(LM_DDP.perplexities[-1])  # from rank 0
    assert entries["ddp"]["final_accuracy"] is None and ranks[0]["evaluates"] and not ranks[1]["evaluates"]
    header, baseline_line = perf_table(report).splitlines()[:2]
    assert header.split()[:3] == ["strategy", "workers", "ppl"] and "7.500" in baseline_line
