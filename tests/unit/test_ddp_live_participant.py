"""A live generation in the one training loop (`TrainingLoop.train`): a run cut at a step
boundary (a change of group) and run again from the state at the cut logs each window and
evaluates each epoch once; the generation's checkpoints are its leader's alone and hold
the group's pieces, not one process's sampler and RNG."""

from __future__ import annotations

import dataclasses

import pytest

from disttrain.config import config_from_dict
from disttrain.core import checkpoint as ckpt
from disttrain.core.faults import FaultInjector
from disttrain.data import PlannedSampler
from disttrain.metrics.logger import MetricsLogger, read_metrics
from disttrain.strategies.ddp.live.checkpoints import LiveCheckpoints
from disttrain.strategies.ddp.live.participant import PROCESS_KEYS, LeaderStore
from disttrain.training.checkpoints import Position
from disttrain.training.engine import EvalResult, StepResult
from disttrain.training.loop import LoopRecords, LoopSettings, TrainingLoop
from disttrain.training.strategy import StepInfo


class Cut(Exception):
    """The group changes at this boundary (what `GroupChanges` is to the loop)."""


class Generation:
    """Steps that compute nothing; the step `cut_at` is cut short once, before it trains."""

    strategy = "ddp-live"

    def __init__(self, cut_at: int):
        self.cut_at: int | None = cut_at
        self.trained: list[int] = []
        self.evaluated: list[int] = []

    def start(self) -> None:
        pass

    def step(self, batches, info: StepInfo) -> StepResult:
        if info.step == self.cut_at:
            self.cut_at = None
            raise Cut(f"the group changes before step {info.step}")
        self.trained.append(info.step)
        return StepResult(loss=1.0, num_correct=1, num_samples=len(batches[0]))

    def evaluate(self, epoch: int) -> EvalResult:
        self.evaluated.append(epoch)
        return EvalResult(loss_sum=50.0, num_correct=60, num_samples=100)

    def state_dict(self) -> dict:
        return {"model": {"trained": len(self.trained)}}

    def load_state_dict(self, state: dict) -> None:
        pass


@pytest.mark.parametrize("cut_at", [2, 3])  # mid-epoch; an epoch's first step, after its checkpoint
def test_a_generation_cut_at_a_boundary_runs_on_from_its_state_logging_nothing_twice(tmp_path, cut_at):
    config = config_from_dict({"training": {"num_epochs": 2, "batch_size": 4, "log_interval": 1,
                                            "checkpoint_interval": 2}})
    settings = dataclasses.replace(LoopSettings.of(config.training, config.to_dict()), shards=None)
    participant, position = Generation(cut_at), Position()
    sampler = PlannedSampler(8, world_size=1, rank=0, shares=[4])
    checkpoints = LiveCheckpoints(tmp_path / "ckpt", interval=2, keep=4)
    loop = TrainingLoop(settings, participant, sampler, LeaderStore(checkpoints, is_leader=True),
                        tmp_path / "rank0", FaultInjector((), "rank"), lambda total, done: None,
                        position=position)
    assert loop.store.choose(resume=True) is None  # a generation starts from its members' state
    records = LoopRecords(MetricsLogger(tmp_path / "rank0", tensorboard=False), "classification", 1, 2)
    with pytest.raises(Cut):
        loop.train(records)
    assert position.step == cut_at - 1
    sampler.epoch, sampler.index = position.epoch, (cut_at - 1) % 2  # the next generation's, at the state
    assert loop.train(records) is not None
    records.metrics.close()
    checkpoints.close()

    logged = read_metrics(tmp_path / "rank0" / "metrics.jsonl")
    assert [r["step"] for r in logged if "loss/train" in r] == [1, 2, 3, 4]
    assert [r["epoch"] for r in logged if "accuracy/test" in r] == [0, 1]
    assert participant.trained == [1, 2, 3, 4] and participant.evaluated == [0, 1]
    # The last, written after its epoch's evaluation (the writer may skip an older one still queued).
    state = ckpt.load_checkpoint(tmp_path / "ckpt" / ckpt.checkpoint_name(4))
    assert state["model"] == {"trained": 4} and not set(PROCESS_KEYS) & set(state)


def test_only_the_generations_leader_writes_its_checkpoints(tmp_path):
    checkpoints = LiveCheckpoints(tmp_path, interval=1, keep=2)
    LeaderStore(checkpoints, is_leader=False).save(1, {"model": {}, "rng": [], "sampler": {}})
    checkpoints.close()
    assert not list(tmp_path.iterdir())
