"""The end of a parameter-server run: the workers' last barrier, then, on worker rank 0
once every worker is done, the final model (`parameter_server_final.pt`), the run
summary, and the servers' shutdown."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import astuple, dataclass
from typing import Any

import torch

from disttrain.config import Config
from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.errors import DistributedError
from disttrain.metrics.hparams import write_hparams
from disttrain.metrics.summary import RunSummary, Work
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.worker.blocks import block_length
from disttrain.strategies.ps.worker.client import PSClient
from disttrain.strategies.ps.worker.participant import WorkerParticipant
from disttrain.strategies.ps.worker.takeover import away_ranks
from disttrain.training.loop import LoopResult
from disttrain.training.rebalance import plan_summary

logger = logging.getLogger(__name__)

FINAL_MODEL = "parameter_server_final.pt"
# How long rank 0 waits for the other workers to finish after it has.
WAIT_ALL_DONE_S = 3600.0


@dataclass(frozen=True)
class WorkerTotals:
    """What each worker reports at the run's last barrier ("finished"), in its order there."""

    samples: int
    train_time_s: float
    bytes_sent: int
    bytes_received: int
    bytes_dense: int  # compression: gradient bytes before compression (0 when off)
    bytes_compressed: int  # compression: bytes sent after it (0 when off)
    samples_redone: int
    samples_dropped: int
    bytes_received_dense: int  # pull compression: what the parameters received took dense
    samples_taken_over: int = 0  # of the blocks of workers reassigned

    def values(self) -> list[float]:
        return [float(v) for v in astuple(self)]

    @classmethod
    def of(cls, values: list[float]) -> WorkerTotals:
        """From a row of the barrier; a reassigned worker's (NaN: it never came) reads 0."""
        samples, train_time_s, *counts = [0.0 if math.isnan(v) else v for v in values]
        return cls(int(samples), train_time_s, *(int(c) for c in counts))


