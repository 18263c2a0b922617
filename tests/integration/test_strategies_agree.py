"""The strategies agree on what they measure and on what they train.

- One time base: every strategy's training clock stops while it evaluates, so its
  `train_time_s` and throughputs leave evaluation out (shown with evaluations slowed
  far past the whole training time).
- One vocabulary: every key a strategy logs is in `disttrain.metrics.keys.METRICS`, and
  the relations a key's meaning implies hold in every strategy that logs it.
- One seeding rule: the baseline, one synchronous parameter-server worker and one DDP
  rank trained from the same config end with the same parameters.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import run_cli
from event_files import RECORD_FIELDS, assert_tensorboard_mirrors_jsonl

from disttrain.config import STRATEGY_OF_ARCHITECTURE
from disttrain.config.loading import config_from_dict
from disttrain.core.checkpoint import load_checkpoint
from disttrain.metrics.keys import ACCURACY_THRESHOLDS, ALL, METRICS, SUMMARY, SYNC_MODE_ONLY
from disttrain.metrics.logger import read_metrics
from disttrain.training.models import init_model

# Every test here trains real runs of each strategy (a minute and more in all). Those of
# the slowed-evaluation runs hold the training clock to bounds: no other test may share the
# cores (make test runs the `serial` tests after the others, one at a time).
pytestmark = [pytest.mark.slow]

SLOW_EVAL_S = 2.0
NUM_EPOCHS = 2
TRAIN_SAMPLES = 256
BATCH_SIZE = 32
LOG_INTERVAL = 2
# Windows end on epoch boundaries (4 or 8 steps per epoch per process), so no window
# spans an evaluation and each window holds exactly LOG_INTERVAL steps.
SMALL = ["--dataset", "digits", "--max-train-samples", TRAIN_SAMPLES, "--max-test-samples", 128,
         "--batch-size", BATCH_SIZE, "--num-epochs", NUM_EPOCHS, "--num-threads", 1,
         "--set", f"training.log_interval={LOG_INTERVAL}"]


@dataclass(frozen=True)
class Strategy:
    name: str
    args: tuple[Any, ...]
    family: str  # as `Metric.logged_by` names it
    processes: tuple[str, ...]
    final_model: str
    updates: int  # summary "steps": updates applied to the model

    @property
    def fault_target(self) -> str:
        """Every training process of the strategy, as `--inject` names them."""
        return "rank" if self.family == "ddp" else "worker"


STRATEGIES = [
    Strategy("baseline", ("baseline",), "baseline", ("baseline",), "baseline_final.pt",
             NUM_EPOCHS * TRAIN_SAMPLES // BATCH_SIZE),
    # Two shards: each one's push leaves during the backward pass (overlap, the default).
    # overlap on every step (no trial of plain pushes): each window's overlap is checked
    Strategy("ps-sync", ("ps", "--workers", 2, "--servers", 2, "--aggregation-mode", "sync",
                         "--set", "ps.overlap_trial_steps=0"), "ps",
             ("worker0", "worker1"), "parameter_server_final.pt",
             NUM_EPOCHS * TRAIN_SAMPLES // BATCH_SIZE // 2),  # one version per round of 2 pushes
    Strategy("ps-async", ("ps", "--workers", 2, "--aggregation-mode", "async"), "ps",
             ("worker0", "worker1"), "parameter_server_final.pt",
             NUM_EPOCHS * TRAIN_SAMPLES // BATCH_SIZE),  # one version per push
    Strategy("ddp", ("ddp", "--world-size", 2), "ddp", ("rank0", "rank1"), "ddp_final.pt",
             NUM_EPOCHS * TRAIN_SAMPLES // BATCH_SIZE // 2),
]


@dataclass
class Run:
    strategy: Strategy
    log_dir: Path
    checkpoint_dir: Path
    summary: dict[str, Any]
    records: dict[str, list[dict[str, Any]]]  # process -> its metrics.jsonl

    def windows(self, process: str) -> list[dict[str, Any]]:
        return [r for r in self.records[process] if "loss/train" in r]

    def evaluations(self, process: str) -> list[dict[str, Any]]:
        return [r for r in self.records[process] if "loss/test" in r]


@pytest.fixture(scope="module", params=STRATEGIES, ids=lambda s: s.name)
def slow_eval_run(request, tmp_path_factory) -> Run:
    """One small run of the strategy with every evaluation slowed by SLOW_EVAL_S."""
    strategy: Strategy = request.param
    root = tmp_path_factory.mktemp(strategy.name)
    log_dir, checkpoint_dir = root / "logs", root / "ckpt"
    result = run_cli(*strategy.args, *SMALL, "--inject",
                     f"slow-eval:{strategy.fault_target}:for={SLOW_EVAL_S}s",
                     "--log-dir", log_dir, "--checkpoint-dir", checkpoint_dir, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((log_dir / "summary.json").read_text())
    records = {p: read_metrics(log_dir / p / "metrics.jsonl") for p in strategy.processes}
    return Run(strategy, log_dir, checkpoint_dir, summary, records)


@pytest.mark.serial
@pytest.mark.timeout(240)
def test_a_run_records_the_strategy_it_ran(slow_eval_run):
    """The run folder's config names the strategy that ran it (`disttrain train` on it runs the same)."""
    recorded = yaml.safe_load((slow_eval_run.log_dir / "config.yaml").read_text())
    assert STRATEGY_OF_ARCHITECTURE[recorded["system"]["architecture"]] == slow_eval_run.strategy.args[0]
    assert slow_eval_run.summary["config"]["system"]["architecture"] == recorded["system"]["architecture"]


