"""The end of a parameter-server run, done by worker rank 0 once every worker is done:
pull the final model from every shard, evaluate it, write `parameter_server_final.pt`
and the run summary, and shut the servers down."""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain import checkpoint as ckpt
from disttrain.config import Config
from disttrain.data import ArrayDataset
from disttrain.engine import evaluate
from disttrain.errors import DistributedError
from disttrain.metrics import RunSummary
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.ps.client import PSClient

logger = logging.getLogger(__name__)

FINAL_MODEL = "parameter_server_final.pt"
# How long rank 0 waits for the other workers to finish after it has.
WAIT_ALL_DONE_S = 3600.0


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
    }


def finalize_run(config: Config, client: PSClient, model: nn.Module, flat: torch.Tensor,
                 test_set: ArrayDataset, worker_id: str, started: float, worker_stats: dict[str, Any],
                 summary_json: str | Path | None) -> RunSummary:
    """Wait for every worker, evaluate the final model, write it and the summary, stop the servers."""
    training, system = config.training, config.system
    statuses = wait_all_done(client, WAIT_ALL_DONE_S)
    versions = client.pull(worker_id, flat, [0] * len(client.shards))
    result = evaluate(model, test_set, training.eval_batch_size)
    final_path = Path(system.checkpoint_dir) / FINAL_MODEL
    ckpt.save_final_model(final_path, model.state_dict(), config)
    logger.info("final model (versions %s): test accuracy %.4f, loss %.4f -> %s", versions,
                result.accuracy, result.loss, final_path)
    client.call_all("Shutdown", pb.ShutdownRequest())
    samples = statuses[0].num_samples_applied
    train_time_s = worker_stats["train_time_s"]
    summary = RunSummary(
        strategy=f"ps-{statuses[0].aggregation_mode}", dataset=training.dataset,
        final_accuracy=result.accuracy, final_loss=result.loss,
        total_time_s=time.perf_counter() - started,
        throughput_samples_per_s=samples / max(train_time_s, 1e-9), samples_processed=samples,
        steps=statuses[0].version, epochs=training.num_epochs, world_size=statuses[0].world_size,
        config=config.to_dict(),
        extra={"num_servers": len(statuses), "train_time_s": train_time_s,
               "final_model": str(final_path), "worker0": worker_stats, **shard_summary(statuses)},
    )
    summary.write(system.log_dir, summary_json)
    return summary
