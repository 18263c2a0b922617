"""A parameter-server checkpoint of N workers resumed on M (`disttrain ps --workers M
--resume`, in every aggregation mode): the launcher turns the stopped run's checkpoints into
those of M workers before any process starts, and the run resumes from them as from its own.
An elastic run (`--workers MIN:MAX`) goes through the same rewrite at each
change of size (`run.elastic`).

Where it starts from: every worker stopped with its checkpoint (a preemption's), all in
epoch `e`, worker `r` `k_r` batches into it (one step and position for all in sync mode;
async and SSP workers may stand apart), and every shard's ledger holds exactly the blocks
of the batches taken (every block of the epochs before `e`, and the first `k_r` of every
worker `r` in `e`). Anything else (a run killed between checkpoints, a shard behind) is
refused: resume it on N, stop it with SIGTERM, and resume that on M.

What the M workers get (the batch rule and RNG are `training.resize`'s, shared with DDP):

- The global batch is kept: each worker takes `B·N/M`; a global batch that does not divide
  over M is refused, naming the sizes that keep it.
- The epoch is re-split by position, not by rank (`run.positions`): the samples the N
  handed out are dealt to the front of the M shards in whole new batches, as evenly as they
  go, and the samples the epoch still owes after them, so each new worker `j` is `q_j`
  batches into its shard, and no sample of the epoch is applied twice or left out (but a
  tail of fewer than M owed samples, as a permutation's; handed-out samples short of a whole
  new batch are applied already, and leave the list).
- The ledger is written in the M workers' numbering of blocks (`worker.blocks`): every
  worker's first `q_j` blocks of the epoch and every block before it.
- Each worker's step is the epoch's first step plus its `q_j` (in sync mode, the step every
  worker stopped at); the shards' last step of each worker, and SSP's step clocks
  (`ps.ssp_clock: steps`), restart from it, so the slowest new worker is at most one
  step behind the fastest.
- Each worker's RNG is re-derived from the seed; the run's samples processed are shared
  over the M; the old workers' traffic counters stay with the workers that keep their rank.
- The shards keep their parameters, optimizer state, version and counters; they forget the
  ranks above M and the barriers of the earlier launch.

Each rewritten checkpoint replaces the newest one (atomically) and the older ones of its
folder are removed, so no process can fall back to a checkpoint of the other numbering.
Workers the run no longer has keep their folders; a later resize past them overwrites them.
Compression, local updates, a balance plan and backup workers are refused (exit 2): their
state belongs to the old workers' numbering.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from disttrain.config import Config
from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.errors import CheckpointError, ConfigError
from disttrain.strategies.ps.run.layout import train_length
from disttrain.strategies.ps.run.positions import EpochSplit, resplit_positions
from disttrain.strategies.ps.server.ledger import batches_per_epoch
from disttrain.strategies.ps.worker.blocks import block_id
from disttrain.training.resize import rederived_rng, resized_batch_size

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Numbering:
    """A run's numbering of data blocks: `world_size` workers of `batches_per_epoch` each."""

    world_size: int
    batches_per_epoch: int

    def steps_taken(self, epoch: int, batches: int | Sequence[int]) -> set[int]:
        """The blocks of every worker's first `batches` of `epoch` (one count for all, or
        one per rank), and of every epoch before."""
        taken = [batches] * self.world_size if isinstance(batches, int) else list(batches)
        return {block_id(e, rank, index, self.world_size, self.batches_per_epoch)
                for e in range(epoch + 1) for rank in range(self.world_size)
                for index in range(self.batches_per_epoch if e < epoch else taken[rank])}


def resumed_config(config: Config) -> Config:
    """The config a resumed run's processes take: the per-worker batch that keeps the
    checkpoint's global batch (said in the log when it is not the config's). The launcher
    calls it before any process starts, then `resize_checkpoints`.

    Raises:
        ConfigError: the checkpoint cannot be resumed on `system.num_workers` workers.
        CheckpointError: every checkpoint of worker 0 is damaged, or the newest lacks its
            run's config (an earlier build's).
    """
    resumed = _resumed(config)
    if resumed is None:
        return config
    (written, batch_size), world_size = resumed, config.system.num_workers
    if written == world_size and batch_size == config.training.batch_size:
        return config
    logger.info("resuming a checkpoint of %d workers on %d: per-worker batch %d keeps the global batch of %d",
                written, world_size, batch_size, batch_size * world_size)
    return config.replace(training={"batch_size": batch_size})