def parameter_bytes(summary: dict[str, Any]) -> int:
    """Bytes of the run's model parameters (float32), from the config it recorded."""
    model = init_model(config_from_dict(summary["config"]).training)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


# -- one time base ---------------------------------------------------------------------------


@pytest.mark.serial
@pytest.mark.timeout(240)
def test_training_clock_leaves_evaluation_out(slow_eval_run):
    run, s = slow_eval_run, slow_eval_run.summary
    # The evaluations happened, and took their time ...
    assert s["total_time_s"] >= NUM_EPOCHS * SLOW_EVAL_S
    # ... yet a clock that had counted even one of them would read more than SLOW_EVAL_S.
    assert 0 < s["train_time_s"] < SLOW_EVAL_S, s["train_time_s"]
    assert s["samples_processed"] == NUM_EPOCHS * TRAIN_SAMPLES
    assert s["throughput_samples_per_s"] == pytest.approx(s["samples_processed"] / s["train_time_s"],
                                                          rel=1e-9)

    for process in run.strategy.processes:
        evaluations, windows = run.evaluations(process), run.windows(process)
        assert [r["epoch"] for r in evaluations] == list(range(NUM_EPOCHS)), process
        assert all(r["time/eval_s"] >= SLOW_EVAL_S for r in evaluations), (process, evaluations)
        clock = [r["progress/train_time_s"] for r in windows]
        assert windows and clock[-1] < SLOW_EVAL_S, (process, clock)
        assert clock[-1] <= s["train_time_s"] + 1e-9  # the run's clock is its longest process clock
        # Across each evaluation the wall clock moved on by more than SLOW_EVAL_S, the
        # training clock by (much) less; each window's throughput is on the training clock.
        for before, after in zip(windows, windows[1:], strict=False):
            if after["epoch"] != before["epoch"]:
                assert after["time"] - before["time"] >= SLOW_EVAL_S, process
                assert after["progress/train_time_s"] - before["progress/train_time_s"] < SLOW_EVAL_S
            assert after["throughput/samples_per_s"] > LOG_INTERVAL * BATCH_SIZE / SLOW_EVAL_S

    # Time to accuracy: the training clock (no evaluation in it) of the process writing the
    # summary, at its first evaluation reaching each threshold.
    first = [(r["progress/train_time_s"], r["accuracy/test"])
             for r in run.evaluations(run.strategy.processes[0])]
    assert all(clock_s < SLOW_EVAL_S for clock_s, _ in first)
    assert s["time_to_accuracy_s"] == {f"{t:.2f}": next((c for c, a in first if a >= t), None)
                                       for t in ACCURACY_THRESHOLDS}


