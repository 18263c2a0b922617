"""A parameter-server worker (the `ps-worker` role): register, then run the training loop
with a step that trades gradients for parameters with the servers.

Each step takes the next batch of this worker's shard, computes gradients into the flat
gradient buffer, and exchanges them as the aggregation mode says. At each epoch end all
workers meet at a barrier, evaluate the servers' model on a slice of the test set each,
and add their counts up, with their training clocks stopped. A worker checkpoints its
own position (sampler, RNG, step) under `<checkpoint_dir>/worker<rank>/`; restarted with
`--resume` it goes on from there, and the servers answer the steps they already applied
as duplicates, so each step is applied once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from disttrain.compression import Compressor
from disttrain.config import Config
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import CheckpointError
from disttrain.core.faults import FaultInjector
from disttrain.core.processes import bind_to_parent, emit_event
from disttrain.data import ArrayDataset, load_datasets
from disttrain.metrics.summary import RunSummary
from disttrain.metrics.window import StepTimer
from disttrain.strategies.ps.balance import balance_sampler
from disttrain.strategies.ps.blocks import Sampler, block_id, block_indices, block_length
from disttrain.strategies.ps.client import PSClient, RetryPolicy
from disttrain.strategies.ps.exchange import Block, Exchange, make_exchange
from disttrain.strategies.ps.finalize import finish
from disttrain.strategies.ps.identity import keep_key, worker_key
from disttrain.strategies.ps.link import join
from disttrain.strategies.ps.model import check_supported
from disttrain.strategies.ps.payloads import GradientEncoder
from disttrain.strategies.ps.sharding import flat_parameters, plan_shards
from disttrain.strategies.ps.wire import tune_allocator
from disttrain.training.checkpoints import LocalCheckpoints
from disttrain.training.engine import (
    EvalResult,
    StepResult,
    configure_threads,
    eval_slice,
    evaluate,
    forward_backward,
)
from disttrain.training.loop import LoopSettings, TrainingLoop
from disttrain.training.models import init_model
from disttrain.training.options import RunOptions
from disttrain.training.seeding import seed_training, training_seed
from disttrain.training.strategy import StepInfo

logger = logging.getLogger(__name__)


class EventProgress:
    """Progress told to the launcher as event lines (it shows one display for all)."""

    def __init__(self, rank: int, total: int, done: int):
        self.rank = rank
        emit_event("plan", rank=rank, total_steps=total, done_steps=done)

    def update(self, n: int = 1, **postfix: float) -> None:
        emit_event("progress", rank=self.rank, steps=n, loss=round(postfix.get("loss", 0.0), 4))

    def close(self) -> None:
        """Nothing to close: the launcher's display ends with the run."""


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
    train_set: ArrayDataset
    test_set: ArrayDataset
    eval_batch_size: int
    sampler: Sampler
    batch_size: int
    faults: FaultInjector
    timer: StepTimer = field(default_factory=StepTimer)
    strategy: str = "ps-worker"
    # What heartbeats tell: epoch, step, samples, and seconds of work (waits for peers left
    # out, so in sync mode a straggler shows as one even though everyone's steps are as slow).
    progress: tuple[int, int, int, float] = (0, 0, 0, 0.0)
    _last_exit: float | None = None
    samples_redone: int = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.sampler.num_batches(self.batch_size)

    @property
    def samples_dropped(self) -> int:
        """Samples of the blocks steps went on without (backup workers), by design."""
        return sum(block_length(self.sampler, self.batch_size, b) for b in self.exchange.dropped)

    def start(self) -> None:
        self.client.barrier(self.worker_id, "start")

    def step(self, batches: list[torch.Tensor], info: StepInfo) -> StepResult:
        (indices,) = batches
        block = Block(info.step, self.block_id(info.epoch, info.index_in_epoch), info.epoch, len(indices),
                      last_in_epoch=info.index_in_epoch == self.batches_per_epoch - 1)
        client, exchange = self.client, self.exchange
        sent, received, rejected = client.bytes_sent, client.bytes_received, exchange.num_rejected
        if self.faults.drops_reply(info.step):
            client.lose_next_replies()
        entered = time.perf_counter()
        result, staleness = exchange.step(self._compute(indices), block, self.timer)
        timings = self.timer.drain()
        left = time.perf_counter()
        busy = left - (entered if self._last_exit is None else self._last_exit) \
            - timings.get("time/comm_blocked_s", 0.0)
        self._last_exit = left
        epoch, step, samples, work = self.progress
        self.progress = (info.epoch, info.step, samples + len(indices), work + busy)
        result.scalars = {**timings, "comm/bytes_sent": client.bytes_sent - sent,
                          "comm/bytes_received": client.bytes_received - received,
                          "ps/staleness": staleness, "ps/rejected_pushes": exchange.num_rejected - rejected}
        if exchange.encoder is not None:
            result.scalars.update(exchange.encoder.scalars())
        return result

    def block_id(self, epoch: int, index: int) -> int:
        """The data block of this worker's batch `index` of `epoch`, unique in the run."""
        return block_id(epoch, self.rank, index, self.world_size, self.batches_per_epoch)

    def _compute(self, indices: torch.Tensor) -> Callable[[], StepResult]:
        inputs, targets = self.train_set.batch(indices)

        def compute() -> StepResult:
            self.grads.zero_()
            return forward_backward(self.model, inputs, targets)

        return compute

    def redo_missing(self, last_epoch: int) -> int:
        """Apply this worker's blocks of epochs up to `last_epoch` that a shard lacks (it
        restarted from a checkpoint older than them); returns the samples redone."""
        end = (last_epoch + 1) * self.world_size * self.batches_per_epoch
        applied = self.client.ledger(0, end)
        redone = 0
        for epoch in range(last_epoch + 1):
            for index in range(self.batches_per_epoch):
                block_id = self.block_id(epoch, index)
                missing = [s for s, blocks in enumerate(applied) if block_id not in blocks]
                if not missing or block_id in self.exchange.dropped:
                    continue
                indices = block_indices(self.sampler, self.batch_size, epoch, index)
                logger.warning("block %d (epoch %d, batch %d) is missing on shard(s) %s: redoing it",
                               block_id, epoch, index, missing)
                step = max(1, self.progress[1])  # a redo is named by its block, not its step
                block = Block(step, block_id, epoch, len(indices), redo=True)
                self.exchange.redo(self._compute(indices), block, missing, self.timer)
                redone += len(indices)
        self.samples_redone += redone
        return redone

    def evaluate(self, epoch: int) -> EvalResult:
        """Every worker evaluates the servers' model, as it stands once all have finished
        the epoch, on its slice of the test set; the counts are added up at a barrier."""
        self.redo_missing(epoch)
        self.client.barrier(self.worker_id, f"epoch{epoch}:trained")
        self.exchange.refresh()
        mine = eval_slice(len(self.test_set), self.world_size, self.rank)
        local = evaluate(self.model, self.test_set, self.eval_batch_size, indices=mine)
        rows = self.client.barrier(self.worker_id, f"epoch{epoch}:evaluated",
                                   [local.loss_sum, local.num_correct, local.num_samples])
        loss_sum, correct, samples = (sum(column) for column in zip(*rows, strict=True))
        self._last_exit = None  # the time spent here is not work of the next step
        return EvalResult(loss_sum, int(correct), int(samples))

    def state_dict(self) -> dict[str, Any]:
        encoder = self.exchange.encoder
        return {"worker_id": self.worker_id, "rank": self.rank, "world_size": self.world_size,
                "bytes_sent": self.client.bytes_sent, "bytes_received": self.client.bytes_received,
                "compression": None if encoder is None else encoder.state_dict(),
                "samples_redone": self.samples_redone, "dropped_blocks": sorted(self.exchange.dropped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise CheckpointError(f"the checkpoint is of rank {state['rank']} of {state['world_size']} "
                                  f"workers, and this worker is rank {self.rank} of {self.world_size}; "
                                  "restart it with --rank and the run's config")
        # The run's totals go on from the checkpoint, like its samples and training time.
        self.client.bytes_sent = int(state["bytes_sent"])
        self.client.bytes_received = int(state["bytes_received"])
        self.samples_redone = int(state.get("samples_redone", 0))
        self.exchange.dropped = {int(b) for b in state.get("dropped_blocks", [])}
        encoder, saved = self.exchange.encoder, state.get("compression")
        if (encoder is None) != (saved is None):
            raise CheckpointError("the checkpoint was written with compression "
                                  f"{'off' if saved is None else 'on'} and this run has it "
                                  f"{'off' if encoder is None else 'on'}; resume with the run's config")
        if encoder is not None:
            try:
                encoder.load_state_dict(saved)
            except ValueError as e:
                raise CheckpointError(str(e)) from e


def run_worker(config: Config, servers: list[str], worker_id: str, requested_rank: int,
               options: RunOptions) -> RunSummary | None:
    """Train as one worker of a parameter-server run; rank 0 returns the run summary.

    Raises:
        DistributedError: a server stayed unreachable through every retry, or disagrees
            with this worker's config.
        DataError, CheckpointError, ConfigError: bad data, checkpoint or checkpoint folder.
    """
    training, system = config.training, config.system
    started = time.perf_counter()
    check_supported(config)
    bind_to_parent()
    tune_allocator()
    configure_threads(system.num_threads or 1)
    own = Path(system.checkpoint_dir) / f"worker{requested_rank}" if requested_rank >= 0 else None
    if own is not None:  # refuse an earlier run's folder before taking a rank on the servers
        ckpt.prepare_checkpoint_dir(own, options.resume)
    key = worker_key(own, options.resume)  # the same worker again when resuming
    data = load_datasets(training)
    model = init_model(training)
    flat, grads = flat_parameters(model)
    client = PSClient(servers, plan_shards(model, len(servers)),
                      RetryPolicy(timeout_s=config.ps.rpc_timeout_s), config.ps.payload_transport,
                      token=options.token, tls=options.tls)
    balance: dict = {}  # this worker's batch, speed and plans, for its heartbeats
    progress: list[Callable[[], tuple]] = [lambda: (0, 0, 0, 0.0, balance)]  # until the participant exists
    link = None
    try:
        link = join(config.coordinator, worker_id, "worker", requested_rank, lambda: progress[0](),
                    token=options.token, tls=options.tls)
        assignment = client.register(worker_id, requested_rank, link.generation if link else 0, key)
        rank, world_size = assignment.rank, assignment.world_size
        keep_key(Path(system.checkpoint_dir) / f"worker{rank}", key)
        logger.info("registered as rank %d of %d (%s mode, %d shard(s))", rank, world_size,
                    assignment.aggregation_mode, len(servers))
        seed_training(training.seed, rank)
        shared = client.shared_buffers()
        if shared is not None:  # a compressed push is copied into the gradient segment: keep it apart
            flat, grads = flat_parameters(model, shared[0], None if config.compression.enabled else shared[1])
            logger.info("the model lives in the shard's shared memory: no copy of gradients or "
                        "parameters on this worker")
        encoder = None
        if config.compression.enabled:
            compressor = Compressor.from_config(config.compression, training_seed(training.seed, rank))
            encoder = GradientEncoder(compressor, client.plans)
        exchange = make_exchange(assignment.aggregation_mode, client, worker_id, flat, grads,
                                 assignment.staleness, encoder, link.generation if link else 0,
                                 retry_late=config.ps.backup_workers == 0)
        exchange.start()
        faults = FaultInjector(options.faults, "worker", rank, options.attempt)
        sampler, rebalancer = balance_sampler(config, client, worker_id, world_size, rank, data[0], faults,
                                              balance)
        participant = WorkerParticipant(client, exchange, worker_id, rank, world_size, model, grads,
                                        *data, training.eval_batch_size, sampler, training.batch_size, faults)
        progress[0] = lambda: (*participant.progress, balance)
        checkpoints = LocalCheckpoints(Path(system.checkpoint_dir) / f"worker{rank}", system.checkpoint_keep)
        loop = TrainingLoop(config, LoopSettings.from_config(config), participant, sampler, checkpoints,
                            Path(system.log_dir) / f"worker{rank}", faults,
                            lambda total, done: EventProgress(rank, total, done), announce=rank == 0,
                            rebalancer=rebalancer)
        result = loop.run(options.resume)
        summary = finish(config, client, participant, result, flat, started)
        if link is not None:
            link, leaving = None, link
            leaving.leave()
        return summary
    finally:
        if link is not None:
            link.close()
        client.close()
