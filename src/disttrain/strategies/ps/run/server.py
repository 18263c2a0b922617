"""The `ps-server` process: one shard, built from the run's config and served over gRPC.

`build_state` is where the config meets the shard: it hands each part its own settings
(the aggregation rules their `ps` keys, the decoder the `compression` section, the
optimizer the `training` section, the checkpoints their folder and cadence, the
ownership checks the run's block layout, which `serve` computes, `run_layout`). `serve`
binds `--bind HOST:PORT` (port 0 picks a free one), reports the address it bound on its
log and, under the cluster launcher, as an event line on stdout, and stops on
SIGTERM/SIGINT or on a Shutdown call once every worker is done, writing a final
checkpoint.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable

from torch.nn.utils import parameters_to_vector

from disttrain.config import Config
from disttrain.coordinator.reports import NodeIdentity, NodeProgress, NodeReports
from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.faults import FaultInjector
from disttrain.core.processes import ProgressReport, bind_to_parent, emit_event
from disttrain.strategies.ps.run.launcher import check_supported
from disttrain.strategies.ps.run.layout import run_layout
from disttrain.strategies.ps.run.link import join
from disttrain.strategies.ps.server.aggregation import AggregationRules
from disttrain.strategies.ps.server.broadcast import BroadcastCopy
from disttrain.strategies.ps.server.ledger import BlockLayout
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.server.shard import CheckpointPolicy, ShardCodecs, ShardState, ShardValues
from disttrain.strategies.ps.server.validation import PushDecoder
from disttrain.strategies.ps.wire.payloads import ParameterChanges
from disttrain.strategies.ps.wire.sharding import (
    ShardPlan,
    initial_buffers,
    plan_shards,
    trainable_parameters,
)
from disttrain.training.engine import configure_process
from disttrain.training.models import init_model
from disttrain.training.options import RunOptions

logger = logging.getLogger(__name__)


def build_state(config: Config, shard: int, num_shards: int, resume: bool = False,
                on_checkpoint_failure: Callable[[Exception], None] | None = None,
                layout: BlockLayout | None = None) -> ShardState:
    """The state of shard `shard` of `num_shards`: the model's initial slice (from the
    training seed), restored from this shard's newest checkpoint when resuming.

    Args:
        on_checkpoint_failure: told of a checkpoint write that failed for good.
        layout: the run's block layout, which the ownership checks hold every push to
            (`run_layout`; `serve`, the `ps-server` process of every deployment, always
            passes it). None: only the bounds that hold in any run's layout, for a shard
            built in-process around made-up pushes (tests of other parts).

    Raises:
        ConfigError: the checkpoint dir holds an earlier run (and not resuming).
        CheckpointError: the newest checkpoint cannot be used.
    """
    training, system, ps = config.training, config.system, config.ps
    model = init_model(training)
    plans = plan_shards(model, num_shards)
    plan = plans[shard]
    trainable = parameters_to_vector(p for _, p in trainable_parameters(model))
    flat = trainable[plan.offset:plan.offset + plan.numel]
    folder = object_store.join(system.checkpoint_dir, f"server{shard}")  # a path or a store's URL
    resumed_from = ckpt.prepare_checkpoint_dir(folder, resume)
    rules = AggregationRules(ps.aggregation_mode, system.num_workers, ps.staleness, ps.backup_workers,
                             layout or BlockLayout(system.num_workers, training.num_epochs), ps.ssp_clock)
    # Under a balance plan one worker's batch may be up to the whole global batch; with local
    # updates one push stands for a round's batches.
    max_samples = training.batch_size * (1 if system.balance == "none" else system.num_workers) \
        * (training.sync_every if training.local_update_mode else 1)
    decoder = PushDecoder(plan, config.compression, max_samples)
    checkpoints = CheckpointPolicy(folder, training.checkpoint_interval, system.checkpoint_keep,
                                   config.to_dict(), on_checkpoint_failure)
    values = ShardValues(plan, flat, initial_buffers(model, plan), sum(p.numel for p in plans))
    state = ShardState(values, rules, ShardCodecs(decoder, broadcast_copy(config, plan, flat)), training,
                       checkpoints)
    if resume:  # a restart, or the run resumed (the other shards may be at another step)
        state.restore(resumed_from)
    return state


def broadcast_copy(config: Config, plan: ShardPlan, flat) -> BroadcastCopy | None:
    """Pull compression's broadcast copy of the shard, when the run asks for it (every
    mode: in async and ssp a worker behind is sent the changes it missed)."""
    section = config.compression
    if section.pull == "none":
        return None
    return BroadcastCopy(flat, ParameterChanges(plan, section.pull, section.pull_ratio),
                         section.pull_dense_every)


def serve(config: Config, bind: str, shard: int, num_shards: int, options: RunOptions) -> None:
    """Run one shard until SIGTERM/SIGINT or a Shutdown call; with a coordinator in the
    config, registered with it, heartbeating, and following its membership. With the
    `options`' token, calls without it are refused (but health checks), and it is sent to
    the coordinator. With their TLS files, it listens with TLS and reaches the coordinator
    with the same files. The options' faults fire at the versions they name; with
    `options.resume`, the shard starts from its newest checkpoint.

    Raises:
        ConfigError: the address cannot be bound, the checkpoint dir holds an earlier run, or
            the training set makes no batch per worker (`run_layout`).
        DataError: the training set cannot be read (`run_layout`).
        CheckpointError: the newest checkpoint cannot be used (with `resume`).
        CheckpointStoreError: the checkpoint store failed for good (the shard stops serving).
    """
    check_supported(config)
    bind_to_parent()
    configure_process(config.system.num_threads or 1)
    store_failures: list[Exception] = []

    def store_failed(error: Exception) -> None:  # a write follows a push: `server` serves by then
        store_failures.append(error)
        server.stopped.set()

    faults = FaultInjector(options.faults, "server", shard, options.attempt)
    state = build_state(config, shard, num_shards, options.resume, store_failed, layout=run_layout(config))
    # Long-polls hold a thread each: room for every worker's push, pull and status call.
    server = ShardServer(state, bind, max_threads=max(32, 4 * config.system.num_workers + 8),
                         credentials=options.credentials)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.stopped.set())
    logger.info("shard %d/%d (%d parameters, %.2f MB) listening on %s (%s)", shard, num_shards,
                state.plan.numel, state.plan.nbytes / 1e6, server.address, socket.gethostname())
    logger.info("%s", state.plan.describe())
    progress = ProgressReport()  # each version reached, for the launcher's restart budget
    state.on_version = progress if not faults.faults else lambda version: (progress(version),
                                                                            faults.at_step(version))
    emit_event("listening", address=server.address, shard=shard)
    link = join(config.coordinator, NodeIdentity(f"server{shard}", "server", shard, server.address),
                NodeReports(lambda: NodeProgress(0, state.version, 0)),
                lambda generation, live, away: state.set_membership(generation, live, frozenset(away)),
                credentials=options.credentials)
    try:
        server.stopped.wait()
    finally:
        server.stop()
        if link is not None and store_failures:
            link.close()  # not "finished": its exit, with the store's line, tells the launcher
        elif link is not None:
            link.leave()
        logger.info("shard %d stopped at version %d", shard, state.version)
    if store_failures:
        raise store_failures[0]