# -- one vocabulary --------------------------------------------------------------------------


def logged_by(key: str, family: str) -> bool:
    who = METRICS[key].logged_by
    return who == ALL or family in [w.strip() for w in who.split(",")]


def expected(strategy: Strategy) -> set[str]:
    """The keys the vocabulary says `strategy` logs (the sync-only ones left out elsewhere)."""
    keys = {k for k in METRICS if logged_by(k, strategy.family)}
    return keys if strategy.name == "ps-sync" else keys - SYNC_MODE_ONLY


@pytest.mark.serial
@pytest.mark.timeout(240)
def test_every_key_is_in_the_vocabulary_and_means_the_same(slow_eval_run):
    run, family = slow_eval_run, slow_eval_run.strategy.family
    assert set(SUMMARY) <= set(run.summary), set(SUMMARY) - set(run.summary)
    assert all(isinstance(run.summary[k], int | float) for k in SUMMARY if k != "time_to_accuracy_s")
    assert run.summary["steps"] == run.strategy.updates

    expected_keys = expected(run.strategy)
    for process in run.strategy.processes:
        records = run.records[process]
        keys = {k for r in records for k in r} - RECORD_FIELDS
        assert keys <= set(METRICS), keys - set(METRICS)
        assert all(METRICS[k].unit.strip() for k in keys)
        # Exactly the keys the vocabulary says this strategy logs.
        assert keys == expected_keys, (process, keys ^ expected_keys)
        for r in records:
            assert all(isinstance(r[k], int | float) and math.isfinite(r[k]) for k in r.keys() - {"time"})

        windows = run.windows(process)
        assert [r["step"] for r in windows] == list(range(LOG_INTERVAL, windows[-1]["step"] + 1,
                                                          LOG_INTERVAL))
        previous = {"step": 0, "progress/samples": 0, "progress/train_time_s": 0.0}
        for r in windows:
            steps = r["step"] - previous["step"]
            samples = r["progress/samples"] - previous["progress/samples"]
            clock_s = r["progress/train_time_s"] - previous["progress/train_time_s"]
            window_s = r["time/step_s"] * steps
            assert steps == LOG_INTERVAL and samples == steps * BATCH_SIZE, (process, r)
            assert 0 <= r["accuracy/train"] <= 1 and r["loss/train"] > 0
            # progress/*: cumulative, on the training clock; the window's seconds are the
            # clock's seconds between the two records, less the writing of the first.
            assert clock_s > 0
            assert window_s <= clock_s + 1e-6, (process, r)
            assert clock_s - window_s < 0.25, (process, r)
            # throughput/samples_per_s: the window's samples over its training-clock seconds.
            assert r["throughput/samples_per_s"] * window_s == pytest.approx(samples, rel=1e-6)
            # time/compute_s: time/step_s less what the step was blocked on communication.
            assert r["time/compute_s"] <= r["time/step_s"] + 1e-12
            blocked = r.get("time/comm_blocked_s", 0.0)
            assert 0 <= blocked <= r["time/step_s"] + 1e-9
            assert r["time/compute_s"] + blocked == pytest.approx(r["time/step_s"], rel=1e-9, abs=1e-12)
            if family != "baseline":  # ps and ddp split their communication time in two
                assert 0 <= r["time/comm_overlapped_s"]
                assert blocked + r["time/comm_overlapped_s"] <= r["time/step_s"] + 1e-9
            if run.strategy.name == "ps-sync":  # the last layers' shard went out during backward
                assert r["time/comm_overlapped_s"] > 0, (process, r)
            previous = r
        assert windows[-1]["progress/samples"] == NUM_EPOCHS * TRAIN_SAMPLES // len(run.strategy.processes)

        for r in run.evaluations(process):
            assert 0 <= r["accuracy/test"] <= 1 and r["loss/test"] > 0 and r["time/eval_s"] > 0
        # Every process evaluated the same model on the whole test set together.
        assert run.evaluations(process)[-1]["accuracy/test"] == run.summary["final_accuracy"]

    assert sum(run.windows(p)[-1]["progress/samples"] for p in run.strategy.processes) == \
        run.summary["samples_processed"]
    assert max(run.windows(p)[-1]["progress/train_time_s"] for p in run.strategy.processes) <= \
        run.summary["train_time_s"] + 1e-9


