"""The `ps-worker` process: register with every shard (and the coordinator), then run the
training loop as one worker, and end the run on rank 0.

A worker checkpoints its own position (sampler, RNG, step) under
`<checkpoint_dir>/worker<rank>/`; restarted with `--resume` it goes on from there, and
the servers answer the steps they already applied as duplicates, so each step is applied
once. Its key (see `server.members`) is kept in that folder too, so a restart presents
it again and takes its worker id back. `checkpoint_dir` may be a store's URL
(`s3://bucket/run`; see `core.object_store`): the folder is then a key prefix there.
SIGTERM stops it, with the other workers, at a step they agree on, with its checkpoint of
that step (`worker.preemption`); exit code 143.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from disttrain.compression import Compressor
from disttrain.config import Config
from disttrain.coordinator.reports import LatestMetrics, NodeIdentity, NodeProgress, NodeReports
from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.faults import FaultInjector
from disttrain.core.processes import bind_to_parent, sigterm_handled_by
from disttrain.data import ArrayDataset, PlannedSampler, ShardedSampler, load_datasets
from disttrain.metrics.summary import RunSummary
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.finalize import finish
from disttrain.strategies.ps.run.launcher import check_supported, worker_precision
from disttrain.strategies.ps.run.link import join
from disttrain.strategies.ps.run.progress import EventProgress
from disttrain.strategies.ps.run.spares import SpareWait
from disttrain.strategies.ps.server.members import MIN_KEY_BYTES
from disttrain.strategies.ps.wire.payloads import GradientEncoder
from disttrain.strategies.ps.wire.sharding import flat_parameters, plan_shards
from disttrain.strategies.ps.worker.buffers import WorkerBuffers
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.strategies.ps.worker.exchange import ExchangeRules, SyncOptions, WorkerTensors, make_exchange
from disttrain.strategies.ps.worker.local_rounds import WorkerRounds, shard_groups
from disttrain.strategies.ps.worker.participant import WorkerParticipant
from disttrain.strategies.ps.worker.preemption import PreemptionAgreement
from disttrain.strategies.ps.worker.takeover import Away
from disttrain.training.balance import warmup_speed
from disttrain.training.checkpoints import LocalCheckpoints
from disttrain.training.engine import configure_process
from disttrain.training.loading import prefetch
from disttrain.training.local_updates import LocalUpdates
from disttrain.training.loop import LoopSettings, TrainingLoop
from disttrain.training.models import init_model
from disttrain.training.options import RunOptions
from disttrain.training.precision import Precision
from disttrain.training.rebalance import BalancePeers, Rebalancer, start_balance
from disttrain.training.seeding import seed_training, training_seed

logger = logging.getLogger(__name__)

KEY_FILE = "worker.key"


def worker_key(folder: str | Path | None, resume: bool) -> bytes:
    """A worker's key: the one kept in its checkpoint `folder` (a path or a store's URL)
    when resuming, else a new random one (kept there, private, when `folder` is known: see
    `keep_key`)."""
    if resume and folder is not None:
        try:
            key = object_store.read_bytes(object_store.join(folder, KEY_FILE))
        except OSError:
            key = b""
        if len(key) >= MIN_KEY_BYTES:
            return key
    return secrets.token_bytes(32)


def keep_key(folder: str | Path, key: bytes) -> None:
    """Keep `key` in `folder`, for a restart with --resume: a local file readable by its
    owner only; on a store, an object the bucket's policy guards."""
    object_store.write_bytes(object_store.join(folder, KEY_FILE), key, mode=0o600)