def resumed_batch_size(config: Config) -> int:
    """The per-worker batch of `resumed_config`, logging nothing: for what is checked
    before the launcher runs (the steps a fault may name).

    Raises:
        ConfigError, CheckpointError: as `resumed_config`.
    """
    resumed = _resumed(config)
    return config.training.batch_size if resumed is None else resumed[1]


def _resumed(config: Config) -> tuple[int, int] | None:
    """The number of workers that wrote worker 0's newest checkpoint and the per-worker
    batch that keeps its global batch on this run's; None without such a checkpoint."""
    folder = config.system.checkpoint_dir
    chosen = ckpt.load_latest_good_checkpoint(object_store.join(folder, "worker0"))
    if chosen is None or chosen[1].get("strategy") != "ps-worker":
        return None
    state, world_size = chosen[1], config.system.num_workers
    if "config" not in state:
        raise CheckpointError(f"checkpoint {chosen[0]} lacks its run's config (a checkpoint of an earlier "
                              "disttrain); start a fresh run in another --checkpoint-dir")
    written = int(state["world_size"])
    written_batch = state["config"]["training"]["batch_size"]
    batch_size = resized_batch_size(int(written_batch), written, world_size, flag="--workers", noun="workers")
    if written != world_size:
        check_resizable(config, written, state["config"].get("ps", {}).get("aggregation_mode", "sync"))
    return written, batch_size


def resize_checkpoints(config: Config) -> None:
    """Rewrite the checkpoints of a run of another number of workers for this one's
    (`rewrite_checkpoints`; nothing when they are this run's). Call it with the config
    `resumed_config` returned, before any process starts.

    Raises:
        ConfigError: they cannot be rewritten (see `rewrite_checkpoints`).
    """
    chosen = ckpt.load_latest_good_checkpoint(object_store.join(config.system.checkpoint_dir, "worker0"))
    if chosen is not None and chosen[1].get("strategy") == "ps-worker" \
            and int(chosen[1]["world_size"]) != config.system.num_workers:
        rewrite_checkpoints(config, int(chosen[1]["world_size"]))


def check_resizable(config: Config, written: int, mode: str = "sync") -> None:
    """Raises ConfigError for a run whose state belongs to its workers' numbering, or
    that resumes a checkpoint of aggregation mode `mode` in another."""
    if config.ps.aggregation_mode != mode:
        raise ConfigError(f"ps.aggregation_mode: the checkpoint was written in {mode} mode and this run is "
                          f"{config.ps.aggregation_mode}; resume with --aggregation-mode {mode}")
    reasons = refusals(config)
    if reasons:
        raise ConfigError(f"system.num_workers: a parameter-server checkpoint of {written} workers resumes "
                          f"on {config.system.num_workers} without compression, local updates, "
                          f"balance or backup workers, and this run has {', '.join(reasons)}; resume with "
                          f"--workers {written}")


def refusals(config: Config) -> list[str]:
    """What in `config` belongs to its workers' numbering (none: a resize carries it over)."""
    refused = [(config.compression.enabled, "compression (its residuals are the old workers')"),
               (config.compression.pull != "none", f"compression.pull: {config.compression.pull}"),
               (config.training.local_update_mode, "local updates (training.sync_every > 1)"),
               (config.system.balance != "none", f"system.balance: {config.system.balance}"),
               (config.ps.backup_workers > 0, "ps.backup_workers > 0")]
    return [reason for refuse, reason in refused if refuse]