@pytest.mark.serial
@pytest.mark.timeout(240)
def test_tensorboard_reads_back_every_logged_key(slow_eval_run):
    run = slow_eval_run
    for process in run.strategy.processes:
        # TensorBoard's own reader finds every key of the JSONL, at its steps, with its values.
        keys = assert_tensorboard_mirrors_jsonl(run.log_dir / process)
        assert keys == expected(run.strategy), process


@pytest.mark.serial
@pytest.mark.timeout(240)
def test_byte_counts_are_per_step(slow_eval_run):
    run = slow_eval_run
    model_bytes = parameter_bytes(run.summary)
    for process in run.strategy.processes:
        windows = run.windows(process)
        if run.strategy.family == "ps":
            sent = [r["comm/bytes_sent"] for r in windows]
            received = [r["comm/bytes_received"] for r in windows]
            # One gradient out and one set of parameters in per step: the model's size
            # plus a little framing, the same in every window (a running total would grow).
            assert all(model_bytes <= b <= model_bytes + 1024 for b in sent), (model_bytes, sent)
            assert all(model_bytes <= b <= model_bytes + 1024 for b in received), (model_bytes, received)
            assert max(sent) - min(sent) <= 16 and max(received) - min(received) <= 16
            # The per-step means add up to the worker's own total of bytes sent (pushes only).
            worker = next(w for w in run.summary["workers"] if f"worker{w['rank']}" == process)
            assert sum(b * LOG_INTERVAL for b in sent) == pytest.approx(worker["bytes_sent"], abs=1)
            assert all(r["ps/rejected_pushes"] == 0 and r["ps/staleness"] >= 0 for r in windows)
            if run.strategy.name == "ps-sync":
                assert all(r["ps/staleness"] == 0 for r in windows)
        elif run.strategy.family == "ddp":
            # Each step hands the whole gradient to all-reduce once.
            assert all(r["comm/bytes_allreduced"] == model_bytes for r in windows), \
                (model_bytes, [r["comm/bytes_allreduced"] for r in windows])
        else:
            assert not any(k.startswith("comm/") for r in windows for k in r)


# -- one seeding rule ------------------------------------------------------------------------

SEEDING_TRAIN_SAMPLES = 320
SEEDING = ["--dataset", "digits", "--max-train-samples", SEEDING_TRAIN_SAMPLES,
           "--max-test-samples", 64, "--batch-size", BATCH_SIZE, "--num-epochs", 2,
           "--num-threads", 1, "--seed", 7]  # simplecnn (dropout) by default: 20 steps
SINGLE_PROCESS = {
    "baseline": (("baseline",), "baseline_final.pt"),
    "ps": (("ps", "--workers", 1, "--aggregation-mode", "sync"), "parameter_server_final.pt"),
    "ddp": (("ddp", "--world-size", 1), "ddp_final.pt"),
}
LIVE = {"ddp-live": (("ddp", "--world-size", 1, "--ddp-recovery", "live"), "ddp_final.pt")}


