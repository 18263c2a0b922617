"""The overlap's contention `advise` measures: what an overlapped push's CPU work adds to
backward on this machine's cores (the medians of interleaved timings, worked by hand), the
push's work framed by the wire's own encoder, and the cost model the command builds taking
the measured value."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from disttrain.advise import Candidate, CompressionCost, Link, Workload
from disttrain.advise.comparison import cost_model
from disttrain.advise.contention import contention_s, measure_contention, push_work
from disttrain.advise.report import workload_lines
from disttrain.advise.workload import random_batch
from disttrain.config import load_config
from disttrain.data import describe_dataset
from disttrain.strategies.ps.wire.service import read_gradient
from disttrain.training import init_model

MB = 1e6


def workload(contention: float = 0.0) -> Workload:
    costs = {"quantization": CompressionCost("quantization", 0.01, int(10 * MB), 0.01, 0.004)}
    return Workload("test", 10_000_000, int(40 * MB), 10, 32, 0.1, 0.2, 0.01, 0.0, "given", costs,
                    overlap_contention_s=contention)


@pytest.mark.parametrize("alone, pushing, expected", [
    ([0.10, 0.30, 0.20], [0.25, 0.26, 0.90], 0.26 - 0.20),  # medians, not means: 0.9 is a pause
    ([0.10, 0.20, 0.30, 0.40], [0.20, 0.30, 0.40, 0.50], 0.35 - 0.25),  # an even count: the middle two
    ([0.20, 0.21, 0.22], [0.19, 0.20, 0.21], 0.0),  # faster beside the push: a free core, never below 0
    ([], [0.1], 0.0), ([0.1], [], 0.0),  # nothing timed: nothing assumed
])
def test_contention_is_the_median_backward_beside_a_push_less_the_median_alone(alone, pushing, expected):
    assert contention_s(alone, pushing) == pytest.approx(expected)


def small_model():
    config = load_config(None, {"training.model_architecture": "mlp", "training.dataset": "digits",
                                "training.batch_size": 8}, [])
    inputs, targets = random_batch(describe_dataset(config.training), 8)
    return init_model(config.training), inputs, targets


def test_the_push_work_frames_each_shards_slice_as_the_wire_does():
    model, inputs, targets = small_model()
    model(inputs).sum().backward()
    # the push's messages, read back as a shard reads a push: every slice's bytes, once
    frames = push_work(model, 3)()
    flat = b"".join(p.grad.reshape(-1).numpy().tobytes() for p in model.parameters())
    assert [read_gradient(f[0]).header.shard for f in frames] == [0, 1, 2]
    assert b"".join(bytes(read_gradient(f[0]).data) for f in frames) == flat


def test_the_timings_come_in_interleaved_pairs():
    model, inputs, targets = small_model()
    model(inputs).sum().backward()
    alone, pushing = measure_contention(model, inputs, targets, 2, pairs=3)
    assert len(alone) == len(pushing) >= 3
    assert all(t > 0 for t in alone + pushing)
    assert contention_s(alone, pushing) >= 0


def test_the_command_s_cost_model_takes_the_measured_contention():
    config = load_config(None, {"ps.num_servers": 4}, [])
    link, candidate = Link(1e8, 1e-3), Candidate("ps-sync", "none", 4)
    free, taken = cost_model(config, workload(0.0), link), cost_model(config, workload(0.05), link, 0.1)
    assert taken.overlap_contention_s == 0.05 and free.overlap_contention_s == 0.0
    assert taken.compute_cv == 0.1 and taken.overlap and taken.overlap_trial
    # three of four shards' pushes overlap backward (0.2 s): the credit less the contention
    credit = free.round_trip(candidate, 4).overlap_s
    assert credit > 0.05 and taken.round_trip(candidate, 4).overlap_s == pytest.approx(credit - 0.05)


def test_the_contention_is_reported_and_a_workload_saved_without_it_loads():
    measured = workload(0.0123)
    assert measured.to_dict()["overlap_contention_s"] == 0.0123
    assert measured.with_step_time(0.6).overlap_contention_s == 0.0123  # CPU work: kept as measured
    assert any("adds 12.3 ms to backward" in line for line in workload_lines(measured, Link(1e8, 1e-3)))
    saved = asdict(replace(measured, compression={}))
    del saved["overlap_contention_s"]
    assert Workload(**saved).overlap_contention_s == 0.0
