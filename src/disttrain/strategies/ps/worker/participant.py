"""One parameter-server worker's part in the training loop: its step trades gradients for
parameters with the servers, its evaluation reads the servers' model.

Each step takes the next batch of this worker's shard, computes gradients into the flat
gradient buffer, and exchanges them as the aggregation mode says. At each epoch end all
workers meet at a barrier, evaluate the servers' model on a slice of the test set each,
and add their counts up, with their training clocks stopped. A block some shard lacks
after a failure is redone (`redo_missing`), so every block is applied exactly once. The
blocks of a worker the run gave up on (reassigned) are taken over by the others at the
epoch's end (`take_over`, see `takeover`), and the evaluation is split among those
present.

With local updates (`rounds`, see `local_rounds`) a step within a round is an inner step
on the worker's own model that touches no network; a round's last step pushes the
round's pseudo-gradient instead of its gradient, and the block of the round's last
batch stands for the round's batches in the ledgers. So a round a shard lacks (or one of
a reassigned worker) is redone whole, by the worker whose share holds its last batch:
its batches trained again as inner steps, aside from the worker's own round, and its
pseudo-gradient pushed as the redo of that block (`WorkerRounds.redo`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from disttrain.coordinator.reports import NodeProgress
from disttrain.core.errors import CheckpointError
from disttrain.core.faults import FaultInjector
from disttrain.data import ArrayDataset
from disttrain.metrics.window import StepTimer
from disttrain.strategies.ps.worker.blocks import Sampler, block_id, block_indices, block_length
from disttrain.strategies.ps.worker.client import PSClient
from disttrain.strategies.ps.worker.exchange import Block, Exchange
from disttrain.strategies.ps.worker.local_rounds import WorkerRounds, round_end, round_start
from disttrain.strategies.ps.worker.takeover import Away, away_ranks, present_slice, share
from disttrain.training.engine import EvalResult, StepResult, eval_slice, evaluate, forward_backward
from disttrain.training.loading import BatchSource
from disttrain.training.precision import Precision
from disttrain.training.strategy import StepInfo

logger = logging.getLogger(__name__)

# What a worker's checkpoint holds besides its rank and traffic: one without them is an
# earlier build's, which no release wrote.
CURRENT_KEYS = ("bytes_received_dense", "samples_redone", "samples_taken_over", "dropped_blocks",
                "last_block", "compression")


@dataclass
class WorkerParticipant:
    """One worker's part in the loop; the model lives on the servers."""

    client: PSClient
    exchange: Exchange
    worker_id: str
    rank: int
    world_size: int
    model: torch.nn.Module
    grads: torch.Tensor  # the flat gradient buffer the model's .grad views point into
    train_set: BatchSource  # the training set, or its batches loaded by worker processes
    test_set: ArrayDataset
    eval_batch_size: int
    sampler: Sampler
    batch_size: int
    faults: FaultInjector
    timer: StepTimer = field(default_factory=StepTimer)
    strategy: str = "ps-worker"
    # What heartbeats tell: epoch, step, samples, and seconds of work (waits for peers left
    # out, so in sync mode a straggler shows as one even though everyone's steps are as slow);
    # replaced whole after each step, for the heartbeat thread to read.
    progress: NodeProgress = field(default_factory=lambda: NodeProgress(0, 0, 0, 0.0))
    _last_exit: float | None = None
    samples_redone: int = 0
    samples_taken_over: int = 0  # of the blocks of workers reassigned
    away: Away = field(default_factory=Away)  # which reassigned workers are back
    precision: Precision | None = None  # bf16 autocast of the forward pass (None: float32)
    rounds: WorkerRounds | None = None  # local updates (None: every step trades its gradient)
    _round_result: StepResult | None = None  # the last inner step's, pushed with its round
    _counted: tuple[int, int] | None = None  # outer_delay: the bytes sent and received counted so far
    # The block of this worker's last push the exchange saw taken (-1: none yet); saved in
    # its checkpoints, so a resume can tell a checkpoint ahead of the shards (`unapplied`).
    last_block: int = -1
    # Where the workers meet before their first step: every start of a worker arrives, a
    # restarted one finding it passed. One per launch (`run.worker`): a run resumed as a
    # whole meets again, or a worker starting early would step alone on the shards.
    start_barrier: str = "start"

    @property
    def batches_per_epoch(self) -> int:
        return self.sampler.num_batches(self.batch_size)

    @property
    def samples_dropped(self) -> int:
        """Samples of the blocks steps went on without (backup workers), by design."""
        return sum(block_length(self.sampler, self.batch_size, b) for b in self.exchange.dropped)

    def start(self) -> None:
        self.client.barrier(self.worker_id, self.start_barrier)

    def step(self, batches: list[torch.Tensor], info: StepInfo) -> StepResult:
        (indices,) = batches
        compute, step, num_samples = self._compute(indices), info.step, len(indices)
        client, exchange = self.client, self.exchange
        client.finished_epochs(info.epoch)  # the epochs before this one (a resumed worker's too)
        sent, received, rejected = client.bytes_sent, client.bytes_received, exchange.num_rejected
        if self._counted is not None:  # from the last step's end: a delayed push runs between steps
            sent, received = self._counted
        entered = time.perf_counter()
        if self.rounds is not None:
            local = self._inner_step(compute, len(indices), info)
            if local is not None:  # within a round: nothing crosses the network (but a delayed push)
                return self._delayed_bytes(self._stepped(local, info, len(indices), entered), sent, received)
            compute, step, num_samples = self._round_push(), self.rounds.round_number, self.rounds.samples
            shards, shard_steps = None, None
            shard_samples = tuple(self.rounds.shard_samples())
            if len(self.rounds.groups) > 1:  # Streaming DiLoCo: the due fragments' shards alone
                shards, shard_steps = self.rounds.due_shards, tuple(self.rounds.shard_steps())
        else:
            shards, shard_steps, shard_samples = None, None, None
        block = Block(step, self.block_id(info.epoch, info.index_in_epoch), info.epoch, num_samples,
                      last_in_epoch=info.index_in_epoch == self.batches_per_epoch - 1,
                      shard_steps=shard_steps, shard_samples=shard_samples)
        if self.faults.drops_reply(info.step):
            client.lose_next_replies()
        if self.rounds is not None and self.rounds.delays:  # training.outer_delay: lands later
            self._send(compute, block, shards)
            return self._delayed_bytes(self._stepped(self._round_result, info, len(indices), entered), sent,
                                       received)
        result, staleness = exchange.step(compute, block, self.timer, shards)
        self.last_block = block.block_id
        if self.rounds is not None:
            self.rounds.close()
        result = self._stepped(result, info, len(indices), entered)
        result.scalars.update({**self._bytes_since(sent, received), "ps/staleness": staleness,
                               "ps/rejected_pushes": exchange.num_rejected - rejected, **exchange.scalars()})
        if exchange.learning_rate is not None and self.rounds is None:
            result.scalars["optim/learning_rate"] = exchange.learning_rate
        if exchange.encoder is not None:
            result.scalars.update(exchange.encoder.scalars())
        return result

    def _delayed_bytes(self, result: StepResult, sent: int, received: int) -> StepResult:
        """With `training.outer_delay`, give a step without a push of its own the bytes the
        delayed pushes moved since the last step's end (each epoch's last step lands them all)."""
        if self.rounds is not None and self.rounds.settings.delay:
            result.scalars.update(self._bytes_since(sent, received))
        return result

    def _bytes_since(self, sent: int, received: int) -> dict[str, float]:
        """The bytes sent and received since the counts `sent` and `received`; with
        `training.outer_delay` the counts of now are kept for the next step to count from."""
        now = self.client.bytes_sent, self.client.bytes_received
        if self.rounds is not None and self.rounds.settings.delay:
            self._counted = now
        return {"comm/bytes_sent": now[0] - sent, "comm/bytes_received": now[1] - received}

    def _stepped(self, result: StepResult, info: StepInfo, num_samples: int, entered: float) -> StepResult:
        """Account a step that took `num_samples` (its work time, the heartbeats'
        progress) and give `result` the step's timings."""
        timings = {"time/comm_blocked_s": 0.0, "time/comm_overlapped_s": 0.0, **self.timer.drain()}
        left = time.perf_counter()
        busy = left - (entered if self._last_exit is None else self._last_exit) \
            - timings.get("time/comm_blocked_s", 0.0)
        self._last_exit = left
        progress = self.progress
        self.progress = NodeProgress(info.epoch, info.step, progress.samples + num_samples,
                                     (progress.work_s or 0.0) + busy)
        result.scalars = timings if self.rounds is None else \
            {**timings, **self.rounds.scalars()}
        return result

    def _inner_step(self, compute: Callable[[], StepResult], num_samples: int, info: StepInfo
                    ) -> StepResult | None:
        """One local step: compute the gradient and apply it with the inner optimizer.
        Returns its result, or None when it ended the round (then push it: `_round_push`)."""
        rounds, buffers = self.rounds, self.exchange.buffers
        if rounds.opening:
            rounds.open()
            if buffers is not None:  # the servers' buffers; the round's change goes with its push
                buffers.adopt()
                buffers.begin()
        result = compute()
        due = rounds.inner_step(num_samples, info.ends_epoch)
        if rounds.outer.in_flight:  # training.outer_delay: the pushes due now land
            with self.timer.phase("comm_blocked"):
                overlapped = rounds.land()
            self.timer.add("comm_overlapped", overlapped)
        if not due:
            return result
        if buffers is not None:
            buffers.finish()
        self._round_result = result
        return None

    def _round_push(self) -> Callable[[], StepResult]:
        """What the exchange sends at a round's end: the round's pseudo-gradient (again
        as it was, should a shard want it once more), with the last step's result."""
        delta, result = self.rounds.pseudo_gradient(), self._round_result

        def push() -> StepResult:
            self.exchange.grads.copy_(delta)  # a delayed push's own buffer while it runs
            return result

        return push

    def _send(self, compute: Callable[[], StepResult], block: Block, shards: list[int] | None) -> None:
        """Start a round's push that lands `training.outer_delay` steps later (see `local_rounds`)."""
        timer = StepTimer()  # the push thread's: the step's timer is the training thread's

        def trade() -> None:
            self.exchange.step(compute, block, timer, shards)
            self.last_block = block.block_id  # read once the push landed, or a checkpoint waited for it

        self.rounds.send(self.exchange, trade)

    def block_id(self, epoch: int, index: int) -> int:
        """The data block of this worker's batch `index` of `epoch`, unique in the run."""
        return block_id(epoch, self.rank, index, self.world_size, self.batches_per_epoch)

    def _compute(self, indices: torch.Tensor) -> Callable[[], StepResult]:
        inputs, targets = self.train_set.batch(indices)

        buffers = self.exchange.buffers if self.rounds is None else None  # a round handles its own

        def compute() -> StepResult:
            self.grads.zero_()
            if buffers is None:
                return forward_backward(self.model, inputs, targets, precision=self.precision)
            buffers.adopt()  # those of the parameters this gradient is computed on
            buffers.begin()
            result = forward_backward(self.model, inputs, targets, precision=self.precision)
            buffers.finish()
            return result

        return compute

    def redo_missing(self, last_epoch: int) -> int:
        """Apply this worker's blocks of epochs up to `last_epoch` that a shard lacks (it
        restarted from a checkpoint older than them), with local updates their rounds;
        returns the samples redone."""
        end = (last_epoch + 1) * self.world_size * self.batches_per_epoch
        applied = self.client.ledger(0, end)
        redone = 0
        for epoch in range(last_epoch + 1):
            for index in range(self.batches_per_epoch):
                block_id = self.block_id(epoch, index)
                # (a batch within a round is redone with the round, at its last batch)
                missing = [s for s, blocks in enumerate(applied)
                           if block_id not in blocks and self.ledger_block(block_id, s) == block_id]
                if not missing or block_id in self.exchange.dropped:
                    continue
                for shards in self._by_fragment(missing):
                    logger.warning("%s %d (epoch %d, batch %d) is missing on shard(s) %s: redoing it",
                                   "block" if self.rounds is None else "round of block", block_id, epoch,
                                   index, shards)
                    compute, num_samples = self._redo_compute(epoch, index, shard=shards[0])
                    block = self._redo_block(block_id, epoch, num_samples, shards[0])
                    self.exchange.redo(compute, block, shards, self.timer)
                    redone += num_samples
        self.samples_redone += redone
        return redone

    def take_over(self, last_epoch: int, away: list[int]) -> int:
        """Apply this worker's share of the blocks of the `away` ranks (reassigned) of
        epochs up to `last_epoch` that a shard lacks, but those whose owner is back
        (see `takeover`); returns the samples taken over."""
        mine = share(self.rank, away, self.world_size, self.batches_per_epoch)
        if not mine:
            return 0
        applied = self.client.ledger(0, (last_epoch + 1) * self.world_size * self.batches_per_epoch)
        taken = 0
        for epoch in range(last_epoch + 1):
            for owner, index in mine:
                number = block_id(epoch, owner, index, self.world_size, self.batches_per_epoch)
                # (a batch within a round: whoever's share holds its last batch takes it)
                missing = [s for s, blocks in enumerate(applied)
                           if number not in blocks and self.ledger_block(number, s) == number]
                if not missing:
                    continue
                if self.away.is_back(owner):
                    logger.info("worker %d is back: block %d (epoch %d, batch %d) is left to it", owner,
                                number, epoch, index)
                    continue
                for shards in self._by_fragment(missing):
                    logger.warning("taking over %s %d (epoch %d, batch %d) of reassigned worker %d",
                                   "block" if self.rounds is None else "the round of block", number, epoch,
                                   index, owner)
                    compute, num_samples = self._redo_compute(epoch, index, rank=owner, shard=shards[0])
                    block = self._redo_block(number, epoch, num_samples, shards[0])
                    self.exchange.redo(compute, block, shards, self.timer)
                    taken += num_samples
        self.samples_taken_over += taken
        return taken

    def _by_fragment(self, shards: list[int]) -> list[list[int]]:
        """`shards` grouped by the fragment they hold (Streaming DiLoCo; one group otherwise)."""
        if self.rounds is None:
            return [shards]
        groups: dict[int, list[int]] = {}
        for shard in shards:
            groups.setdefault(self.rounds.fragment_of[shard], []).append(shard)
        return [groups[f] for f in sorted(groups)]

    def _redo_compute(self, epoch: int, index: int, rank: int | None = None, shard: int = 0
                      ) -> tuple[Callable[[], StepResult], int]:
        """What a redo of batch `index` of `epoch` of worker `rank` (default: this one)
        computes into `grads`, and the samples it stands for: the batch's gradient; with
        local updates, the round that batch ends (of `shard`'s fragment), trained again
        from the parameters of the moment, as its pseudo-gradient (see `local_rounds`)."""
        rounds = self.rounds
        if rounds is None:
            indices = block_indices(self.sampler, self.batch_size, epoch, index, rank=rank)
            return self._compute(indices), len(indices)
        # Redos come at an epoch's end, where every round has ended: nothing of the
        # worker's own round is held apart from the servers' parameters that a redo pulls.
        assert rounds.opening, "a round is redone between rounds only"
        first = round_start(index, rounds.settings.sync_every, rounds.offset_of(shard))
        batches = [block_indices(self.sampler, self.batch_size, epoch, i, rank=rank)
                   for i in range(first, index + 1)]
        steps = [self._compute(indices) for indices in batches]
        buffers = self.exchange.buffers

        def redo() -> StepResult:
            if buffers is not None:  # the servers' buffers, kept as the parameters pulled are
                buffers.adopt()
            with rounds.aside():
                if buffers is not None:  # the round's change to them goes with its push
                    buffers.begin()
                result = rounds.redo(steps)
                if buffers is not None:
                    buffers.finish()
            return result

        return redo, sum(len(indices) for indices in batches)

    def _redo_block(self, number: int, epoch: int, num_samples: int, shard: int = 0) -> Block:
        """The block of a redo: named by its block, with a step no later than this worker's
        last push, whose step a shard keeps as the worker's last (a later push numbered at
        or below it is answered DUPLICATE): its step, or with local updates its last push's
        to `shard` (the same on every shard of its fragment)."""
        step = self.progress.step if self.rounds is None else self.rounds.last_push(shard)
        return Block(max(1, step), number, epoch, num_samples, redo=True)

    def ledger_block(self, block: int, shard: int = 0) -> int:
        """The block the ledger of `shard` records for `block` (any worker's): itself, or
        with local updates the last block of its round (of the shard's fragment)."""
        if self.rounds is None:
            return block
        bpe = self.batches_per_epoch
        return block - block % bpe + round_end(block % bpe, bpe, self.rounds.settings.sync_every,
                                               self.rounds.offset_of(shard))

    def evaluate(self, epoch: int) -> EvalResult:
        """Every worker evaluates the servers' model, as it stands once all have finished
        the epoch, on its slice of the test set; the counts are added up at a barrier."""
        self.client.finished_epochs(epoch + 1)
        self.redo_missing(epoch)
        away = self._meet_at_epoch_end(epoch)
        self.exchange.refresh()
        self.adopt_buffers()
        place = present_slice(self.rank, away, self.world_size)
        mine = torch.arange(0) if place is None else eval_slice(len(self.test_set), place[1], place[0])
        local = evaluate(self.model, self.test_set, self.eval_batch_size, indices=mine)
        rows = self.client.barrier(self.worker_id, f"epoch{epoch}:evaluated", local.sums())
        rows = [row for rank, row in enumerate(rows) if rank not in away_ranks(rows)]
        self._last_exit = None  # the time spent here is not work of the next step
        return EvalResult.from_sums([sum(column) for column in zip(*rows, strict=True)])

    def _meet_at_epoch_end(self, epoch: int) -> list[int]:
        """Meet the others once the epoch is trained; while the answer names workers away
        (reassigned) that no round here took over yet, take over their blocks and meet
        again (one may have been reassigned meanwhile). Returns the ranks away at the last
        meeting: every worker gets the same answer, and splits the evaluation by it."""
        # Every worker arrives with a value, so a reassigned one's row reads NaN (away).
        away = away_ranks(self.client.barrier(self.worker_id, f"epoch{epoch}:trained", [1.0]))
        handled: set[int] = set()
        while set(away) - handled:
            self.take_over(epoch, away)
            name = f"epoch{epoch}:taken-over{len(handled)}"
            handled |= set(away)
            away = away_ranks(self.client.barrier(self.worker_id, name, [1.0]))
            # Each redo moved the shards on: hold where the others' left them (a sync step
            # then starts from the version every worker holds).
            self.exchange.pull_current(list(range(self.exchange.num_shards)))
        return away

    def adopt_buffers(self) -> None:
        """Give the model the servers' buffers of the parameters it holds (before an
        evaluation, or saving the final model)."""
        if self.exchange.buffers is not None:
            self.exchange.buffers.adopt()

    def unapplied(self, state: dict[str, Any]) -> str | None:
        """Why this worker must not resume from the checkpoint `state`, or None: its last
        push before that checkpoint is missing on some shard, which came back from a
        checkpoint older than it (a run resumed after its store failed, or a shard and
        this worker restarted together). Going on from there would leave every block of
        this worker between the two missing until the epoch's end, while the other
        workers, resumed from older checkpoints, are still in an epoch this worker has
        left: they wait at its end for this worker, and a synchronous step of this
        worker waits for them. An older checkpoint whose blocks every shard holds
        resumes in step with them; the blocks after it are pushed again, as new where a
        shard lacks them and as duplicates where it has them.
        """
        if "last_block" not in state:  # not this build's worker checkpoint: `load_state_dict` says so
            return None
        block = int(state["last_block"])
        if block < 0 or block in {int(b) for b in state["dropped_blocks"]}:
            return None
        missing = [s for s, blocks in enumerate(self.client.ledger(block, block + 1))
                   if block not in blocks and self.ledger_block(block, s) == block]  # the shards it went to
        if not missing:
            return None
        return (f"its last push (block {block}) is missing on shard(s) {missing}, which came back from an "
                "older checkpoint")

    def state_dict(self) -> dict[str, Any]:
        # First: it waits for a delayed push in flight, which moves the figures below.
        local = {} if self.rounds is None else {"local": self.rounds.state_dict()}
        encoder = self.exchange.encoder
        return {"worker_id": self.worker_id, "rank": self.rank, "world_size": self.world_size,
                "bytes_sent": self.client.bytes_sent, "bytes_received": self.client.bytes_received,
                "bytes_received_dense": self.client.bytes_received_dense,
                "compression": None if encoder is None else encoder.state_dict(),
                "samples_redone": self.samples_redone, "samples_taken_over": self.samples_taken_over,
                "dropped_blocks": sorted(self.exchange.dropped), "last_block": self.last_block,
                **local}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise CheckpointError(f"the checkpoint is of rank {state['rank']} of {state['world_size']} "
                                  f"workers, and this worker is rank {self.rank} of {self.world_size}; "
                                  "restart it with --rank and the run's config")
        lacking = [key for key in CURRENT_KEYS if key not in state]
        if lacking:  # a ValueError: the loop names the checkpoint's file in its line
            raise ValueError(f"it lacks {', '.join(lacking)} (a checkpoint of an earlier disttrain); "
                                  "start a fresh run in another --checkpoint-dir")
        # The run's totals go on from the checkpoint, like its samples and training time.
        self.client.bytes_sent = int(state["bytes_sent"])
        self.client.bytes_received = int(state["bytes_received"])
        self.client.bytes_received_dense = int(state["bytes_received_dense"])
        self.samples_redone = int(state["samples_redone"])
        self.samples_taken_over = int(state["samples_taken_over"])
        self.exchange.dropped = {int(b) for b in state["dropped_blocks"]}
        self.last_block = int(state["last_block"])
        encoder, saved = self.exchange.encoder, state["compression"]
        if (encoder is None) != (saved is None):
            raise CheckpointError("the checkpoint was written with compression "
                                  f"{'off' if saved is None else 'on'} and this run has it "
                                  f"{'off' if encoder is None else 'on'}; resume with the run's config")
        if encoder is not None:
            try:
                encoder.load_state_dict(saved)
            except ValueError as e:
                raise CheckpointError(str(e)) from e
        if (self.rounds is None) != ("local" not in state):
            raise CheckpointError("the checkpoint was written with local updates "
                                  f"{'on' if 'local' in state else 'off'} and this run has them "
                                  f"{'off' if self.rounds is None else 'on'} (training.sync_every); "
                                  "resume with the run's config")
        if self.rounds is not None:
            try:
                self.rounds.load_state_dict(state["local"])
            except ValueError as e:
                raise CheckpointError(f"the checkpoint's local-update state does not fit: {e}") from e
