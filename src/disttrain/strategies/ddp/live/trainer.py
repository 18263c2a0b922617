"""What a live rank trains, and the state its group hands over: model, optimizer and
schedule, the position in the run, the data ledger, the evaluations and the recoveries.

A live member steps through the one DDP participant (`ddp.participant`), as a
restart-mode rank does, and so through torch's DDP module (`participant.wrap_model`:
bucketed all-reduces overlapped with backward, the same timing and compression hooks),
wrapped again for each generation of its group at the generation's first step and
dropped (`drop_wrapper`) before the member leaves the group, so that leaving frees the
group and closes its sockets (`group.release`).

The global batches are fixed (`batch_size` x the run's world size, cut from each epoch's
permutation as the planned sampler cuts them); each generation splits them over its
members, evenly or, under `system.balance`, by their speeds (`ddp.balance`).
A step's gradient is that of its whole global batch whatever the split (each
member's loss is weighted by its share), so a step redone by fewer ranks after a failure
trains on the same samples. With local updates (`training.sync_every`) the members
average once per round instead, through restart mode's rounds (`ddp.local_updates`), and
a change of group mid-round sends every member back to the round's start
(see `begin_step`).
With gradient accumulation a step takes up to `ddp.grad_accumulation_steps` global
batches (each member's micro-batches, then one all-reduce), and a failed step redoes all
of them. The ledger counts, per epoch and global batch, the updates applied from it: 1
everywhere at the end means nothing lost and nothing twice.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from disttrain.config import Config
from disttrain.core.errors import ConfigError
from disttrain.data import PlannedSampler, load_datasets
from disttrain.data.datasets import shard_layout
from disttrain.metrics.window import TrainClock
from disttrain.strategies.ddp.balance import LiveBalance
from disttrain.strategies.ddp.live.membership import split_batch
from disttrain.strategies.ddp.local_updates import LocalRounds
from disttrain.strategies.ddp.participant import DDPParticipant, RankData, RankTraining, Recovery, wrap_model
from disttrain.training.engine import EvalResult
from disttrain.training.loading import prefetch
from disttrain.training.local_updates import LocalUpdates

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where the run stands, the same on every member of a generation once synced."""

    epoch: int = 0
    index: int = 0  # global batches of this epoch applied
    step: int = 0
    train_time_s: float = 0.0
    admitted: int = 0  # join tickets taken care of
    evaluations: list[list[float]] = field(default_factory=list)  # [train_time_s, accuracy, loss]
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    plans: list[list[Any]] = field(default_factory=list)  # balanced splits: [epoch, batch, batches]
    replans: int = 0  # of those, made by a speed check within a generation
    # The run's global batch and first size, kept when it resumes on another size.
    global_batch: int = 0
    first_world_size: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "step": self.step,
                "train_time_s": self.train_time_s, "admitted": self.admitted,
                "evaluations": self.evaluations, "recoveries": self.recoveries,
                "plans": self.plans, "replans": self.replans, "global_batch": self.global_batch,
                "first_world_size": self.first_world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index, self.step = int(state["epoch"]), int(state["index"]), int(state["step"])
        self.train_time_s, self.admitted = float(state["train_time_s"]), int(state["admitted"])
        self.evaluations = [list(e) for e in state["evaluations"]]
        self.recoveries = [dict(r) for r in state["recoveries"]]
        self.plans = [list(plan) for plan in state["plans"]]
        self.replans = int(state["replans"])
        self.global_batch, self.first_world_size = int(state["global_batch"]), int(state["first_world_size"])