def run_worker(config: Config, servers: list[str], worker_id: str, requested_rank: int,
               options: RunOptions, handoff: Path | None = None) -> RunSummary | None:
    """Train as one worker of a parameter-server run; rank 0 returns the run summary.

    With `handoff`, a hot spare (`run.spares`): start up (data, model), then wait until
    the launcher names there the lost worker to become, and resume as that worker.

    Raises:
        DistributedError: a server stayed unreachable through every retry, or disagrees
            with this worker's config.
        DataError, CheckpointError, ConfigError: bad data, checkpoint or checkpoint folder.
    """
    training, system = config.training, config.system
    started = time.perf_counter()
    check_supported(config)
    bind_to_parent()
    configure_process(system.num_threads or 1)
    data = model = None
    if handoff is not None:
        spare = SpareWait(handoff)  # first: a hand-off sent during the start-up waits for it
        data, model = load_datasets(training), init_model(training)
        identity = spare.identity()
        worker_id, requested_rank = identity.worker_id, identity.rank
        options = replace(options, token=identity.token or options.token, attempt=identity.attempt,
                          resume=True)
    own = object_store.join(system.checkpoint_dir, f"worker{requested_rank}") if requested_rank >= 0 else None
    if own is not None:  # refuse an earlier run's folder before taking a rank on the servers
        ckpt.prepare_checkpoint_dir(own, options.resume)
    key = worker_key(own, options.resume)  # the same worker again when resuming
    if data is None or model is None:
        data, model = load_datasets(training), init_model(training)
    flat, grads = flat_parameters(model)
    client = PSClient(servers, plan_shards(model, len(servers)),
                      RetryPolicy(timeout_s=config.ps.rpc_timeout_s), config.ps.payload_transport,
                      options.credentials)
    participant: WorkerParticipant | None = None  # these two are built below; heartbeats start now
    rebalancer: Rebalancer | None = None
    metrics = LatestMetrics()

    def progress() -> NodeProgress:
        if participant is None:
            return NodeProgress(0, 0, 0, 0.0)
        return replace(participant.progress, balance=None if rebalancer is None else rebalancer.balance)

    link = None
    away = Away()  # which reassigned workers are back, from the coordinator's membership
    try:
        link = join(config.coordinator, NodeIdentity(worker_id, "worker", requested_rank),
                    NodeReports(progress, metrics.latest), on_membership=away.update,
                    credentials=options.credentials)
        if link is not None and link.run_finished:
            # Restarted after the others ended (taken over while away, say): no shard is
            # left to take a push, and waiting for one would only hold the run's end up.
            logger.info("the run finished while %s was away (every shard is done): nothing left to do",
                        worker_id)
            link.leave()
            link = None
            return None
        assignment = client.register(worker_id, requested_rank, link.generation if link else 0, key)
        rank, world_size = assignment.rank, assignment.world_size
        keep_key(object_store.join(system.checkpoint_dir, f"worker{rank}"), key)
        logger.info("registered as rank %d of %d (%s mode, %d shard(s))", rank, world_size,
                    assignment.aggregation_mode, len(servers))
        seed_training(training.seed, rank)
        local_updates = LocalUpdates.of(training)
        # With local updates the model is the worker's own within a round: never the shard's memory.
        shared = client.shared_buffers() if local_updates is None else None
        if shared is not None:  # a compressed push is copied into the gradient segment: keep it apart
            flat, grads = flat_parameters(model, shared[0], None if config.compression.enabled else shared[1])
            logger.info("the model lives in the shard's shared memory: no copy of gradients or "
                        "parameters on this worker")
        if config.compression.pull != "none":
            client.compress_pulls(config.compression.pull, config.compression.pull_ratio)
        encoder = None
        if config.compression.enabled:
            compressor = Compressor.from_config(config.compression, training_seed(training.seed, rank),
                                                world_size)
            encoder = GradientEncoder(compressor, client.plans)
        buffers = WorkerBuffers(model, client.plans, client.shards)
        groups = None  # Streaming DiLoCo: one step per fragment, each of a group of shards
        if local_updates is not None and local_updates.num_fragments > 1:
            groups = shard_groups([plan.numel for plan in client.plans], local_updates.num_fragments)
        exchange = make_exchange(
            client, worker_id, WorkerTensors(flat, grads, buffers if buffers.any else None),
            ExchangeRules(assignment.aggregation_mode, assignment.staleness, link.generation if link else 0,
                          retry_late=config.ps.backup_workers == 0),
            encoder,
            SyncOptions(overlap=model if config.ps.overlap and local_updates is None else None,
                        overlap_trial_steps=config.ps.overlap_trial_steps, groups=groups))
        exchange.start()
        faults = FaultInjector(options.faults, "worker", rank, options.attempt)
        sampler, rebalancer = balance_sampler(config, client, worker_id, assignment, data[0], faults)
        loader = prefetch(data[0], training.loader_workers)
        participant = WorkerParticipant(client, exchange, worker_id, rank, world_size, model, grads,
                                        loader or data[0], data[1], training.eval_batch_size, sampler,
                                        training.batch_size, faults,
                                        precision=Precision(worker_precision(training.precision)), away=away,
                                        rounds=None if local_updates is None
                                        else WorkerRounds(local_updates, model, flat, grads, training,
                                                          [plan.numel for plan in client.plans]),
                                        start_barrier=start_barrier(config))
        if local_updates is not None and rank == 0:
            logger.info("%s", local_updates.describe())
        checkpoints = LocalCheckpoints(object_store.join(system.checkpoint_dir, f"worker{rank}"),
                                       system.checkpoint_keep, fits=participant.unapplied)
        loop = TrainingLoop(LoopSettings.of(training, config.to_dict()), participant, sampler, checkpoints,
                            Path(system.log_dir) / f"worker{rank}", faults,
                            lambda total, done: EventProgress(rank, total, done), announce=rank == 0,
                            rebalancer=rebalancer, on_metrics=metrics.publish, loader=loader,
                            stop_requested=preemption_agreement(config, client, worker_id,
                                                                lambda: loop.position.step))
        agreement = loop.stop_requested
        with sigterm_handled_by(None if agreement is None else agreement.handle):
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


