"""One rank of a live-recovery DDP run: train in the current generation's group; when a
peer is lost, re-form with the survivors and go on from the furthest survivor's state;
at each step boundary, take back ranks that ask to join.

    form the group -> sync state from the furthest holder -> train until done / joiners
         ^                                                        |
         +--- re-form among survivors (a collective failed) <-----+--- grow (joiners)

Each generation trains in the one training loop (`training.loop.TrainingLoop`, as every
strategy does) with the one DDP participant (`ddp.participant.DDPParticipant`, as restart
mode does) under live recovery's policy (`participant.LiveRecovery`: the step boundary
where the group may change, and the group's state), from the state its members synced as
from a resume; the generation's run of the loop ends where the group changes at a step
boundary or a collective fails, and the next generation runs it again.

A rank started again by the launcher (`attempt` > 0) holds no state: it asks to join,
and its first generation hands it the weights, optimizer and position of a live peer.
Rank 0 of each generation writes the periodic checkpoints (`checkpoints`), and rank 0 of
the last one the final model and the summary; with `--resume`, slot 0 starts from the
newest checkpoint and its first generation hands that state to the others. A generation
in which nobody holds state (every holder died: the ranks waiting to join started it,
see `restart`) does the same: its leader reads the newest checkpoint and hands it over.

In an elastic run (`--world-size MIN:MAX`) a rank started by hand (a slot past the run's
first ones) joins like a restarted rank; in a run that counts places (elastic, or with hot
spares) a process that holds none waits first, started up but outside the group, until
one is free (`places.wait_for_place`: a spare), and the leader logs each spare that
steps in; a SIGTERM sets a flag, and at the next step
boundary the member leaves (`_leave`, exit code 143) while the others form the next
generation without it; a group below MIN waits at a step boundary for a rank to join.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from disttrain.config import Config
from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.errors import ConfigError, DistributedError, Preempted
from disttrain.core.faults import FaultInjector
from disttrain.core.processes import ProgressReport, sigterm_handled_by
from disttrain.data import LANGUAGE_MODEL
from disttrain.metrics.logger import MetricsLogger
from disttrain.metrics.summary import Outcome, RunSummary, Work
from disttrain.metrics.time_to_target import perplexity_of
from disttrain.strategies.ddp.heartbeats import LoopProgress
from disttrain.strategies.ddp.live.checkpoints import LiveCheckpoints, load_resume_state
from disttrain.strategies.ddp.live.forming import is_member_lost
from disttrain.strategies.ddp.live.group import Beats, LiveGroup, connect
from disttrain.strategies.ddp.live.membership import (
    Change,
    Holding,
    Patience,
    after_leave,
    choose_source,
    format_members,
    size_change,
    stepped_in,
    world_sizes,
)
from disttrain.strategies.ddp.live.participant import GroupChanges, LeaderStore, LiveRecovery
from disttrain.strategies.ddp.live.places import spare_key, wait_for_place
from disttrain.strategies.ddp.live.state import share_state
from disttrain.strategies.ddp.live.trainer import LiveTrainer
from disttrain.strategies.ddp.runtime import is_peer_loss
from disttrain.training.loop import LoopRecords, LoopSettings, TrainingLoop
from disttrain.training.options import RunOptions

logger = logging.getLogger(__name__)

FINAL_MODEL = "ddp_final.pt"
# A gloo collective whose peer stalls past the timeout raises a plain RuntimeError ("...
# unbound_buffer.cc: Timed out waiting 3000ms for recv operation to complete", torch 2.13):
# torch gives it no type, so its text tells it apart. So does a store's timeout raised in
# Python (`forming.WatchedStore`) that reaches here through torch's C++ (the rendezvous),
# which keeps only its message; a store timeout torch raises itself is a DistStoreError.
TIMEOUT_SIGNS = ("Timed out", "timed out", "Timeout", "timeout")


@dataclass
class Pending:
    """A change of group under way, recorded in the run's recoveries once the next
    generation has synced: its kind (shrink, grow, leave, resume, or restore where nobody
    held the state) and when it began (wall-clock seconds)."""

    kind: str
    failed_at: float = field(default_factory=time.time)


def is_lost_peer(error: BaseException) -> bool:
    """A collective failed because a member died or stalled past the timeout."""
    return (is_peer_loss(error) or is_member_lost(error)
            or isinstance(error, RuntimeError) and any(sign in str(error) for sign in TIMEOUT_SIGNS))


class LiveRank:
    """The generations of one rank process; `run()` once.

    Args:
        config: the run's config.
        slot: this process's rank in the run as started.
        attempt: how often the launcher started this slot before (> 0: a joiner).
        store_address: (host, port) of the launcher's store.
        options: the run's options (faults, summary).
        progress: what the coordinator's heartbeats read (updated after each step).
    """

    def __init__(self, config: Config, slot: int, attempt: int, store_address: tuple[str, int],
                 options: RunOptions, progress: LoopProgress):
        self.config, self.slot, self.attempt = config, slot, attempt
        coordinator, timeout_s = config.coordinator, config.ddp.timeout_s
        patience = Patience(stale_s=coordinator.heartbeat_timeout, window_s=2 * coordinator.heartbeat_timeout,
                            timeout_s=timeout_s)
        self.group = LiveGroup(connect(*store_address, timeout_s), slot, patience, attempt=attempt,
                               first_members=tuple(range(config.system.num_workers)))
        self.beats = Beats(connect(*store_address, timeout_s), slot, coordinator.heartbeat_interval)
        self.trainer = LiveTrainer(config, slot)
        system = config.system
        self.checkpoints = LiveCheckpoints(system.checkpoint_dir, config.training.checkpoint_interval,
                                           system.checkpoint_keep)
        self.resume = options.resume
        self.faults = FaultInjector(options.faults, "rank", slot, attempt)
        self.heartbeat_progress = progress
        self.launcher_progress = ProgressReport()
        self.records: LoopRecords | None = None  # this process's metrics, opened at its first generation
        # The loop's cadence; the trainer reads its data ahead itself (its pieces of the
        # global batches left, planned again at each change of group), so no shards here.
        self.settings = replace(LoopSettings.of(config.training, config.to_dict(),
                                                config.ddp.grad_accumulation_steps), shards=None)
        self.task = self.settings.task  # a language model logs perplexity
        self.pending: Pending | None = None  # the recovery being made, recorded once synced
        # An elastic run (`--world-size MIN:MAX`) trains while at least MIN remain.
        self.min_world_size = config.system.num_workers if config.ddp.max_world_size else 0
        self.last_members: tuple[int, ...] = ()  # the generation trained before this one

    def run(self) -> RunSummary | None:
        """Train to the end with whoever is alive; the last leader returns the summary.

        Raises:
            DistributedError: joining timed out.
        """
        try:
            if self.attempt == 0 and self.slot < self.config.system.num_workers:
                generation, members = 0, tuple(range(self.config.system.num_workers))
                if self.resume:  # slot 0 reads the checkpoint; the others take it from slot 0
                    self._resume()
            else:
                self.trainer.drop_state()
                if not wait_for_place(self.group.store, self.slot, self.attempt,
                                      lambda: self.group.leave_requested):
                    return self._stop_waiting()
                joined = self._join()
                if joined is None:
                    return None
                generation, members = joined
            while True:
                try:
                    self.group.form(generation, members)
                    self.beats.start()  # a member now: its peers watch its beats
                    self._sync()
                    admitted = self.trainer.progress.admitted
                    change = self._train()
                    if change is None:
                        return self._finish()
                    if self.slot in change.leavers:
                        self._leave(change.leavers)  # raises Preempted
                    self.pending = Pending("leave" if change.leavers else "grow")
                    self.trainer.detach()
                    grown = self.group.change(admitted, change.tickets, change.leavers)
                    if grown is not None:
                        generation, members = grown
                        continue
                    lost = "the group's leader was lost while changing the group"
                except (RuntimeError, dist.DistError) as e:
                    if not is_lost_peer(e):
                        raise
                    lost = _first_line(e)
                # Out of the except block: the traceback (whose frames hold the failed group)
                # is gone, so leaving the group closes its sockets.
                joined = self._recover(lost)
                if joined is None:
                    return None
                generation, members = joined
        finally:
            self.beats.stop()
            self.trainer.close()
            if self.records is not None:
                self.records.metrics.close()

    def _resume(self) -> None:
        """`--resume`: slot 0 holds the newest checkpoint's state, the others none (were
        slot 0 lost before handing it over, they must not train on from step 0: their
        group reads the checkpoint again, see `_restore`)."""
        if self.slot != 0:
            self.trainer.drop_state()
            return
        state = load_resume_state(self.config.system.checkpoint_dir)
        if state is not None:
            self.trainer.load_state_dict(state)
            # The run goes on at this launch's size: recorded, so the sizes it ran at read on.
            self.pending = Pending("resume")
            # The checkpoint counts the tickets of its run's store; this run's has none yet.
            self.trainer.progress.admitted = self.group.admitted_so_far()

    def _restore(self) -> None:
        """Nobody alive holds the run's state: take the newest good checkpoint's, with the
        join tickets the store says were taken care of (the checkpoint's count is behind
        when ranks were admitted since it was written). With no checkpoint yet, this
        process's own state goes on: a restarted process's is the run's start, and one a
        survivor dropped when left out of a group is still whole (model, position and
        ledger of one moment)."""
        generation = self.group.generation
        state = load_resume_state(self.config.system.checkpoint_dir, why=f"generation {generation}")
        if state is not None:
            self.trainer.load_state_dict(state)
        else:
            self.trainer.has_state = True
            logger.warning("generation %d: no checkpoint yet in %s; the run goes on from step %d",
                           generation, self.config.system.checkpoint_dir, self.trainer.progress.step)
        self.trainer.progress.admitted = self.group.admitted_so_far()

    def _join(self) -> tuple[int, tuple[int, ...]] | None:
        """Ask to join the running group (None: the run ended meanwhile).

        Raises:
            Preempted: SIGTERMed while waiting: this process leaves before it joined.
        """
        self.pending = Pending("grow")
        joined = self.group.request_join()
        if joined is None and self.group.leave_requested:
            raise Preempted(f"slot {self.slot} left (SIGTERM) before it joined the group; the others "
                            "train on without it")
        return joined

    def _stop_waiting(self) -> None:
        """A process waiting for a place (a hot spare) stops: the run ended (None), or
        SIGTERM (it leaves).

        Raises:
            Preempted: SIGTERMed while waiting.
        """
        if self.group.leave_requested:
            raise Preempted(f"slot {self.slot} left (SIGTERM) while it waited as a spare; the run goes on "
                            "without it")
        logger.info("slot %d: the run ended while it waited as a spare", self.slot)
        return None

    def request_leave(self) -> None:
        """SIGTERM: leave the group at the next step boundary (a signal handler: sets a
        flag only)."""
        self.group.leave_requested = True

    def _leave(self, leavers: tuple[int, ...]) -> None:
        """This member leaves at this step boundary (SIGTERMed): it drops the group and its
        process ends; the others form the next generation without it. When every member
        leaves, the leader first writes a checkpoint of this step, for `--resume`.

        Raises:
            Preempted: always (exit code 143: the launcher does not start it again).
        """
        group, p = self.group, self.trainer.progress
        everyone = set(leavers) >= set(group.members)
        if everyone and group.is_leader:
            self.checkpoints.save(p.step, self.trainer.state_dict())
        self.checkpoints.close()  # a checkpoint under way is complete before the process ends
        self.trainer.drop_wrapper()
        group.leave()
        if everyone:
            raise Preempted(f"slot {self.slot}: every member left the group at step {p.step} (SIGTERM); "
                            f"--resume goes on from the checkpoint of that step in "
                            f"{self.config.system.checkpoint_dir}")
        logger.info("slot %d leaves the group at step %d (SIGTERM): a planned leave; %s train on", self.slot,
                    p.step, format_members(after_leave(group.members, leavers)))
        raise Preempted(f"slot {self.slot} left the group at step {p.step} (SIGTERM); the others train on")

    def _recover(self, reason: str) -> tuple[int, tuple[int, ...]] | None:
        detected = time.time()
        logger.warning("slot %d lost a peer in generation %d (%s); re-forming with the survivors",
                       self.slot, self.group.generation, reason)
        self.trainer.detach()
        self.pending = Pending("shrink", detected)
        joined = self.group.after_failure()
        if joined is None:
            self.trainer.drop_state()
            return self._join()
        return joined

    def _sync(self) -> None:
        """Everyone takes the furthest holder's state (nobody holds any: the leader reads
        the newest checkpoint); record the recovery that led here."""
        group = self.group
        p = self.trainer.progress
        mine = torch.tensor([int(self.trainer.has_state), p.step, len(p.evaluations)], dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in range(group.world_size)]
        dist.all_gather(gathered, mine)
        source = choose_source([Holding(bool(t[0]), int(t[1]), int(t[2])) for t in gathered])
        if source is None:  # every holder died
            source = 0
            if self.pending is not None:
                self.pending.kind = "restore"
            if group.is_leader:
                self._restore()
        trainer = self.trainer
        p = trainer.progress
        state = share_state(trainer.state_dict() if group.rank == source else None, source, group.rank,
                            group.watched(group.store), f"gen{group.generation}/state", group.timeout_s)
        if group.rank != source:
            trainer.load_state_dict(state)
        pending, self.pending = self.pending, None
        # Every member records it (the leader's record is the summary's): the state handed
        # over was read before, so a member that leads a later generation, its leader gone
        # without handing its state on (it left, or died), still lists this change.
        if pending is not None:
            trainer.progress.recoveries.append(self._recovery(pending))
        trainer.attach(group.rank, group.world_size)
        if trainer.balance is not None:  # its balance state goes into the heartbeats
            self.heartbeat_progress.rebalancer = trainer.balance.rebalancer
        if self.records is None:
            folder = os.path.join(self.config.system.log_dir, f"rank{self.slot}")
            resumed = self.attempt or self.resume  # records past the state's step are replaced
            training = self.config.training
            self.records = LoopRecords(MetricsLogger(folder, resume_step=p.step if resumed else None),
                                       self.task, training.log_interval, training.num_epochs)
        self.records.announce = group.is_leader  # each generation's leader speaks for the run
        logger.info("generation %d trains from step %d (epoch %d, batch %d) on %d rank(s)",
                    group.generation, trainer.progress.step, trainer.progress.epoch,
                    trainer.progress.index, group.world_size)
        if self.last_members and len(self.last_members) != group.world_size and group.is_leader:
            assert trainer.sampler is not None
            shares = trainer.sampler.shares
            logger.info("world size %s", size_change(self.last_members, group.members, shares))
        self.last_members = group.members

    def _recovery(self, pending: Pending) -> dict[str, Any]:
        """One recovery as the summary lists it (wall-clock times; the launcher adds when the
        process died); a grow names the hot spares that stepped in (`spares`), each in one
        line of the log."""
        group, step = self.group, self.trainer.progress.step
        recovery = {"kind": pending.kind, "generation": group.generation, "members": list(group.members),
                    "failed_at": pending.failed_at, "resumed_at": time.time(), "step": step}
        before = group.previous_members()  # the leader may be new itself (a spare with a low slot)
        marked = {slot for slot, attempt in group.attempts.items()
                  if slot not in before and group.store.check([spare_key(slot, attempt)])}
        spares = stepped_in(before, group.members, marked)
        for slot in spares if group.is_leader else ():
            logger.info("spare slot %d stepped in at step %d (generation %d, members %s)", slot, step,
                        group.generation, format_members(group.members))
        return {**recovery, "spares": list(spares)} if spares else recovery

    def _train(self) -> Change | None:
        """Run the training loop (`training.loop.TrainingLoop`) for this generation, from the
        state its members synced, until the run ends (None), or joiners wait or members leave
        at a step boundary (what changes: `LiveRecovery.begin_step`).

        The records are the process's (opened at its first generation): a window's figures
        every `training.log_interval` steps, and each epoch's evaluation; the steps of a
        window a change of group cuts short are redone by the next generation, and counted
        in its windows."""
        trainer, group, records = self.trainer, self.group, self.records
        assert records is not None and trainer.sampler is not None
        p = trainer.progress
        position = self.heartbeat_progress.position  # the loop moves it; the heartbeats read it
        position.epoch, position.step = p.epoch, p.step
        position.samples_processed, position.train_time_s = trainer.samples_trained, trainer.train_time_s()
        recovery = LiveRecovery(trainer, group, self.min_world_size, self.launcher_progress)
        participant = trainer.participant(recovery)
        loop = TrainingLoop(self.settings, participant, trainer.sampler,
                            LeaderStore(self.checkpoints, group.is_leader),
                            records.metrics.folder, self.faults,
                            lambda total, done: None,  # only `run` opens a display; `train` takes none
                            announce=group.is_leader,
                            slows_waits=True, position=position, clock=trainer.clock)
        try:
            loop.train(records)  # no progress display: the log tells each generation's start
        except GroupChanges as changes:
            return changes.change
        records.close_window(p.step, p.epoch, trainer.samples_trained, trainer.train_time_s())
        return None

    def _finish(self) -> RunSummary | None:
        """The run is over: every member's process id, then the leader writes the results."""
        group, trainer = self.group, self.trainer
        mine = torch.tensor([self.slot, os.getpid()], dtype=torch.int64)
        pids = [torch.zeros_like(mine) for _ in range(group.world_size)]
        dist.all_gather(pids, mine)
        trained = torch.tensor([trainer.samples_trained, trainer.samples_redone], dtype=torch.int64)
        dist.all_reduce(trained)
        if group.is_leader:
            with trainer.clock.paused():
                self.checkpoints.save_final(trainer.progress.step, trainer.state_dict())
        self.checkpoints.close()  # the last checkpoint complete before the run reports done
        group.finish()
        dist.barrier()
        trainer.drop_wrapper()
        group.leave()
        self.heartbeat_progress.position.train_time_s = trainer.train_time_s()
        if not group.is_leader:
            return None
        return self._summary({str(int(slot)): int(pid) for slot, pid in (t.tolist() for t in pids)},
                             *(int(n) for n in trained.tolist()))

    def _summary(self, pids: dict[str, int], samples_trained: int, samples_redone: int) -> RunSummary:
        config, trainer = self.config, self.trainer
        p = trainer.progress
        ckpt.save_final_model(object_store.join(config.system.checkpoint_dir, FINAL_MODEL),
                              trainer.module.state_dict(), config)
        applied, lost, twice = trainer.ledger_totals()
        _, accuracy, loss = p.evaluations[-1]
        evaluations = tuple((t, self._figure(a, test_loss)) for t, a, test_loss in p.evaluations)
        outcome = Outcome(accuracy, loss, evaluations, self.task)
        work = Work(samples_processed=applied, steps=p.step, world_size=config.system.num_workers,
                    total_time_s=trainer.train_time_s(), train_time_s=trainer.train_time_s())
        return RunSummary.create(
            "ddp", config, outcome, work,
            extra={"backend": "gloo", "device": "cpu", "learning_rate": config.training.learning_rate,
                   "ddp_recovery": "live", "samples_applied": applied, "samples_lost": lost,
                   "samples_applied_twice": twice, "samples_redone": samples_redone,
                   "samples_trained": samples_trained,
                   "final_pids": pids, "live_recoveries": p.recoveries, **self._balance_fields(),
                   "live_world_sizes": world_sizes(p.first_world_size, p.recoveries),
                   **self._elastic_fields(),
                   **({} if trainer.rounds is None else trainer.rounds.summary_fields())})

    def _figure(self, accuracy: float, loss: float) -> float:
        """An evaluation's figure for the time to target: its accuracy, or a language
        model's perplexity."""
        return accuracy if self.task != LANGUAGE_MODEL else perplexity_of(loss)

    def _elastic_fields(self) -> dict[str, Any]:
        """An elastic run's range: `min_world_size` and `max_world_size`."""
        config = self.config
        if not config.ddp.max_world_size:
            return {}
        return {"min_world_size": config.system.num_workers, "max_world_size": config.ddp.max_world_size}

    def _balance_fields(self) -> dict[str, Any]:
        """Under `system.balance`: `balance_plans` ([epoch, batch, batches] of every balanced
        split adopted, at a change of group or a re-plan) and `balance_replans` (the latter)."""
        if self.config.system.balance == "none":
            return {}
        p = self.trainer.progress
        return {"balance_plans": p.plans, "balance_replans": p.replans}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]


def run_live_rank(config: Config, slot: int, attempt: int, store_address: tuple[str, int],
                  options: RunOptions, progress: LoopProgress) -> RunSummary | None:
    """Run one live rank to the end (see `LiveRank`).

    Raises:
        ConfigError: the state resumed from was written with another compression scheme.
        DistributedError: the run cannot go on (not admitted, or no member left to re-form).
        Preempted: SIGTERMed, this rank left the group (exit code 143: not restarted).
    """
    rank = LiveRank(config, slot, attempt, store_address, options, progress)
    try:
        # SIGTERM to this rank is a planned leave at the next step boundary (`LiveRank._leave`).
        with sigterm_handled_by(lambda signum, frame: rank.request_leave()):
            return rank.run()
    except ConfigError:  # bad input (a checkpoint of another compression scheme): exit code 2
        raise
    except ValueError as e:  # next_members: nobody left to form the next generation
        raise DistributedError(f"slot {slot}: {e}; the run cannot go on") from e
