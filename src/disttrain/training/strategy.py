"""The contracts between the strategies and the rest.

- `RunOptions` (`options`, importable without torch: the command line builds it):
  how to run, beside what to train.
- `Strategy`: what the CLI (and later `compare`) knows of a strategy: run a config with
  run options, return the summary. Each strategy package offers one as `STRATEGY`.
- `Participant`: what a strategy gives the training loop, the parts that differ between
  strategies: the step, the evaluation, and the pieces it checkpoints (torchtitan's
  `Stateful` idea: `state_dict` / `load_state_dict`).
- `CheckpointStore`: where a process's checkpoints live and who writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from disttrain.config import Config
from disttrain.metrics.summary import RunSummary
from disttrain.training.engine import EvalResult, StepResult
from disttrain.training.options import RunOptions


class Strategy(Protocol):
    """A way to train one config."""

    name: str

    def run(self, config: Config, options: RunOptions) -> RunSummary | None:
        """Train to the end; return the summary (None in a process that does not write it).

        Raises:
            DisttrainError: bad input (ConfigError, DataError, CheckpointError) or a
                failed peer (DistributedError); the message is meant for the user.
        """
        ...


@dataclass(frozen=True)
class StepInfo:
    """Where a step falls: its number (from 1), its epoch, its index in the epoch, and
    whether it is the epoch's last (its batches end the shard: a local-update round ends)."""

    step: int
    epoch: int
    index_in_epoch: int
    ends_epoch: bool = False


class Participant(Protocol):
    """One process's part in training, as the loop drives it."""

    strategy: str  # the tag written into its checkpoints, checked on resume

    def start(self) -> None:
        """Called once, right before the training clock starts; may be a collective, so
        that every process's clock starts together (set-up skew is not training)."""
        ...

    def step(self, batches: list[torch.Tensor], info: StepInfo) -> StepResult:
        """Train on `batches` (sample indices; more than one with gradient accumulation)."""
        ...

    def evaluate(self, epoch: int) -> EvalResult:
        """The test-set figures of the model at the end of `epoch`; runs with the training
        clock stopped, and may be a collective (every process calls it together)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The pieces of this process's checkpoint that the loop does not own."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved. Raises CheckpointError when it does not fit."""
        ...


class CheckpointStore(Protocol):
    """Where one process's checkpoints are; `choose` and `save` may be collectives."""

    def choose(self, resume: bool) -> Path | None:
        """The checkpoint to resume from, or None to start afresh.

        Raises:
            ConfigError: not resuming, and the folder holds an earlier run's checkpoints.
        """
        ...

    def load(self, path: Path) -> dict[str, Any]:
        """The checkpoint at `path`, with `rng` holding this process's RNG state."""
        ...

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Write `state` (its `rng` is this process's) as the checkpoint of `step`."""
        ...