def start_barrier(config: Config) -> str:
    """The barrier the workers of one launch meet at before their first step, named by the
    launch's coordinator (a launcher's own listens on a port of its own): a run resumed as
    a whole meets again, where a name kept from the earlier launch would let the first
    worker to start step alone on the shards (the others not yet live there), unlike the
    uninterrupted run. Without a coordinator the one name of every launch, kept as before
    (as it is under a coordinator the user runs at one address)."""
    address = config.coordinator.address
    return "start" if not address else f"start@{address}"


def preemption_agreement(config: Config, client: PSClient, worker_id: str, current_step: Callable[[], int]
                         ) -> PreemptionAgreement:
    """How a worker stops on SIGTERM: at a step every worker agrees on, at a barrier on
    shard 0 named by its incarnation as the worker knows it when the signal comes (one per
    start of the shard: a resumed run's shard keeps the barriers of earlier launches)."""
    def agree(step: int) -> list[list[float]]:
        return client.barrier(worker_id, f"preempt@{client.shards[0].incarnation}", [float(step)])

    return PreemptionAgreement(agree, current_step, config.system.preemption_grace_s)


def balance_sampler(config: Config, client: PSClient, worker_id: str, assignment: pb.WorkerAssignment,
                    train_set: ArrayDataset, faults: FaultInjector,
                    ) -> tuple[ShardedSampler | PlannedSampler, Rebalancer | None]:
    """This worker's sampler, and what re-plans it and holds its balance state (every
    worker calls it, with the assignment its registration gave it: its rank of how many).

    The workers' balance plan (`system.balance`): each worker's speed, measured before
    training on a copy of the model and every `system.balance_interval` steps after, is
    shared at a barrier on shard 0, whose answers the servers keep, so a restarted worker
    that passes the same step again gets the same plan. A check is given up, for every
    worker, when one is behind: a restarted worker redoing steps needs the others' steps
    to catch up, and an asynchronous one further back would hold the others.
    """

    def gather(name: str, speed: float, step: int) -> list[float] | None:
        rows = client.barrier(worker_id, name, [speed], step)  # a check gives up for a worker behind
        return [row[0] for row in rows] if rows else None

    training, rank = config.training, assignment.rank
    peers = BalancePeers(assignment.world_size, rank, gather)
    return start_balance(config.system, training, len(train_set), peers,
                         lambda: warmup_speed(training, torch.device("cpu"), train_set, faults),
                         announce="worker" if rank == 0 else None)
