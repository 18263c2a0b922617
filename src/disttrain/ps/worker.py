"""`disttrain ps-worker`: register, pull, train on this worker's shard of the data, push.

The loop reads top to bottom: take the next batch of this worker's sampler shard, compute
gradients into the flat gradient buffer, exchange with the servers as the aggregation
mode says, log. In sync mode the push and the long-poll for the next version go out
together; in async and ssp modes the next parameters are prefetched while computing.
Rank 0 also evaluates the servers' model at each epoch end and, when every worker is
done, writes the final model and the run summary and shuts the servers down.

    disttrain ps-worker --servers hostA:50051,hostA:50052 --config ps.yaml
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from disttrain.config import Config
from disttrain.data import ShardedSampler, load_datasets
from disttrain.engine import configure_threads, evaluate, forward_backward, seed_everything
from disttrain.errors import ConfigError, DataError
from disttrain.faults import Fault, FaultInjector
from disttrain.launch import bind_to_parent, emit_event
from disttrain.metrics import MetricsLogger, RunSummary, StepTimer, TrainWindow
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.ps.client import PSClient, RetryPolicy
from disttrain.ps.exchange import make_exchange
from disttrain.ps.finalize import finalize_run
from disttrain.ps.model import INPUT_SHAPES, build_initial_model, check_supported
from disttrain.ps.server import parse_address
from disttrain.ps.sharding import flat_parameters, plan_shards
from disttrain.ps.wire import tune_allocator

logger = logging.getLogger(__name__)


@dataclass
class Tally(TrainWindow):
    """A metrics window that also sums each step's staleness."""

    staleness: int = 0

    def add_step(self, result, staleness: int) -> None:
        self.add(result.loss, result.num_correct, result.num_samples)
        self.staleness += staleness


def run_worker(config: Config, servers: list[str], worker_id: str, requested_rank: int = -1,
               summary_json: str | None = None, faults: list[Fault] | tuple[Fault, ...] = ()
               ) -> RunSummary | None:
    """Train as one worker of a parameter-server run; rank 0 returns the run summary.

    Raises:
        DistributedError: a server stayed unreachable through every retry, or disagrees
            with this worker's config.
        DataError: the data set is missing or does not fit the model.
    """
    training, system = config.training, config.system
    started = time.perf_counter()
    check_supported(config)
    configure_threads(system.num_threads or 1)
    train_set, test_set = load_datasets(training)
    if train_set.input_shape != INPUT_SHAPES[training.dataset]:
        raise DataError(f"{training.dataset} images are {train_set.input_shape}, expected "
                        f"{INPUT_SHAPES[training.dataset]}")
    model = build_initial_model(config)
    flat, grads = flat_parameters(model)
    plans = plan_shards(model, len(servers))
    policy = RetryPolicy(timeout_s=system.rpc_timeout_s)
    client = PSClient(servers, plans, policy, system.payload_transport)
    try:
        assignment = client.register(worker_id, requested_rank)
        rank, world_size = assignment.rank, assignment.world_size
        logger.info("registered as rank %d of %d (%s mode, %d shard(s))", rank, world_size,
                    assignment.aggregation_mode, len(servers))
        seed_everything(training.seed + 1 + rank)  # dropout masks differ between workers
        sampler = ShardedSampler(len(train_set), world_size=world_size, rank=rank, seed=training.seed)
        batches_per_epoch = sampler.num_batches(training.batch_size)
        emit_event("plan", rank=rank, total_steps=batches_per_epoch * training.num_epochs)
        metrics = MetricsLogger(Path(system.log_dir) / f"worker{rank}")
        exchange = make_exchange(assignment.aggregation_mode, client, worker_id, flat, grads,
                                 assignment.staleness)
        exchange.start()
        faults_here = FaultInjector(faults, rank)
        timer, tally = StepTimer(), Tally()
        totals = Tally()
        step = 0
        for epoch in range(training.num_epochs):
            sampler.set_epoch(epoch)
            for batch_index, indices in enumerate(sampler.batches(training.batch_size)):
                step += 1
                inputs, targets = train_set.batch(indices)
                block_id = (epoch * world_size + rank) * batches_per_epoch + batch_index
                compute = functools.partial(_compute, model, grads, inputs, targets, timer)
                result, staleness = exchange.step(compute, step, block_id, len(indices), timer)
                tally.add_step(result, staleness)
                totals.add_step(result, staleness)
                emit_event("progress", rank=rank, step=step, loss=round(result.loss, 4))
                if step % training.log_interval == 0:
                    _log(metrics, step, epoch, tally, timer, client, totals.num_samples,
                         exchange.num_rejected)
                    tally = Tally()
                faults_here.at_step(step)
            if rank == 0:
                _evaluate_epoch(exchange, model, test_set, training.eval_batch_size, metrics, step, epoch)
        if tally.num_steps:
            _log(metrics, step, training.num_epochs - 1, tally, timer, client, totals.num_samples,
                 exchange.num_rejected)
        train_time_s = time.perf_counter() - totals.started
        client.call_all("WorkerDone", pb.WorkerDoneRequest(worker_id=worker_id))
        logger.info("worker %d done: %d steps, %d samples in %.1fs, %.1f MB sent, %.1f MB received",
                    rank, step, totals.num_samples, train_time_s, client.bytes_sent / 1e6,
                    client.bytes_received / 1e6)
        worker_stats = {"rank": rank, "steps": step, "samples": totals.num_samples,
                        "train_time_s": train_time_s, "bytes_sent": client.bytes_sent,
                        "bytes_received": client.bytes_received, "num_rejected": exchange.num_rejected}
        if rank != 0:
            metrics.close()
            return None
        summary = finalize_run(config, client, model, flat, test_set, worker_id, started,
                               worker_stats, summary_json)
        metrics.log(step, training.num_epochs - 1, {"loss/test": summary.final_loss,
                                                    "accuracy/test": summary.final_accuracy})
        metrics.close()
        return summary
    finally:
        client.close()


