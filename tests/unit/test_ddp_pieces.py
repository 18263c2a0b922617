"""DDP pieces tested alone: comm-hook timing, RNG codec, evaluation slices, the launcher's
arguments and error lines, the rendezvous endpoint check (with a fake clock)."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from disttrain.cli.ddp import rank_parser
from disttrain.cli.flags import options_from_args
from disttrain.config import config_from_dict
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import ConfigError, DistributedError
from disttrain.core.faults import format_fault, parse_fault
from disttrain.core.process_spec import command_line
from disttrain.metrics.keys import check_keys
from disttrain.metrics.summary import RunSummary
from disttrain.strategies.ddp import rng
from disttrain.strategies.ddp.comm_hooks import CommSample, CommStats, split_intervals, union_length
from disttrain.strategies.ddp.endpoint import wait_for_endpoint
from disttrain.strategies.ddp.launcher import child_failure, launch_config, preflight, rank_spec
from disttrain.training.engine import eval_slice
from disttrain.training.options import RunOptions


def test_union_counts_overlapping_buckets_once():
    assert union_length([]) == 0.0
    assert union_length([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert union_length([(2.0, 3.0), (0.0, 5.0)]) == pytest.approx(5.0)


def test_comm_stats_drain_resets():
    stats = CommStats(clock=lambda: 0.0)
    stats.record(0.0, 0.25, 400)
    stats.record(0.1, 0.30, 100)
    sample = stats.drain()
    assert (sample.num_bytes, sample.num_buckets) == (500, 2)
    # The last bucket went out at 0.1: what ran after it blocked the step, the rest overlapped.
    assert (sample.blocked_s, sample.overlapped_s) == (pytest.approx(0.2), pytest.approx(0.1))
    assert stats.drain().num_buckets == 0


def test_a_steps_comm_figures_are_keys_of_the_metrics_vocabulary():
    scalars = CommSample(blocked_s=0.25, overlapped_s=0.5, num_bytes=400, num_buckets=2).scalars()
    assert scalars == {"time/comm_blocked_s": 0.25, "time/comm_overlapped_s": 0.5,
                       "comm/bytes_allreduced": 400}
    check_keys(scalars)  # the logger's check: every key declared in metrics.keys
    assert set(CommSample().scalars().values()) == {0}


def test_blocked_and_overlapped_split_the_union():
    assert split_intervals([]) == (0.0, 0.0)
    assert split_intervals([(1.0, 2.0)]) == (pytest.approx(1.0), 0.0)  # one bucket: all blocked
    blocked, overlapped = split_intervals([(0.0, 1.0), (3.0, 3.5), (2.0, 4.0)])
    assert (blocked, overlapped) == (pytest.approx(1.0), pytest.approx(2.0))


def test_rng_state_survives_the_tensor_codec():
    random.seed(3)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state
    np.random.seed(4)
    torch.manual_seed(5)
    state = ckpt.rng_state()
    tensors = rng.encode(state)
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    ckpt.set_rng_state(rng.decode(tensors))
    assert (random.random(), float(np.random.rand())) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])


def test_eval_slices_cover_every_test_sample_once():
    slices = [eval_slice(11, 4, rank) for rank in range(4)]
    assert torch.equal(torch.cat(slices), torch.arange(11))
    assert [len(eval_slice(3, 5, 0)), len(eval_slice(3, 5, 4))] == [1, 0]


def test_faults_pass_to_the_ranks_unchanged():
    faults = tuple(parse_fault(text) for text in (
        "kill:rank=1:step=7:attempt=0", "kill:rank:step=3:attempt=2", "slow-eval:rank=0:for=1.5s",
        "slow:rank=1:factor=2:step=4:until=9"))
    for fault in faults:
        assert parse_fault(format_fault(fault)) == fault
    options = RunOptions(resume=True, faults=faults)
    args = command_line(rank_spec(Path("c.yaml"), Path("s.json"), options))
    assert args[:3] == ["-u", "-m", "disttrain.torchrun"]
    assert "--resume" in args and "--inject=kill:rank=1:step=7" in args
    assert options_from_args(rank_parser().parse_args(args[3:]), env={}).faults == faults


def test_launch_config_uses_c10d_restarts_and_timeouts(tmp_path):
    ddp = config_from_dict({"ddp": {"max_restarts": 2, "timeout_s": 7.5}}).ddp
    standalone = launch_config(ddp, 3, tmp_path)
    assert (standalone.rdzv_backend, standalone.rdzv_endpoint) == ("c10d", "localhost:0")
    assert (standalone.nproc_per_node, standalone.max_restarts) == (3, 2)
    assert standalone.rdzv_configs["join_timeout"] == 8 and standalone.rdzv_configs["is_host"]
    nodes = config_from_dict({"ddp": {"num_nodes": 2, "rdzv_endpoint": "node0:29400"}}).ddp
    shared = launch_config(nodes, 4, tmp_path)
    assert (shared.min_nodes, shared.max_nodes, shared.rdzv_endpoint) == (2, 2, "node0:29400")
    assert shared.run_id == "disttrain" and "is_host" not in shared.rdzv_configs


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None) -> ProcessFailure:
    error_file = tmp_path / f"error{rank}.json"
    if message is not None:
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "Traceback ...", "timestamp": "1"}}}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(error_file))


def test_child_failure_is_one_line_with_the_killed_rank_first(tmp_path):
    error = ChildFailedError("disttrain.torchrun", {
        0: _failure(tmp_path, 0, 1, "DistributedError: lost contact with another rank"),
        1: _failure(tmp_path, 1, -9, None),
    })
    line = str(child_failure(error, max_restarts=1))
    assert line.startswith("rank 1 was killed by SIGKILL; rank 0 failed with exit code 1: lost contact")
    assert line.endswith("(after 1 restart(s))") and "\n" not in line


def test_a_rank_the_agent_stopped_comes_after_the_rank_whose_error_stopped_the_group(tmp_path):
    error = ChildFailedError("disttrain.torchrun", {
        0: _failure(tmp_path, 0, 1, "ValueError: a bug at the fourth forward"),
        1: _failure(tmp_path, 1, -15, None),
    })
    assert str(child_failure(error, max_restarts=0)) == \
        "rank 0 failed with exit code 1: a bug at the fourth forward; rank 1 was killed by SIGTERM"


def test_child_config_error_keeps_exit_code_two(tmp_path):
    error = ChildFailedError("disttrain.torchrun", {1: _failure(tmp_path, 1, 2, "ConfigError: bad value")})
    result = child_failure(error, max_restarts=0)
    assert isinstance(result, ConfigError) and str(result) == "rank 1: bad value"


def test_summary_round_trip(tmp_path):
    summary = RunSummary("ddp", "digits", 0.9, 0.3, 5.0, 4.0, 100.0, 500, 8, 1, 2, {"a": 1}, {"0.90": 3.0},
                         extra={"backend": "gloo", "restarts": 1})
    summary.write(tmp_path)
    assert RunSummary.read(tmp_path) == summary
    with pytest.raises(ValueError, match="not a run summary"):
        (tmp_path / "other.json").write_text('{"strategy": "ddp"}')
        RunSummary.read(tmp_path / "other.json")


def test_preflight_refuses_bad_input_before_any_process(tmp_path):
    def config(**ddp):
        return config_from_dict({"training": {"dataset": "synthetic", "num_samples": 3},
                                 "system": {"num_workers": 2, "checkpoint_dir": str(tmp_path)},
                                 "ddp": ddp})

    assert preflight(config(), resume=False).ranks_per_node == 2
    too_many = config().replace(system={"num_workers": 4})
    with pytest.raises(ConfigError, match="world size 4 is larger than the 3 training samples"):
        preflight(too_many, resume=False)
    uneven = config(num_nodes=3, rdzv_endpoint="node0:1")
    with pytest.raises(ConfigError, match="does not split evenly"):
        preflight(uneven, resume=False)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="nccl needs CUDA"):
            preflight(config(backend="nccl"), resume=False)
    (tmp_path / ckpt.checkpoint_name(4)).write_bytes(b"x")
    with pytest.raises(ConfigError, match="--resume"):
        preflight(config(), resume=False)
    assert preflight(config(), resume=True).backend in ("gloo", "nccl")


class FakeTime:
    def __init__(self):
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_endpoint_check_waits_for_a_late_host_then_gives_up():
    fake, attempts = FakeTime(), []

    def refuse_twice(address, timeout):
        attempts.append(address)
        fake.now += 0.01
        if len(attempts) <= 2:
            raise ConnectionRefusedError(111, "Connection refused")
        return socket.socket()

    wait_for_endpoint("192.0.2.1:29400", 5.0, connect=refuse_twice, clock=fake.clock, sleep=fake.sleep)
    assert attempts == [("192.0.2.1", 29400)] * 3

    def never(address, timeout):
        fake.now += timeout
        raise TimeoutError("timed out")

    fake.now = 0.0
    expected = r"nothing answered at 192.0.2.1:29400 within 3s \(timed out\)"
    with pytest.raises(DistributedError, match=expected):
        wait_for_endpoint("192.0.2.1:29400", 3.0, connect=never, clock=fake.clock, sleep=fake.sleep)
    assert 3.0 <= fake.now < 6.0  # gave up at the deadline, not long after


def test_endpoint_check_names_an_unknown_host():
    with pytest.raises(DistributedError, match="cannot resolve host 'nohost.invalid'"):
        wait_for_endpoint("nohost.invalid:29400", 1.0, connect=None)


def test_endpoint_hosted_here_is_not_probed():
    wait_for_endpoint("localhost:1", 1.0, connect=None)  # the agent will host it


def test_ddp_checkpoint_gives_each_rank_its_own_rng(tmp_path):
    from disttrain.core.errors import CheckpointError
    from disttrain.strategies.ddp.runtime import RankInfo, Runtime
    from disttrain.strategies.ddp.store import RankZeroCheckpoints

    states = []
    for seed in (10, 11):  # what each rank's RNG held at the checkpoint
        torch.manual_seed(seed)
        states.append(ckpt.rng_state())
    path = tmp_path / ckpt.checkpoint_name(5)
    ckpt.atomic_torch_save({"strategy": "ddp", "world_size": 2, "rng": states}, path)

    def store(rank: int, world_size: int) -> RankZeroCheckpoints:
        runtime = Runtime(RankInfo(rank, world_size, rank, world_size), "gloo", torch.device("cpu"), 1)
        return RankZeroCheckpoints(tmp_path, 3, runtime)

    loaded = store(1, 2).load(path)
    assert torch.equal(loaded["rng"]["torch"], states[1]["torch"])  # rank 1's own stream
    ckpt.atomic_torch_save({"strategy": "ddp", "world_size": 2, "rng": states[:1]}, path)
    with pytest.raises(CheckpointError, match="written by 1 ranks"):  # a list that does not match
        store(0, 2).load(path)
    assert ckpt.checkpoint_step(path) == 5 and ckpt.checkpoint_step(tmp_path / "x.pt") == -1
