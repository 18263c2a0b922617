"""Steps and evaluations of a live trainer as its generation's training loop takes them,
for the tests that drive a `LiveTrainer` in a group they formed themselves: the next
pieces of its sampler through the one DDP participant, under a policy that leaves out
the group's step boundary (these tests take no joiners; the boundary has tests of its own)."""

from __future__ import annotations

import torch

from disttrain.strategies.ddp.live.participant import LiveRecovery
from disttrain.strategies.ddp.live.trainer import LiveTrainer
from disttrain.training.engine import EvalResult, StepResult
from disttrain.training.strategy import StepInfo


class NoBoundary(LiveRecovery):
    """Live recovery's policy without the step boundary (and the speed counted there)."""

    def __init__(self, trainer: LiveTrainer):
        super().__init__(trainer, None, 0, lambda step: None)  # type: ignore[arg-type]  # no group

    def place(self) -> tuple[int, int]:
        sampler = self.trainer.sampler
        assert sampler is not None, "attach() first"
        return sampler.rank, sampler.world_size

    def begin_step(self, samples: int) -> torch.nn.Module:
        return self.trainer.begin_step(samples)


def live_step(trainer: LiveTrainer) -> StepResult:
    """One step: this member's pieces of the next global batches (as many as
    `ddp.grad_accumulation_steps`, fewer at the epoch's end), as the loop hands them."""
    sampler, p = trainer.sampler, trainer.progress
    assert sampler is not None, "attach() first"
    micro_batches = trainer.config.ddp.grad_accumulation_steps
    count = min(micro_batches, trainer.batches_per_epoch - p.index)
    batches = [sampler.block(p.epoch, p.index + offset) for offset in range(count)]
    info = StepInfo(p.step + 1, p.epoch, p.index // micro_batches,
                    p.index + count >= trainer.batches_per_epoch)
    return trainer.participant(NoBoundary(trainer)).step(batches, info)


def live_evaluate(trainer: LiveTrainer) -> EvalResult:
    """The epoch-end evaluation; the trainer moves to the next epoch."""
    return trainer.participant(NoBoundary(trainer)).evaluate(trainer.progress.epoch)
