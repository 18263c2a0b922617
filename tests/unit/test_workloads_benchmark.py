"""benchmarks/workloads.py's arithmetic: the figures it reads from a run's metrics, and the
"where each wins" it computes from them (the runs themselves are `make bench`'s)."""

import importlib.util
import json

import pytest
from conftest import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"


@pytest.fixture
def workloads(monkeypatch):
    """The script as a module (it imports `common` from its own folder, as when run)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("workloads_benchmark", BENCHMARKS / "workloads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def window(step, step_s, comm_s, sent=0.0, received=0.0):
    return {"step": step, "epoch": 0, "time": 0.0, "time/step_s": step_s, "time/compute_s": step_s - comm_s,
            "time/comm_blocked_s": comm_s, "comm/bytes_sent": sent, "comm/bytes_received": received}


def test_the_warm_up_window_is_left_out_and_the_others_weighted_by_their_steps(workloads, tmp_path):
    path = write_metrics(tmp_path / "metrics.jsonl", [
        window(3, 9.0, 9.0, 1, 1),          # warm-up: left out
        window(6, 0.4, 0.1, 100, 100),      # 3 steps
        {"step": 6, "epoch": 0, "time": 0.0, "loss/test": 2.0},  # an evaluation record: not a window
        window(7, 1.0, 0.4, 300, 100)])     # 1 step (the epoch's last, partial window)
    figures = workloads.window_means(path)
    assert figures["step_time_s"] == pytest.approx((3 * 0.4 + 1.0) / 4)
    assert figures["comm_s"] == pytest.approx((3 * 0.1 + 0.4) / 4)
    assert figures["compute_s"] == pytest.approx((3 * 0.3 + 0.6) / 4)
    assert figures["bytes_per_step"] == pytest.approx((3 * 200 + 400) / 4)


def test_a_run_too_short_to_measure_is_an_error_that_says_so(workloads, tmp_path):
    path = write_metrics(tmp_path / "metrics.jsonl", [window(3, 0.5, 0.0)])
    with pytest.raises(RuntimeError, match="1 logged windows"):
        workloads.window_means(path)


def figures(step_time_s, comm_s, bytes_per_step):
    return {"step_time_s": step_time_s, "compute_s": step_time_s - comm_s, "comm_s": comm_s,
            "bytes_per_step": bytes_per_step, "samples_per_s": 64 / step_time_s}


def test_where_each_wins_follows_the_measured_figures(workloads):
    def wins(async_step_s):
        runs = {"baseline": [figures(0.1, 0.0, 0.0)], "ps_sync": [figures(0.2, 0.05, 2e6)],
                "ps_async": [figures(async_step_s, 0.01, 2e6)], "ddp": [figures(0.15, 0.03, 1e6)]}
        baseline = workloads.summarise(runs["baseline"], None)
        results = {"m": {"baseline": baseline, **{s: workloads.summarise(r, baseline)
                                                  for s, r in runs.items() if s != "baseline"}}}
        return results, workloads.where_each_wins(results)["m"]

    results, fast_async = wins(0.09)
    assert results["m"]["ps_async"]["ratio_to_baseline"]["samples_per_s"] == pytest.approx(0.1 / 0.09)
    assert fast_async["fastest"] == "ps_async" and fast_async["beat_baseline"] == ["ps_async"]
    assert fast_async["fewest_bytes_per_step"] == "ddp"
    _, slow_async = wins(0.5)
    assert slow_async["fastest"] == "baseline" and slow_async["beat_baseline"] == []
    assert slow_async["least_comm_fraction"] == "ps_async"  # 0.01 of 0.5 s


def test_quick_mode_shrinks_the_models_and_ps_runs_name_their_mode(workloads, tmp_path):
    quick = workloads.command("gpt_small", "ps_async", tmp_path, quick=True)
    assert quick[quick.index("--aggregation-mode") + 1] == "async"
    assert any(arg.startswith("training.model_args=") and '"n_layer": 2' in arg for arg in quick)
    full = workloads.command("resnet18", "ddp", tmp_path, quick=False)
    assert not any(arg.startswith("training.model_args=") for arg in full)
    assert full[full.index("--world-size") + 1] == "2"
    assert full[full.index("--num-samples") + 1] == str(2 * 12 * 16)


def test_the_overlapped_share_and_ps_against_ddp_follow_the_figures(workloads, tmp_path):
    path = write_metrics(tmp_path / "metrics.jsonl", [
        {**window(3, 9.0, 9.0), "time/comm_overlapped_s": 0.0},
        {**window(6, 0.4, 0.1), "time/comm_overlapped_s": 0.3}])
    assert workloads.window_means(path)["overlapped_s"] == pytest.approx(0.3)
    runs = {"ps_sync": [{**figures(0.2, 0.1, 2e6), "overlapped_s": 0.3}],
            "ps_sync_no_overlap": [{**figures(0.4, 0.3, 2e6), "overlapped_s": 0.0}],
            "ddp": [{**figures(0.25, 0.05, 1e6), "overlapped_s": 0.05}]}
    results = {"m": {s: workloads.summarise(r, None) for s, r in runs.items()}}
    assert results["m"]["ps_sync"]["overlapped_share"] == pytest.approx(0.75)
    assert results["m"]["ps_sync_no_overlap"]["overlapped_share"] == 0.0
    versus = workloads.ps_vs_ddp(results)["m"]
    assert versus["ps_sync"]["samples_per_s_ratio"] == pytest.approx(0.25 / 0.2)
    assert versus["ps_sync_no_overlap"]["samples_per_s_ratio"] == pytest.approx(0.25 / 0.4)
    serial = workloads.command("resnet18", "ps_sync_no_overlap", tmp_path, quick=True)
    assert "--no-overlap" in serial and serial[serial.index("--aggregation-mode") + 1] == "sync"
    assert "--no-overlap" not in workloads.command("resnet18", "ps_sync", tmp_path, quick=True)


def test_config_overrides_reach_every_run_before_the_strategys_own(workloads, tmp_path):
    overrides = ["ps.overlap_trial_steps=8", "training.log_interval=4"]
    plain = workloads.command("resnet18", "ps_sync", tmp_path, quick=True, overrides=overrides)
    sets = [plain[i + 1] for i, arg in enumerate(plain) if arg == "--set"]
    assert sets.index("ps.overlap_trial_steps=8") > sets.index("training.log_interval=3")
    assert "training.log_interval=4" in sets  # after the benchmark's own default, so it applies
    forced = workloads.command("resnet18", "ps_sync_overlap", tmp_path, quick=True, overrides=overrides)
    forced_sets = [forced[i + 1] for i, arg in enumerate(forced) if arg == "--set"]
    # the forced overlap's own setting comes last, so it still forces the overlap
    assert forced_sets.index("ps.overlap_trial_steps=0") > forced_sets.index("ps.overlap_trial_steps=8")
    assert "ps.overlap_trial_steps=8" not in workloads.command("resnet18", "ps_sync", tmp_path, quick=True)


def test_a_malformed_override_is_refused_before_any_run(workloads, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["workloads.py", "--set", "overlap_trial_steps"])
    monkeypatch.setattr(workloads, "measure", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as exited:
        workloads.main()
    assert exited.value.code == 2 and "is not section.key=value" in capsys.readouterr().err


def test_the_ps_is_compared_with_a_plain_torch_ddp_loop_where_one_ran(workloads):
    runs = {"ps_sync": [figures(0.2, 0.1, 2e6)], "torch_ddp": [figures(0.25, 0.0, 1e6)]}
    results = {"m": {s: workloads.summarise(r, None) for s, r in runs.items()}}
    versus = workloads.ps_vs_ddp(results)["m"]["ps_sync"]
    assert versus["torch_ddp_ratio"] == pytest.approx(0.25 / 0.2) and "samples_per_s_ratio" not in versus


@pytest.mark.slow
def test_a_plain_torch_ddp_loop_runs_the_same_workload_and_gives_the_same_figures(workloads):
    """Two gloo ranks of a plain DDP loop on the quick simplecnn workload: the figures
    `measure` gives, from the steps past the warm-up window."""
    result = workloads.measure_torch_ddp("simplecnn", quick=True, steps=workloads.LOG_INTERVAL + 2)
    assert result["processes"] == 2 and result["comm_s"] == 0.0
    assert 0 < result["step_time_s"] == result["compute_s"]
    batch = workloads.WORKLOADS["simplecnn"]["batch"] // 2
    assert result["samples_per_s"] == pytest.approx(2 * batch / result["step_time_s"], rel=0.2)
    assert result["bytes_per_step"] > 1e6  # simplecnn's 1.7 MB of float32 gradients
    training = workloads.torch_ddp_training("simplecnn", quick=True, steps=5)
    assert training["num_samples"] == 2 * 5 * batch and training["batch_size"] == batch