class LiveTrainer:
    """One live rank's model, optimizer and data, and the run's progress and ledger.

    Args:
        config: the run's config (one process of `system.num_workers`).
        slot: this process's rank in the run as started (its training seed).
    """

    def __init__(self, config: Config, slot: int):
        training = config.training
        self.config, self.slot = config, slot
        self.train_set, self.test_set = load_datasets(training)
        # A data set read by shards (`shards:`): its epochs ordered shard by shard, its
        # reader told the shards this member's pieces will read, as the training loop does.
        self.shards = shard_layout(training)
        # The global batch stays the run's (survivors take a lost member's share), so
        # `ddp.lr_scaling` scales by the run's world size, whatever the group's size, and
        # the compression's `auto` collective is chosen for the size the run starts at.
        # Live groups train on the CPU (bf16 autocast; fp16's loss scaling is not offered).
        built = RankTraining.build(training, config.ddp, config.compression, torch.device("cpu"), slot,
                                   config.system.num_workers)
        self.training = built
        self.module, self.optimizer, self.precision = built.module, built.optimizer, built.precision
        self.stepper, self.comm, self.compression = built.stepper, built.comm, built.compression
        local_updates = LocalUpdates.of(training)
        self.rounds = None if local_updates is None else \
            LocalRounds(local_updates, self.module, self.compression)
        # With local updates, the state the round under way began from (None between rounds).
        self._round_start: dict[str, Any] | None = None
        self.loader = prefetch(self.train_set, training.loader_workers)
        self.global_batch = training.batch_size * config.system.num_workers
        self.batches_per_epoch = len(self.train_set) // self.global_batch
        self.num_epochs = training.num_epochs
        self.progress = Progress(global_batch=self.global_batch,
                                 first_world_size=config.system.num_workers)
        self.ledger = torch.zeros(self.num_epochs, self.batches_per_epoch, dtype=torch.int32)
        self.has_state = True
        self.sampler: PlannedSampler | None = None
        balanced = config.system.balance != "none"
        self.balance = LiveBalance(config.system, self.global_batch) if balanced else None
        self.blocked_s = 0.0  # the last step's wait in the all-reduce
        # The module in DDP over this generation's group (made at its first step; None
        # between generations, and with local updates, whose steps are the plain module's).
        self.ddp: DistributedDataParallel | None = None
        self.samples_trained = 0  # by this process, failed steps included
        self.samples_redone = 0  # of steps whose all-reduce failed here (the group redoes them)
        self._in_flight = 0
        # The clock the training loop runs each generation on (`TrainingLoop.clock`): stopped
        # during evaluation and checkpoint writes (`clock.paused()`), so throughput leaves them out.
        self.clock = TrainClock()
        self.clock.start()

    @property
    def finished(self) -> bool:
        return self.progress.epoch >= self.num_epochs

    @property
    def epoch_done(self) -> bool:
        return self.progress.index >= self.batches_per_epoch

    def train_time_s(self) -> float:
        return self.clock.elapsed()

    def _set_clock(self, train_time_s: float) -> None:
        """The training clock reads on from `train_time_s` (a state taken, or kept across
        a rollback)."""
        self.clock = TrainClock(train_time_s)
        self.clock.start()

    @property
    def at_round_boundary(self) -> bool:
        """Whether this member may take joiners now: always, or with local updates only
        between rounds."""
        return self._round_start is None

    def state_dict(self) -> dict[str, Any]:
        """The run's state as this member holds it (with local updates, mid-round: as the
        round began)."""
        if self._round_start is not None:
            return dict(self._round_start)
        state = self._current_state()
        if self.rounds is not None:
            state["outer"] = self.rounds.outer.state_dict()
        return state

    def _current_state(self) -> dict[str, Any]:
        self.progress.train_time_s = self.train_time_s()
        state = {"model": self.module.state_dict(), **self.stepper.state_dict(),
                 "progress": self.progress.state_dict(), "ledger": self.ledger}
        if self.compression is not None:
            state["compression"] = self.compression.shared_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer's state (the optimizer's is built from scratch, so a joiner that never
        stepped takes the same as a survivor), its compression's shared state included (see
        `compression.ddp_hooks`; a state without one, a checkpoint of an uncompressed run, leaves
        this member's fresh).

        Raises:
            ConfigError: the state was written with another compression scheme, or with
                local updates when the run has none (or the reverse).
        """
        if (self.rounds is None) != ("outer" not in state):
            raise ConfigError("the state was written " + ("without" if self.rounds else "with")
                              + " local updates (training.sync_every); resume with the run's setting")
        if self.rounds is not None:
            try:
                self.rounds.outer.load_state_dict(state["outer"])
            except ValueError as e:
                raise ConfigError(f"the state's local updates: {e}") from e
        self._round_start = None  # a round under way here is given up
        self._load_training(state)
        if self.compression is not None and "compression" in state:
            try:
                self.compression.load_shared_state(state["compression"])
            except ValueError as e:
                raise ConfigError(str(e)) from e
        self.has_state = True

    def _load_training(self, state: dict[str, Any]) -> None:
        """Model, optimizer, position and ledger from `state`."""
        self.module.load_state_dict(state["model"])
        self.optimizer.state.clear()
        self.stepper.load_state_dict(state)
        self.progress.load_state_dict(state["progress"])
        self.ledger = state["ledger"].clone()
        self._keep_global_batch(self.progress)
        self._set_clock(self.progress.train_time_s)

    def _keep_global_batch(self, progress: Progress) -> None:
        """The state's global batch becomes this process's: a run resumed on another size
        (or joined by a rank of another range) trains the global batches of the run that
        wrote it, each size splitting them over its members, as a run that shrank or grew
        while it ran. Its learning rate is the state's too (the optimizer's groups)."""
        if progress.global_batch != self.global_batch:
            logger.info("the run's global batch of %d is kept (this launch's size alone would make it %d)",
                        progress.global_batch, self.global_batch)
            self.global_batch = progress.global_batch
            self.batches_per_epoch = len(self.train_set) // self.global_batch
            if self.balance is not None:
                self.balance = LiveBalance(self.config.system, self.global_batch)

    def drop_state(self) -> None:
        """Left out of a generation: this process's state is no longer the run's."""
        self.has_state = False

    def attach(self, rank: int, world_size: int) -> None:
        """Split the global batches over this generation's group (call once the state is
        synced; a collective under `system.balance`, see `ddp.balance`); its DDP module
        is made at its first step."""
        self.drop_wrapper()
        shares = None if self.balance is None else self.balance.shares(world_size)
        if shares is not None:
            self._record_plan(shares)
            if rank == 0:
                logger.info("balanced batches %s from step %d (speeds of the last checks)", list(shares),
                            self.progress.step)
        self.sampler = PlannedSampler(len(self.train_set), world_size=world_size, rank=rank,
                                      seed=self.config.training.seed,
                                      shares=shares or split_batch(self.global_batch, world_size))
        if self.shards is not None:
            self.sampler.read_by_shards(self.shards.shard_sizes)
        self._follow(self.sampler)
        if self.balance is not None:
            # this generation's training clock (set before it starts, kept until `detach`)
            self.balance.start(self.sampler, rank, lambda: self.clock.elapsed())
        if self.compression is not None:  # every member's residual starts again at zero
            self.compression.clear_residuals()
        self._load_ahead()

    def participant(self, recovery: Recovery) -> DDPParticipant:
        """This generation's participant in the loop (call after `attach`): the one DDP
        participant over this member's model, rounds and pieces of the global batches,
        under `recovery`."""
        data = RankData(self.loader or self.train_set, self.test_set, self.sampler,
                        self.config.training.eval_batch_size)
        return DDPParticipant(self.training, self.rounds, data, recovery)

    def _follow(self, sampler: PlannedSampler) -> None:
        """The sampler at the run's position, so a re-plan starts at the next global batch."""
        sampler.epoch, sampler.index = self.progress.epoch, self.progress.index

    def _record_plan(self, shares: tuple[int, ...]) -> None:
        """A balanced split adopted from the next global batch, for the summary."""
        p = self.progress
        p.plans.append([p.epoch, p.index, list(shares)])

    def after_step(self, samples: int, waited_s: float = 0.0) -> None:
        """Under `system.balance`: count the step's work (call after everything that slows
        this member; its waits for peers, the all-reduce's and `waited_s` besides, left out)
        and, at a check, re-plan (a collective)."""
        p = self.progress
        if self.balance is None or self.sampler is None:
            return
        if self.balance.after_step(p.step, p.epoch, samples, self.blocked_s + waited_s):
            self._record_plan(self.sampler.shares)
            p.replans += 1
            self._load_ahead()

    def _load_ahead(self) -> None:
        """Have the loader workers (`training.loader_workers`) load this member's pieces of
        the epoch's remaining global batches, in the order the steps ask for them, and a shard
        reader read ahead the shards they come from. Planned again at each attach and
        epoch start: a redone step's batches are cut by the new split, and a batch
        off the plan is loaded in this process anyway, so what a step trains on never
        depends on the workers."""
        sampler, p = self.sampler, self.progress
        if sampler is None or self.finished:
            return
        epoch, start, end = p.epoch, p.index, self.batches_per_epoch

        def pieces() -> list[torch.Tensor]:
            return [sampler.block(epoch, index) for index in range(start, end)]

        if self.shards is not None:
            self.shards.read_ahead(pieces())
        if self.loader is not None:
            self.loader.start_epoch(pieces)

    def close(self) -> None:
        """Stop the loader workers, if any (call once, when the run is over for this process)."""
        if self.loader is not None:
            self.loader.close()

    def drop_wrapper(self) -> None:
        """Let go of this generation's DDP module (call before leaving the group: its
        reducer holds the group, whose sockets close only once nothing does)."""
        self.ddp = None

    def detach(self) -> None:
        """This generation's group is gone: a step cut short by it will be redone."""
        self.drop_wrapper()
        self.sampler = None
        if self.balance is not None:
            self.balance.stop()
        self.samples_redone += self._in_flight
        self._in_flight = 0
        start, self._round_start = self._round_start, None
        if start is not None:  # mid-round: back to the round's start, its batches redone
            assert self.rounds is not None
            # the outer state too: an exchange cut short after its outer step (in the
            # buffers' broadcast) has moved it on
            self.rounds.outer.load_state_dict(start["outer"])
            elapsed = self.train_time_s()
            self._load_training(start)
            self.progress.train_time_s = elapsed  # the clock of training goes on
            self._set_clock(elapsed)

    def begin_step(self, samples: int) -> torch.nn.Module:
        """Before a step of `samples` samples (this member's pieces of the step's global
        batches: one, or up to `ddp.grad_accumulation_steps`, the epoch's last step what is
        left): returns the module it trains through, the generation's DDP module (made at
        its first step, a collective), or with local updates the plain one.

        Raises:
            RuntimeError, dist.DistError: a peer was lost making the DDP module.
        """
        assert self.sampler is not None, "attach() first"
        if self.rounds is not None and self._round_start is None:
            # A round's first step: keep what it starts from. The members' models differ
            # within a round, so a member lost mid-round takes its part of the round with
            # it, and every survivor goes back here to redo the round's global batches with
            # the new group (none lost, none applied twice); what a new generation hands a
            # joiner, and what a checkpoint holds, is this state too. The ledger counts a
            # round's global batches once it is averaged.
            self._round_start = {**copy.deepcopy(self._current_state()),
                                 "outer": self.rounds.outer.state_dict()}
        model = self.module if self.rounds is not None else self._wrapped()
        self.samples_trained += samples
        self._in_flight += samples
        return model

    def end_step(self, batches: int, scalars: dict[str, float]) -> None:
        """A step over `batches` global batches was applied (its figures `scalars`): the
        ledger counts them (with local updates, the round's once it is averaged) and the
        run's position moves past them."""
        p = self.progress
        if self.rounds is None or scalars["local/rounds"]:
            first = p.index if self._round_start is None else int(self._round_start["progress"]["index"])
            self._round_start = None  # a round never spans two epochs
            self.blocked_s = scalars["time/comm_blocked_s"]
            self.ledger[p.epoch, first:p.index + batches] += 1
            self._in_flight = 0
        p.index += batches
        p.step += 1
        self._follow(self.sampler)

    def _wrapped(self) -> DistributedDataParallel:
        """This generation's DDP module, made at its first step (a collective: rank 0's
        weights and buffers, the same as every member's once synced, are broadcast).

        Raises:
            RuntimeError, dist.DistError: a peer was lost meanwhile.
        """
        if self.ddp is None:
            self.comm.drain()  # what a step the last group cut short recorded
            self.ddp = wrap_model(self.module, self.config.ddp, torch.device("cpu"), self.comm,
                                  self.compression)
        return self.ddp

    def evaluated(self, result: EvalResult) -> None:
        """The epoch-end evaluation was `result` (taken with the training clock paused):
        recorded; then the next epoch begins."""
        p = self.progress
        p.evaluations.append([self.train_time_s(), result.accuracy, result.loss])
        p.epoch, p.index = p.epoch + 1, 0
        if self.sampler is not None:
            self._follow(self.sampler)
        if self.balance is not None:
            self.balance.restart()  # the evaluation is not training
        self._load_ahead()

    def ledger_totals(self) -> tuple[int, int, int]:
        """(samples applied, samples of global batches never applied, samples applied more
        than once), from the ledger."""
        applied = int(self.ledger.sum()) * self.global_batch
        lost = int((self.ledger == 0).sum()) * self.global_batch
        twice = int((self.ledger - 1).clamp(min=0).sum()) * self.global_batch
        return applied, lost, twice