def _compute(model, grads: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, timer: StepTimer):
    """Gradients of one batch, left in the flat gradient buffer."""
    with timer.phase("compute"):
        grads.zero_()
        return forward_backward(model, inputs, targets)


def _log(metrics: MetricsLogger, step: int, epoch: int, tally: Tally, timer: StepTimer,
         client: PSClient, total_samples: int, num_rejected: int) -> None:
    metrics.log(step, epoch, {
        **tally.scalars(),
        **{k: v / tally.num_steps for k, v in timer.drain().items()},
        "comm/bytes_sent": client.bytes_sent,
        "comm/bytes_received": client.bytes_received,
        "samples": total_samples,
        "ps/staleness": tally.staleness / tally.num_steps,
        "ps/rejected": num_rejected,
    })


def _evaluate_epoch(exchange, model, test_set, batch_size: int, metrics: MetricsLogger, step: int,
                    epoch: int) -> None:
    """Test accuracy of the servers' model as it stands at this worker's epoch end."""
    exchange.refresh()
    result = evaluate(model, test_set, batch_size)
    metrics.log(step, epoch, {"loss/test": result.loss, "accuracy/test": result.accuracy})
    metrics.flush()
    logger.info("epoch %d: servers' model test accuracy %.4f, loss %.4f", epoch, result.accuracy,
                result.loss)


def parse_servers(text: str) -> list[str]:
    """Split "h:p,h:p" (shard order).

    Raises:
        ConfigError: empty, or an entry without a port.
    """
    addresses = [part.strip() for part in text.split(",") if part.strip()]
    if not addresses:
        raise ConfigError("--servers: give the servers as HOST:PORT,HOST:PORT in shard order")
    for address in addresses:
        parse_address(address)
    return addresses


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                        help="every shard's server, in shard order")
    parser.add_argument("--worker-id", default=None,
                        help="this worker's name (default: host:pid); a restarted worker reuses its name")
    parser.add_argument("--rank", type=int, default=-1,
                        help="ask for this rank (default: the servers assign the lowest free one)")


def main(args: argparse.Namespace, config: Config) -> RunSummary | None:
    bind_to_parent()
    tune_allocator()
    torch.set_num_threads(config.system.num_threads or 1)
    worker_id = args.worker_id or f"{socket.gethostname()}:{os.getpid()}"
    return run_worker(config, parse_servers(args.servers), worker_id, args.rank, args.summary_json,
                      args.faults)