# The training features, the same in every strategy: warm-up then linear decay, AdamW with
# weight decay on the weights only, clipping of the applied gradient by its global norm.
# (AdamW's moments are Adam's: a separate Adam run would add no other state.)
FEATURES = ("--optimizer", "adamw", "--weight-decay", 0.05, "--lr-schedule", "linear", "--warmup-steps", 5,
            "--lr-decay-steps", 20, "--lr-min", 1e-4, "--clip-grad-norm", 0.5)


@pytest.fixture(scope="module")
def features_runs(tmp_path_factory):
    """One process of each strategy trained with the training features: the seeding rule's
    test below checks them, and the bf16 test takes the baseline's as its float32 model."""
    return train_one_process_each(tmp_path_factory.mktemp("features"), FEATURES)


@pytest.mark.timeout(300)
# Plain SGD runs the same path as the features' run (make test-extended runs it); the
# exactness of SGD across processes: test_ps_cluster, test_ddp_equivalence.
@pytest.mark.parametrize("optimizer", [pytest.param(("--optimizer", "sgd"), marks=pytest.mark.extended),
                                       FEATURES], ids=["sgd", "adamw-schedule-clipping"])
def test_one_process_of_every_strategy_trains_the_same_model(request, tmp_path, optimizer):
    models, steps = (request.getfixturevalue("features_runs") if optimizer == FEATURES
                     else train_one_process_each(tmp_path, optimizer))
    assert set(steps.values()) == {2 * SEEDING_TRAIN_SAMPLES // BATCH_SIZE}, steps

    reference = models["baseline"]
    for name in ("ps", "ddp"):
        assert models[name].keys() == reference.keys(), name
        for key, expected in reference.items():
            trained = models[name][key]
            assert trained.shape == expected.shape
            torch.testing.assert_close(trained, expected, rtol=0, atol=1e-5,
                                       msg=lambda m, n=name, k=key: f"{n} vs baseline, {k}: {m}")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.timeout(420)  # the features' runs too, where no test before it made them
def test_bf16_autocast_runs_in_every_strategy_on_the_cpu(tmp_path, features_runs):
    """DDP (restart and live recovery alike) steps the optimizer as the baseline does and
    ends with its very bf16 model. The
    server's fused kernel rounds differently in the last bits (1e-5 apart in float32),
    which bf16's rounding of the forward pass amplifies over the steps, so the PS model
    is near the bf16 baseline, not equal: nearer to it than to the float32 one (a PS
    worker computing in float32 would end within 1e-5 of that)."""
    models, _ = train_one_process_each(tmp_path, (*FEATURES, "--precision", "bf16"), (*SINGLE_PROCESS, *LIVE))
    full, _ = features_runs  # the same flags in float32
    assert max_difference(models["ddp"], models["baseline"]) <= 1e-5
    assert max_difference(models["ddp-live"], models["baseline"]) <= 1e-5  # live recovery's own trainer
    assert max_difference(models["ddp-live"], full["baseline"]) > 1e-3
    to_bf16, to_float32 = (max_difference(models["ps"], m["baseline"]) for m in (models, full))
    assert to_bf16 < to_float32 and to_float32 > 1e-3, (to_bf16, to_float32)


def train_one_process_each(tmp_path, optimizer, strategies=tuple(SINGLE_PROCESS)):
    """Train each of `strategies` in one process with `optimizer`'s flags; returns each
    one's final model and its summary's steps."""
    models, steps = {}, {}
    for name in strategies:
        args, final = {**SINGLE_PROCESS, **LIVE}[name]
        log_dir, checkpoint_dir = tmp_path / name / "logs", tmp_path / name / "ckpt"
        result = run_cli(*args, *SEEDING, *optimizer, "--log-dir", log_dir,
                         "--checkpoint-dir", checkpoint_dir, timeout=200)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        models[name] = load_checkpoint(checkpoint_dir / final)["model"]
        steps[name] = json.loads((log_dir / "summary.json").read_text())["steps"]
    return models, steps