def wait_all_done(client: PSClient, timeout_s: float) -> list[pb.ShardStatus]:
    """Long-poll every shard until all workers reported done.

    Raises:
        DistributedError: they were not all done within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        wait_s = min(max(remaining, 0.0), client.shards[0].policy.timeout_s)
        statuses = client.call_all("GetStatus", pb.StatusRequest(wait_all_done=True), wait_s + 5.0)
        if all(s.num_done >= s.world_size for s in statuses):
            return statuses
        if remaining <= 0:
            done = min(s.num_done for s in statuses)
            raise DistributedError(f"only {done} of {statuses[0].world_size} workers finished within "
                                   f"{timeout_s:.0f}s")


def shard_summary(statuses: list[pb.ShardStatus]) -> dict[str, Any]:
    """Counters of all shards together (pushes are counted once per shard they reached)."""
    histogram: Counter[int] = Counter()
    for status in statuses:
        histogram.update({int(k): int(v) for k, v in status.staleness_histogram.items()})
    return {
        "shard_versions": [s.version for s in statuses],
        "staleness_histogram": {str(k): histogram[k] for k in sorted(histogram)},
        "num_rejected_stale": sum(s.num_rejected_stale for s in statuses),
        "num_dropped_late": sum(s.num_dropped_late for s in statuses),
        "num_duplicates": sum(s.num_duplicates for s in statuses),
        "num_invalid": sum(s.num_invalid for s in statuses),
        "round_wait_s": max(s.round_wait_s for s in statuses),
        "max_round_wait_s": max(s.max_round_wait_s for s in statuses),
    }


def data_ledger(num_epochs: int, client: PSClient, participant: WorkerParticipant,
                totals: list[WorkerTotals], statuses: list[pb.ShardStatus]) -> dict[str, Any]:
    """What became of every sample of every epoch, from the shards' ledgers: applied
    (shard 0's count), redone (computed again after a failure: duplicates the servers
    turned away, and blocks redone because a shard lacked them), taken over (blocks of
    reassigned workers done by the others), dropped late (backup
    workers: the slowest gradients of a synchronous step, by design) and lost (in a
    block some shard never applied, other than those dropped late)."""
    epochs, world, bpe = num_epochs, participant.world_size, participant.batches_per_epoch
    applied = client.ledger(0, epochs * world * bpe)
    missing = 0
    for block in range(epochs * world * bpe):
        # with local updates, its round's (of each shard's fragment)
        if any(participant.ledger_block(block, s) not in blocks for s, blocks in enumerate(applied)):
            missing += block_length(participant.sampler, participant.batch_size, block)
    dropped = sum(t.samples_dropped for t in totals)
    return {"samples_applied": statuses[0].num_samples_applied, "samples_dropped_late": dropped,
            "samples_lost": missing - dropped,
            "samples_redone": max(s.num_samples_duplicate for s in statuses)
            + sum(t.samples_redone for t in totals),
            "samples_taken_over": sum(t.samples_taken_over for t in totals),
            "num_fenced": sum(s.num_fenced for s in statuses)}


def compression_summary(totals: list[WorkerTotals], pull: bool = False) -> dict[str, Any]:
    """The run's bytes pushed and pulled, and its compression totals from every worker's
    (push compression's when on; pull compression's, beside them, when `pull`)."""
    summary: dict[str, Any] = {"bytes_sent": sum(t.bytes_sent for t in totals),
                               "bytes_received": sum(t.bytes_received for t in totals)}
    dense, sent = sum(t.bytes_dense for t in totals), sum(t.bytes_compressed for t in totals)
    if sent:
        summary.update(compression_ratio=dense / sent, compression_bytes_sent=int(sent))
    received = summary["bytes_received"]
    if pull and received:
        summary.update(compression_pull_ratio=sum(t.bytes_received_dense for t in totals) / received,
                       compression_bytes_received=int(received))
    return summary


def finish(config: Config, client: PSClient, participant: WorkerParticipant, result: LoopResult,
           flat: torch.Tensor, started: float) -> RunSummary | None:
    """End a worker's run: every worker reports its totals at a last barrier and leaves;
    then rank 0 (the lowest rank present, when rank 0 was reassigned) waits for all,
    writes the final model and the summary, and stops the servers. Returns the summary
    there, None elsewhere."""
    position, worker_id, rank = result.position, participant.worker_id, participant.rank
    encoder = participant.exchange.encoder
    counters = (encoder.compressor.counters.bytes_dense, encoder.compressor.counters.bytes_sent) \
        if encoder is not None else (0, 0)
    participant.redo_missing(config.training.num_epochs - 1)
    mine = WorkerTotals(position.samples_processed, position.train_time_s, client.bytes_sent,
                        client.bytes_received, *counters, participant.samples_redone,
                        participant.samples_dropped, client.bytes_received_dense,
                        participant.samples_taken_over)
    rows = client.barrier(worker_id, "finished", mine.values())
    away = away_ranks(rows)  # reassigned: their blocks were taken over
    totals = [WorkerTotals.of(row) for row in rows]
    client.worker_done(worker_id)
    logger.info("worker %d done: %d steps, %d samples in %.1fs of training, %.1f MB sent, "
                "%.1f MB received", rank, position.step, position.samples_processed,
                position.train_time_s, client.bytes_sent / 1e6, client.bytes_received / 1e6)
    if rank != min(r for r in range(len(rows)) if r not in away):  # rank 0, unless it was reassigned
        return None
    statuses = wait_all_done(client, WAIT_ALL_DONE_S)
    # Pulled again: a synchronous round still pending may have been applied when the last
    # workers left the quorum, after this worker's final evaluation.
    versions = client.pull(worker_id, flat, [0] * len(client.shards))
    participant.adopt_buffers()  # the servers' buffers, as the parameters are
    final_path = object_store.join(config.system.checkpoint_dir, FINAL_MODEL)  # a path or a store's URL
    ckpt.save_final_model(final_path, participant.model.state_dict(), config)
    logger.info("final model (versions %s) -> %s", versions, final_path)
    # Read while the servers are still up.
    ledger = data_ledger(config.training.num_epochs, client, participant, totals, statuses)
    workers = [{"rank": r, "samples": t.samples, "train_time_s": t.train_time_s, "bytes_sent": t.bytes_sent,
                "bytes_received": t.bytes_received} for r, t in enumerate(totals)]
    work = Work(samples_processed=sum(w["samples"] for w in workers),
                # A shard's version counts its updates: with local updates, rounds of several steps.
                steps=statuses[0].version if participant.rounds is None else position.step,
                world_size=statuses[0].world_size, total_time_s=time.perf_counter() - started,
                train_time_s=max(w["train_time_s"] for w in workers))
    summary = RunSummary.create(
        f"ps-{statuses[0].aggregation_mode}", config, result.outcome, work,
        extra={"num_servers": len(statuses),
               **ledger,
               **({} if participant.rounds is None else
                  {**participant.rounds.settings.summary_fields(), "local_rounds": statuses[0].version}),
               **plan_summary(participant.sampler),
               "final_model": str(final_path), "resumed_from_step": result.resumed_from_step,
               "workers": workers, "reassigned_workers": away, **shard_summary(statuses),
               **compression_summary(totals, config.compression.pull != "none")})
    summary.write(config.system.log_dir)
    write_hparams(summary, config.system.log_dir)
    # The servers stop last: this worker killed before the summary was written comes back
    # to servers that still answer and ends the run again; stopped first, they were gone
    # and the run ended without a summary (found by disttrain chaos, ps-3shards seed 201).
    client.call_all("Shutdown", pb.ShutdownRequest(worker_id=worker_id))
    return summary
