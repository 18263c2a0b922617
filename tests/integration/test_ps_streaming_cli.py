"""Streaming DiLoCo on the parameter server from the command line (`disttrain ps
--sync-every 4 --set training.outer_fragments=F --servers F`), two workers on digits: the
run trains; each fragment is a group of whole shards, so a push inside an epoch goes to
one fragment's shards and the bytes on the wire are about 1/F of the model's (every
fragment at an epoch's end); int8 pushes (`compression.type quantization`) send about a
quarter of them; every sample is applied once by the shards' ledgers (each fragment's
shards hold one block per round of its own); and a run stopped inside the rounds (one
worker SIGTERMed: every worker and shard checkpoints at one step) and resumed with
`--resume` ends bit-identical to one never stopped. With a delay (`training.outer_delay`
2) the pushes leave at the same steps and land two steps later, and the stop falls between
a push and its landing: the checkpoint keeps the result and the steps it has left."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from disttrain.config import load_config
from disttrain.core import checkpoint as ckpt
from disttrain.metrics.logger import read_metrics
from disttrain.training.models import count_parameters, init_model

# Two epochs of 8 steps per worker, rounds of 4, Adam inside the rounds, dropout (per-worker
# RNG), Nesterov outside on the shards.
TRAIN, EPOCHS, STEPS_PER_EPOCH, H = 512, 2, 8, 4
ARGS = ["--workers", 2, "--dataset", "digits", "--max-train-samples", TRAIN, "--max-test-samples", 64,
        "--num-epochs", EPOCHS, "--batch-size", 32, "--seed", 3, "--optimizer", "adam",
        "--set", "training.log_interval=1", "--heartbeat-timeout", 60,
        "--sync-every", H, "--outer-optimizer", "nesterov", "--outer-lr", 0.7, "--outer-momentum", 0.9]
STOPPED = re.compile(r"error: preempted by SIGTERM: .*run the same command with --resume to go on")


def dirs(run_dir: Path) -> list:
    return ["--log-dir", run_dir / "logs", "--checkpoint-dir", run_dir / "ckpt"]


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(run_dir / "ckpt" / "parameter_server_final.pt")["model"]


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "logs" / "summary.json").read_text())


def round_ends(fragment: int, num_fragments: int) -> list[int]:
    """The steps of an epoch that end `fragment`'s rounds (`training.fragments`)."""
    offset = fragment * H // num_fragments
    return [s for s in range(1, STEPS_PER_EPOCH + 1) if (s - offset) % H == 0 or s == STEPS_PER_EPOCH]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("num_fragments", "extra"), [
    # make test-extended: the plain outer step (mixing 0) on two fragments; make test runs
    # the same stop and resume with four compressed fragments and with two delayed ones.
    pytest.param(2, [], id="fragments-2", marks=pytest.mark.extended),
    (4, ["--compression-enabled", "--compression-type", "quantization",
         "--set", "training.outer_mixing=0.5"]),
    (2, ["--set", "training.outer_delay=2", "--set", "training.outer_mixing=0.5"]),
], ids=["fragments-2", "fragments-4-int8-mixing", "fragments-2-delay-2-mixing"])
def test_streaming_pushes_one_fragment_to_its_shards_applies_every_sample_once_and_resumes_bit_identical(
        cli, tmp_path, num_fragments, extra):
    args = [*ARGS, "--servers", num_fragments, "--set", f"training.outer_fragments={num_fragments}", *extra]
    compressed, delay = "quantization" in extra, "training.outer_delay=2" in extra
    reference = cli("ps", *args, *dirs(tmp_path / "whole"), timeout=240)
    assert reference.returncode == 0, reference.stderr[-3000:]
    log = (tmp_path / "whole" / "logs" / "worker0.log").read_text()
    assert f"streaming: {num_fragments} fragment(s) at staggered steps" in log

    summary = summary_of(tmp_path / "whole")
    assert summary["samples_applied"] == EPOCHS * TRAIN and summary["samples_lost"] == 0
    assert summary["samples_redone"] == 0 and summary["outer_fragments"] == num_fragments
    # Each shard's version counts its fragment's rounds (one shard per fragment here).
    assert summary["shard_versions"] == [EPOCHS * len(round_ends(f, num_fragments))
                                         for f in range(num_fragments)]
    assert 0 < summary["final_accuracy"] <= 1

    # The bytes each push put on the wire: inside an epoch one fragment's, about 1/F of
    # the model (with int8 a quarter of that); at its end every fragment's.
    logs = tmp_path / "whole" / "logs"
    model_bytes = 4 * count_parameters(init_model(load_config(logs / "config.yaml").training))
    steps = [r for r in read_metrics(logs / "worker0" / "metrics.jsonl") if "loss/train" in r]
    assert [r["step"] for r in steps] == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    sent = {r["step"]: r.get("comm/bytes_sent", 0) for r in steps}
    # Every fragment completed a round (1, then 2) at step 4 and the epoch's end; delayed,
    # fragment 0's first lands two steps after it was sent, at step 6.
    completed = [r["step"] for r in steps if r["local/rounds"] and r["step"] <= STEPS_PER_EPOCH]
    assert completed == ([6, STEPS_PER_EPOCH] if delay else [H, STEPS_PER_EPOCH])
    # Each push's gradient was computed on one step of its fragment's shards.
    assert all(r["ps/step_spread"] == 0 for r in steps if "ps/step_spread" in r)
    pushes = sorted({s for f in range(num_fragments) for s in round_ends(f, num_fragments)})
    dense = model_bytes if not compressed else model_bytes / 4  # int8: one byte per value
    share = dense / num_fragments
    if delay:
        # A delayed push leaves on its own thread, counted at the step it went out by; an
        # epoch's last step lands every push in flight: each epoch's pushes are its own.
        for epoch in range(EPOCHS):
            total = sum(sent[epoch * STEPS_PER_EPOCH + s] for s in range(1, STEPS_PER_EPOCH + 1))
            expected_bytes = (len(pushes) - 1) * share + dense
            assert 0.95 * expected_bytes <= total <= 1.05 * expected_bytes, (total, expected_bytes)
        # Landed pushes ran beside inner steps.
        assert sum(r.get("time/comm_overlapped_s", 0.0) for r in steps) > 0
    else:
        assert sorted(s for s in sent if sent[s] and s <= STEPS_PER_EPOCH) == pushes
        inside = [sent[s] for s in pushes if s != STEPS_PER_EPOCH]
        ends = [sent[STEPS_PER_EPOCH], sent[EPOCHS * STEPS_PER_EPOCH]]
        assert all(0.9 * share <= b <= 1.1 * share for b in inside), (inside, dense)
        assert all(0.97 * dense <= b <= 1.05 * dense for b in ends), (ends, dense)
        assert max(sent.values()) == max(ends) and max(inside) <= 1.1 * max(ends) / num_fragments
    if compressed:
        compressed = sum(r["compression/bytes_sent"] for r in steps)
        assert 3.5 < sum(r["compression/bytes_dense"] for r in steps) / compressed <= 4

    # Stopped inside the rounds: worker 1 SIGTERMed at a step; the run stops at one step, the
    # highest any worker had committed to when the signal reached it. Worker 1 waits at that
    # step's end for the agreement, so worker 0 gets at most to the step that needs worker 1's
    # next push: without a delay the next push's (every push waits for both workers'), with
    # a delay the step that lands it, two later. SIGTERMed at step 5, a delayed run could
    # reach the epoch's last step (8) under load; at step 3 it stops by step 6.
    term_step = 3 if delay else 5
    stopped = cli("ps", *args, *dirs(tmp_path / "cut"), "--inject", f"term:worker=1:step={term_step}",
                  timeout=240)
    assert stopped.returncode == 143 and STOPPED.search(stopped.stderr), stopped.stderr[-3000:]
    # Every worker checkpointed the step it stopped at: some fragment inside its round.
    newest = ckpt.list_checkpoints(tmp_path / "cut" / "ckpt" / "worker1")[-1]
    step = ckpt.checkpoint_step(newest)
    assert term_step <= step < STEPS_PER_EPOCH
    fragments = ckpt.load_checkpoint(newest)["local"]["outer"]["fragments"]
    assert len(fragments) == num_fragments
    assert [f["steps_in_round"] for f in fragments] == [
        step - max([0] + [s for s in round_ends(f, num_fragments) if s <= step])
        for f in range(num_fragments)]
    assert any(f["steps_in_round"] > 0 for f in fragments)
    # With the delay the last push before the stop is in flight: it lands 2 steps after it.
    last_sent = max((max([0] + [s for s in round_ends(f, num_fragments) if s <= step]), f)
                    for f in range(num_fragments))
    in_flight = [(e["fragment"], e["steps_left"])
                 for e in ckpt.load_checkpoint(newest)["local"]["outer"].get("in_flight", [])]
    assert in_flight == ([(last_sent[1], last_sent[0] + 2 - step)] if delay else [])

    resumed = cli("ps", *args, *dirs(tmp_path / "cut"), "--resume", timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, trained = final_model(tmp_path / "whole"), final_model(tmp_path / "cut")
    assert expected.keys() == trained.keys()
    assert all(torch.equal(expected[name], trained[name]) for name in expected)
    cut = summary_of(tmp_path / "cut")
    assert cut["resumed_from_step"] == step
    assert cut["samples_applied"] == EPOCHS * TRAIN and cut["samples_lost"] == cut["samples_redone"] == 0