def rewrite_checkpoints(config: Config, written: int) -> None:
    """Rewrite the newest checkpoints of the `written` workers and every shard as those
    of `system.num_workers` workers with `training.batch_size` each (the module's docstring).

    Raises:
        ConfigError: they are not of one stop (one step in sync mode, one epoch in every
            mode, the ledgers holding the workers' batches), or the epoch cannot be re-split.
    """
    folder, world_size = config.system.checkpoint_dir, config.system.num_workers
    workers = [_newest(folder, f"worker{rank}") for rank in range(written)]
    shards = [_newest(folder, f"server{shard}") for shard in range(config.ps.num_servers)]
    retry = (f"resume with --workers {written}, stop that run with SIGTERM (its checkpoints are of one step) "
             f"and resume those on {world_size}")
    stops = {(int(s["position"]["step"]), int(s["sampler"]["epoch"]), int(s["sampler"]["position"]))
             for _, s in workers}
    if len(stops) != 1 and (config.ps.aggregation_mode == "sync" or len({e for _, e, _ in stops}) != 1):
        raise ConfigError(f"the workers' newest checkpoints are of different "
                          f"{'steps or positions' if config.ps.aggregation_mode == 'sync' else 'epochs'} "
                          f"({sorted(stops)}); {retry}")
    epoch = int(workers[0][1]["sampler"]["epoch"])
    old_batch = int(workers[0][1]["config"]["training"]["batch_size"])
    num_samples = train_length(config)
    old = Numbering(written, batches_per_epoch(num_samples, old_batch, written, False))
    new = Numbering(world_size, batches_per_epoch(num_samples, config.training.batch_size, world_size, False))
    done = [-(-int(s["sampler"]["position"]) // old_batch) for _, s in workers]  # the last may be short
    expected = old.steps_taken(epoch, done)
    for name, state in shards:
        if {int(b) for b in state["rules"]["ledger"]["blocks"]} != expected:
            raise ConfigError(f"{name}'s newest checkpoint (version {state['version']}) has not applied "
                              f"exactly the workers' batches ({', '.join(map(str, done))} of epoch {epoch}); "
                              f"{retry}")
    finished = all(taken == old.batches_per_epoch for taken in done)
    split = _resplit([s["sampler"] for _, s in workers], config, finished)
    order = split.samplers[0].get("order")
    length = (num_samples if order is None else len(order)) // world_size
    if -(-length // config.training.batch_size) != new.batches_per_epoch:
        raise ConfigError(f"the rest of epoch {epoch} re-split over {world_size} workers makes "
                          f"{-(-length // config.training.batch_size)} batches each, not the "
                          f"{new.batches_per_epoch} of the run's other epochs; {retry}")
    # The epoch's first step: worker r's step less its batches of the epoch (one for all
    # unless a takeover gave some more steps; the lowest keeps everyone's clock ahead of none).
    first_step = min(int(s["position"]["step"]) - taken for (_, s), taken in zip(workers, done, strict=True))
    # No new step below a checkpoint already in its folder (a worker once ahead now stands
    # with the others), which would stay the newest: the steps move on together instead.
    first_step = max([first_step] + [_newest_step(folder, f"worker{rank}") - taken
                                     for rank, taken in enumerate(split.batches_taken)])
    steps = [first_step + taken for taken in split.batches_taken]
    ledger = sorted(new.steps_taken(epoch, split.batches_taken))
    total = sum(int(s["position"]["samples_processed"]) for _, s in workers)
    for rank in range(world_size):
        state = _worker_state(workers[rank if rank < written else 0][1], config, rank, split.samplers[rank],
                              steps[rank])
        extra = total % world_size if rank == 0 else 0  # the total's remainder is rank 0's
        state["position"]["samples_processed"] = total // world_size + extra
        taken = split.batches_taken[rank]
        state["last_block"] = block_id(epoch, rank, taken - 1, world_size, new.batches_per_epoch) \
            if taken else -1
        if rank >= written:  # a new worker: the run's traffic so far is the old workers'
            state.update(worker_id=f"worker{rank}", bytes_sent=0, bytes_received=0, bytes_received_dense=0,
                         samples_redone=0, samples_taken_over=0)
        ckpt.save_checkpoint(object_store.join(folder, f"worker{rank}"), steps[rank], state, keep=1)
    for name, state in shards:
        ckpt.save_checkpoint(object_store.join(folder, name), int(state["version"]),
                             _shard_state(state, config, steps, ledger), keep=1)
    logger.info("rewrote the checkpoints of %d workers (epoch %d, batches %s of it taken) for %d: per-worker "
                "batch %d, batches %s of the epoch taken, %d samples of it owed (%d left out as its tail); "
                "the ledger renumbered, each worker's RNG re-derived from the seed", written, epoch,
                "/".join(map(str, done)), world_size, config.training.batch_size,
                "/".join(map(str, split.batches_taken)), split.owed - split.left_out, split.left_out)


def _newest(folder: str, name: str) -> tuple[str, dict[str, Any]]:
    chosen = ckpt.load_latest_good_checkpoint(object_store.join(folder, name))
    if chosen is None:
        raise ConfigError(f"--resume: {name} has no checkpoint in {folder}, so the run cannot be resized; "
                          "resume it with the number of workers it was started with")
    return name, chosen[1]


def _newest_step(folder: str, name: str) -> int:
    """The step of the newest checkpoint in `folder`'s `name` (-1: none)."""
    found = ckpt.list_checkpoints(object_store.join(folder, name))
    return max((ckpt.checkpoint_step(path) for path in found), default=-1)


def _resplit(states: list[dict[str, Any]], config: Config, finished: bool) -> EpochSplit:
    """The epoch re-split for the new workers (`run.positions`); an epoch every worker
    finished is the new layout's permutation, finished."""
    world_size, batch_size = config.system.num_workers, config.training.batch_size
    if finished:
        num, seed = int(states[0]["num_samples"]), int(states[0]["seed"])
        samplers = [{"num_samples": num, "world_size": world_size, "rank": rank, "seed": seed,
                     "epoch": int(states[0]["epoch"]), "position": num // world_size}
                    for rank in range(world_size)]
        taken = -(-(num // world_size) // batch_size)
        return EpochSplit(samplers, [taken] * world_size, num, 0, 0)
    try:
        return resplit_positions(states, world_size, batch_size)
    except ValueError as e:
        raise ConfigError(f"the checkpoint's epoch cannot be re-split: {e}; resume with --workers "
                          f"{int(states[0]['world_size'])}") from e


def _resized_config(record: dict[str, Any], config: Config) -> dict[str, Any]:
    record = copy.deepcopy(record)
    record.setdefault("system", {})["num_workers"] = config.system.num_workers
    record.setdefault("training", {})["batch_size"] = config.training.batch_size
    return record


def _worker_state(state: dict[str, Any], config: Config, rank: int, sampler: dict[str, Any], step: int
                  ) -> dict[str, Any]:
    """Worker `rank`'s checkpoint at `step`, from `state` (its own, or worker 0's for a new worker)."""
    world_size = config.system.num_workers
    return {**state, "rank": rank, "world_size": world_size, "sampler": sampler,
            "rng": rederived_rng(config.training.seed, step, world_size, rank),
            "position": {**state["position"], "step": step}, "dropped_blocks": [],
            "resized_from": int(state["world_size"]),
            "config": _resized_config(state["config"], config)}


def _shard_state(state: dict[str, Any], config: Config, steps: list[int], ledger: list[int]
                 ) -> dict[str, Any]:
    """A shard's checkpoint for the new workers: the ranks above them and the earlier
    launch's barriers forgotten, worker `j` at `steps[j]` (its SSP clock too), the ledger
    renumbered."""
    world_size = config.system.num_workers
    rules = dict(state["rules"])
    ranks = {str(w): int(r) for w, r in rules["ranks"].items() if int(r) < world_size}
    parked = rules["roster"]["parked"]
    rules.update(ranks=ranks, done=[int(r) for r in rules["done"] if int(r) < world_size],
                 last_step=dict(enumerate(steps)),
                 roster={**rules["roster"], "parked": dict.fromkeys(range(world_size), max(parked.values()))
                         if parked else {}},
                 ledger={**rules["ledger"], "blocks": ledger})
    if "clocks" in rules:  # SSP on steps: the bound holds from the new workers' steps
        rules["clocks"] = {str(rank): step for rank, step in enumerate(steps)}
    identities = {w: b for w, b in state["identities"].items() if w in ranks}
    return {**state, "rules": rules, "barriers": {}, "identities": identities,
            "config": _resized_config(state["config"], config)}
