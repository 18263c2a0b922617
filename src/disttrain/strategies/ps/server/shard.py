"""The state of one parameter-server shard: its slice of the parameters, the optimizer
that updates it, and the pure rules it composes (aggregation, barriers, identities), with
versions, long-poll waits and checkpoints.

Thread-safe: the gRPC servicer calls in from many threads. A push is decoded and
validated outside the lock; only the decision and the update take it. A rejected push
changes nothing. Readers wait on a condition variable for a version (no polling), and
each version's parameter bytes are snapshotted once and shared by every reader.

Like every stateful part of the project, a shard saves itself with `state_dict()` and
comes back with `load_state_dict()`: parameters, model buffers, optimizer state, version,
the data ledger, the rules' counters, the completed barriers and who holds each worker
id, together, so they never disagree.

Every parameter answer carries, beside its version, the run's step it is the result of
(`AggregationRules.sync_step` in sync mode), and whether the shard was restored and has
completed no synchronous step since (`AggregationRules.restored`): what a worker compares
its shards' answers by (`worker.agreement`). Both change only with the version (or a
restore), so a snapshot carries those of its version. A push that joined a synchronous
step is answered once that step is applied (`step_applied`), not at the next version:
a block redone meanwhile moves the version on within the step.

Pull compression (`broadcast`): every answer is then the shard's broadcast copy, which
every worker holds exactly; a step's answer is the compressed changes to it from the
version the worker holds, when the copy kept them (in sync mode the one change of the
step; in async and SSP as many as the worker is behind), and the copy becomes the
parameters at every dense version and once every worker is done (so the final model is
the parameters themselves).

The buffer rule: a shard holding model buffers (BatchNorm running statistics, batch
counters) moves them, at each update, by the weighted sum of the changes the applied
pushes made to them, with the weights their gradients are combined with: in sync mode
each worker's share of the step's samples (every worker started from the same buffers,
so the result is the sample-weighted average of the workers' buffers), in ssp and async
mode each push's whole change, as its gradient is applied whole. Every parameter answer
carries the buffers of its version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain.config import TrainingConfig
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import CheckpointError
from disttrain.core.identity import NotPermitted
from disttrain.core.saver import CheckpointWriter
from disttrain.strategies.ps.server.aggregation import AggregationRules, Decision, Outcome, Push
from disttrain.strategies.ps.server.barriers import Barriers
from disttrain.strategies.ps.server.broadcast import BroadcastCopy
from disttrain.strategies.ps.server.members import Identities
from disttrain.strategies.ps.server.optimizer import ShardOptimizer
from disttrain.strategies.ps.server.segments import WorkerSegments
from disttrain.strategies.ps.server.update import GuardedUpdate, NonFiniteUpdate
from disttrain.strategies.ps.server.validation import InvalidPush, PushDecoder
from disttrain.strategies.ps.wire import service
from disttrain.strategies.ps.wire.codec import Payload, tensor_bytes
from disttrain.strategies.ps.wire.service import Snapshot
from disttrain.strategies.ps.wire.sharding import ShardPlan
from disttrain.strategies.ps.wire.shared_memory import SegmentPair

logger = logging.getLogger(__name__)

STRATEGY = "ps-server"  # the tag of a shard's checkpoints
REQUIRED_KEYS = ("strategy", "shard", "numel", "params", "optimizer", "rules")
# What a shard's checkpoint and its rules hold besides: one without them is an earlier
# build's, which no release wrote.
CURRENT_KEYS = ("schedule", "buffers", "barriers", "identities")
CURRENT_RULES_KEYS = ("sync_step", "step_version", "restored")


class ShardStopping(RuntimeError):
    """A call that arrived after the final checkpoint began: not taken (retry later)."""


class WorkersNotDone(RuntimeError):
    """A Shutdown while workers are still training (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where and how often a shard saves itself.

    Args:
        folder: this shard's checkpoint folder: a path, or a store's URL (see `core.object_store`).
        every_versions: a checkpoint each time the version reaches a multiple of this.
        keep: how many of the newest checkpoints stay in `folder`.
        run_config: the run's resolved config, saved in every checkpoint.
        on_failure: told of a write that failed for good (see `core.saver.CheckpointWriter`).
    """

    folder: str | Path
    every_versions: int
    keep: int
    run_config: dict[str, Any] = field(default_factory=dict)
    on_failure: Callable[[Exception], None] | None = None


@dataclass(frozen=True)
class ShardValues:
    """The values a shard starts from.

    Attributes:
        plan: the slices this shard owns.
        initial: the shard's initial flat parameters (1-D, plan.numel elements).
        buffers: the initial values of the plan's buffers (float64, 1-D, plan.buffer_numel
            elements; None: the plan holds none).
        model_numel: elements of the whole model, of which clipping gives this shard its
            share (None: the shard is the whole model).
    """

    plan: ShardPlan
    initial: torch.Tensor
    buffers: torch.Tensor | None = None
    model_numel: int | None = None


@dataclass(frozen=True)
class ShardCodecs:
    """How a shard reads pushes and answers pulls.

    Attributes:
        decoder: checks and decodes pushes (the run's compression and batch bound).
        broadcast: pull compression's broadcast copy (None: answers are the parameters,
            dense); every answer is then the copy (see `broadcast`).
    """

    decoder: PushDecoder
    broadcast: BroadcastCopy | None = None


@dataclass(frozen=True)
class WorkerClaim:
    """Who a worker says it is: its id, the key it holds, the generation it joined in."""

    worker_id: str
    key: bytes
    generation: int


@dataclass(frozen=True)
class Registration:
    """What a worker's registration with a shard gave it: its rank, the shard's version,
    its session, and its shared-memory segments (None unless offered and made)."""

    rank: int
    version: int
    session: bytes
    segments: SegmentPair | None


class ShardState:
    """One shard. Build it, optionally `restore()` it, then serve pushes and pulls.

    Args:
        values: the plan and the values the shard starts from.
        rules: the aggregation rules of the run (sync, ssp or async; its world size).
        codecs: how the shard decodes pushes and answers pulls.
        training: the optimizer's settings (`training.optimizer`, learning rate, ...).
        checkpoints: where and how often the shard saves itself (None: never).
        clock: returns seconds; the aggregation rules measure synchronous waits with it.
    """

    def __init__(self, values: ShardValues, rules: AggregationRules, codecs: ShardCodecs,
                 training: TrainingConfig, checkpoints: CheckpointPolicy | None = None, clock=time.monotonic):
        plan, initial, buffers, model_numel = values.plan, values.initial, values.buffers, values.model_numel
        if initial.numel() != plan.numel:
            raise ValueError(f"shard {plan.shard} owns {plan.numel} elements, got {initial.numel()}")
        buffers = torch.zeros(0, dtype=torch.float64) if buffers is None else buffers
        if buffers.numel() != plan.buffer_numel:
            raise ValueError(f"shard {plan.shard} holds {plan.buffer_numel} buffer elements, got "
                             f"{buffers.numel()}")
        self.plan = plan
        self.buffers = buffers.detach().to(torch.float64).reshape(-1).clone()
        self.rules = rules
        self.decoder = codecs.decoder
        self.param = nn.Parameter(initial.detach().clone().reshape(-1))
        self.shard_optimizer = ShardOptimizer(self.param, plan, training, model_numel or plan.numel,
                                              1 if rules.mode == "sync" else rules.world_size)
        self.optimizer = self.shard_optimizer.optimizer
        self.checkpoints = checkpoints
        self.clock = clock
        self.on_version: Callable[[int], None] = lambda version: None  # called at each new version
        # Tells workers this server restarted. Microseconds, so it fits in 53 bits (until the
        # year 2255): a client that reads int64 fields as floating-point numbers (a common
        # JavaScript proto-loader setting) sends it back unchanged.
        self.incarnation = time.time_ns() // 1000
        self.num_invalid = self.num_refused_nonfinite = 0
        self.stopping = False
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._snapshot: Snapshot | None = None
        # Bounded: a slow disk makes saves wait, never piles up copies of the state.
        self._writer = None if checkpoints is None else CheckpointWriter(checkpoints.folder, checkpoints.keep,
                                                                          checkpoints.on_failure)
        self.segments = WorkerSegments(plan.nbytes, plan.dtype)
        self.barriers = Barriers(rules.world_size)
        self.update = GuardedUpdate(self.param, self.optimizer, self.shard_optimizer)
        self.identities = Identities()
        self.broadcast = codecs.broadcast

    def register(self, claim: WorkerClaim, requested_rank: int, shared_memory: bool = False,
                 epochs_done: int = 0, sync_step: int = 0) -> Registration:
        """Register the worker of `claim` (its id, key and generation), having trained
        `epochs_done` epochs to their end, its pushes computed on step `sync_step` now
        (see `AggregationRules.joined`); with
        `shared_memory` (the worker asked, from this host) fresh segments are made for
        it, else any it had are dropped.

        Raises:
            InvalidIdentity, IdentityTaken, UnknownGeneration: see `Identities.check_claim`.
            PushRefused: no rank fits.
        """
        worker_id = claim.worker_id
        with self._changed:
            self.identities.check_claim(worker_id, claim.key, claim.generation, self.rules.roster)
            rank = self.rules.register(worker_id, requested_rank)
            session = self.identities.bind(worker_id, claim.key, claim.generation)
            self._apply_or_void(self.rules.joined(worker_id, epochs_done, self.clock(), sync_step))
            self.barriers.give_up_pending()  # a restarted worker is behind: no check waits for it
            self._changed.notify_all()
            version = self.rules.version
        if shared_memory:
            segments = self.segments.offer(worker_id)
        else:
            segments = None
            self.segments.drop(worker_id)
        return Registration(rank, version, session, segments)

    def barrier(self, worker_id: str, session: bytes, name: str, values: list[float],
                timeout_s: float | None, step: int = 0) -> list[list[float]] | None:
        """Arrive at barrier `name` (of `step`: see `Barriers`); every worker's values once
        all arrived, [] if it was given up, or None on timeout or stop.

        Raises:
            SessionRefused, UnknownWorker: not the worker's session.
            PushRefused: values of another length than the others'.
        """
        with self._changed:
            self.identities.check(worker_id, session)
            rank = self.rules.rank_of(worker_id)
            complete = self.barriers.result(name) is not None
            self.barriers.arrive(name, rank, values, step, self.rules.last_step, self.clock())
            if not complete and self.barriers.result(name) is not None and self._writer is not None:
                # Kept, so a worker whose answer a crash lost is answered again after a restart.
                self._save_async(self._state())
            self._changed.notify_all()
            self._changed.wait_for(lambda: self.barriers.result(name) is not None or self.stopping,
                                   timeout_s)
            return self.barriers.result(name)

    def worker_done(self, worker_id: str, session: bytes) -> None:
        """`worker_id` finished training; answered once that is in a checkpoint. Raises
        SessionRefused, UnknownWorker, or CheckpointError (the write failed)."""
        with self._changed:
            self.identities.check(worker_id, session)
            self._apply_or_void(self.rules.mark_done(worker_id, self.clock()))
            if self.broadcast is not None and self.rules.all_done():
                # The run's end: the final pull (the final model) takes the parameters themselves.
                self.broadcast.reset(self.param, self.rules.version)
                self._snapshot = None
            self._changed.notify_all()
            state = self._state() if self.checkpoints is not None and not self.stopping else None
        if state is not None:
            # A worker that is done exits, and no registration of it tells a shard restored
            # later that it finished: the mark must be in a checkpoint before the worker
            # hears it was taken, or a shard restored from an older one holds the run's end
            # for a worker that is gone (found by disttrain chaos, ps-local seed 91).
            self._save_async(state)
            self.flush_checkpoints()

    def check_finisher(self, worker_id: str, session: bytes) -> None:
        """Raises SessionRefused, UnknownWorker, NotPermitted (not the worker that writes
        the final model) or WorkersNotDone unless `worker_id` may stop this shard now."""
        with self._changed:
            self.identities.check(worker_id, session)
            finisher = self.rules.finisher()
            if self.rules.rank_of(worker_id) != finisher:
                raise NotPermitted(f"Shutdown: {worker_id} is not the worker that ends the run (rank "
                                   f"{finisher} writes the final model and stops the shards)")
            if not self.rules.all_done():
                raise WorkersNotDone("workers are still training; shut down after every worker is done")

    # -- pushes and pulls -----------------------------------------------------------------

    def push(self, payload: Payload) -> Decision:
        """Validate and offer one push.

        Raises:
            SessionRefused, UnknownWorker: not the worker's session.
            InvalidPush: malformed payload (INVALID_ARGUMENT).
            PushRefused: a step from far ahead, or impossible version (FAILED_PRECONDITION).
        """
        if payload.header.incarnation not in (0, self.incarnation):
            return Decision(Outcome.ROLLED_BACK, self.version, 0)
        self._check_running()
        self.identities.check(payload.header.worker_id, payload.header.session)
        try:
            self.decoder.check_header(payload)
            if payload.header.shared_memory:
                payload = self.segments.read_push(payload, self.decoder.payload_nbytes(payload))
            elif self.segments:
                self.segments.of(payload.header.worker_id)
            gradient = self.decoder.decode(payload)
        except InvalidPush:
            with self._lock:
                self.num_invalid += 1
            raise
        h = payload.header
        push = Push(h.worker_id, h.step, h.base_version, float(h.num_samples), h.block_id, h.epoch,
                    h.last_in_epoch, h.generation, h.redo, h.sync_step, h.stand_in)
        with self._changed:
            self._check_running()  # again: the final checkpoint may have begun meanwhile
            mark = self.rules.mark()
            decision = self.rules.offer(push, gradient, self.clock())
            if not self._apply(decision):
                self.rules.rollback(mark)
                raise NonFiniteUpdate(f"applying this push would leave shard {self.plan.shard}'s parameters "
                                      "NaN or infinite; refused, nothing changed")
            if decision.outcome is Outcome.APPLIED and decision.apply:
                decision.learning_rate = self.shard_optimizer.rate_of(applied=True)
            elif decision.outcome is Outcome.BUFFERED:
                decision.learning_rate = self.shard_optimizer.rate_of(applied=False)
            if self.rules.bounds_steps:  # a clock moved on: a worker held by it may go on
                self._changed.notify_all()
        return decision

    def _check_running(self) -> None:  # a push after the final checkpoint began would be lost
        if self.stopping:
            raise ShardStopping(f"shard {self.plan.shard} is stopping; push again once it is back")

    def set_membership(self, generation: int, members: dict[str, int],
                       away: frozenset[str] = frozenset()) -> None:
        """The coordinator's membership (live worker ids -> the generation each joined in;
        `away`: the ids of workers reassigned): a worker that left no longer holds up a
        synchronous step, nor a reassigned one a barrier."""
        with self._changed:
            self._apply_or_void(self.rules.set_membership(generation, members, self.clock(), away))
            self.barriers.give_up_pending()  # who left will not come; who stayed may be behind
            self.barriers.excuse(self.rules.roster.reassigned)
            self._changed.notify_all()

    def ledger(self, first: int, end: int) -> list[int]:
        """Applied blocks with ids in [first, end) (end 0: no bound), ascending; sorted
        outside the lock, so a long ledger never holds up pushes."""
        with self._lock:
            blocks = self.rules.ledger.copy()
        return blocks.between(first, end)

    def _apply(self, decision: Decision) -> bool:
        """Apply a decision's gradients (lock held; the rules already advanced the version).
        False (counted; parameters and optimizer as they were) when the step would leave a
        parameter non-finite: a push rolls the rules back, other callers void the step."""
        if not decision.advanced:
            return True
        if decision.apply:
            self.shard_optimizer.set_rate()
            if not self.update.apply(decision.apply):
                self.num_refused_nonfinite += 1
                logger.warning("shard %d refused an update leaving NaN or infinite parameters",
                               self.plan.shard)
                self._changed.notify_all()
                return False
            self.shard_optimizer.applied()
        self._move_buffers(decision.apply)
        if self.broadcast is not None:
            self.broadcast.advance(self.param, self.rules.version)
        self._changed.notify_all()
        if self.checkpoints is not None and self.rules.version % self.checkpoints.every_versions == 0:
            self._save_async(self._state())
        self.on_version(self.rules.version)
        if self.rules.pending:  # pushes held over for the next step may complete it already
            self._apply_or_void(self.rules.next_step(self.clock()))
        return True

    def _move_buffers(self, contributions: list) -> None:
        """The buffer rule (see the module's docstring), once the update was applied."""
        for c in contributions:
            change = getattr(c.payload, "buffers", None)
            if change is not None:
                self.buffers.add_(change, alpha=c.weight)

    def _apply_or_void(self, decision: Decision) -> None:
        """Apply a step no push is waiting on the answer of; void it when refused."""
        if not self._apply(decision):
            self.rules.void(decision)

    def _reached(self, min_version: int, timeout_s: float | None) -> bool:
        """Wait (lock held) until the version reaches `min_version`; False on timeout or stop."""
        ready = self._changed.wait_for(lambda: self.rules.version >= min_version or self.stopping, timeout_s)
        return ready and not self.stopping

    def wait_for_version(self, min_version: int, timeout_s: float | None, holds: int = -1
                         ) -> list[bytes] | None:
        """The messages of the parameters once the version reaches `min_version`, or None
        on timeout or stop. Under pull compression, for a worker that holds version
        `holds` of the broadcast copy (-1: none), the changes from it when the copy kept
        them (see `BroadcastCopy.change_for`), else the copy dense."""
        with self._changed:
            if not self._reached(min_version, timeout_s):
                return None
            version, step, buffers = self.rules.version, self.rules.sync_step, None
            if self._snapshot is None or self._snapshot.version != version:
                buffers = self._buffer_message()
                stamp = service.ParameterStamp(version, self.incarnation, buffers, step, self.rules.restored)
                frames = service.parameter_frames(self.plan, stamp, tensor_bytes(self._served()))
                self._snapshot = Snapshot(version, list(frames))
            snapshot = self._snapshot
            if self.broadcast is None or holds in snapshot.changes:
                return snapshot.changes.get(holds, snapshot.frames)
            change = self.broadcast.change_for(holds, version)
            if change is None:
                return snapshot.frames
            # Kept for the next worker that holds the same version (in sync mode, all of them).
            stamp = service.ParameterStamp(version, self.incarnation,
                                           self._buffer_message() if buffers is None else buffers, step,
                                           self.rules.restored)
            snapshot.changes[holds] = list(service.parameter_frames(self.plan, stamp, memoryview(change),
                                                                    self.broadcast.changes.scheme))
            return snapshot.changes[holds]

    def write_parameters(self, worker_id: str, min_version: int, timeout_s: float | None) -> bytes | None:
        """Once the version reaches `min_version`, copy the parameters into the worker's
        parameter segment; return the notice that answers it (that version and its
        buffers), or None on timeout or stop.

        Raises:
            PushRefused: the worker has no segments here.
        """
        pair = self.segments.require(worker_id)
        with self._changed:
            if not self._reached(min_version, timeout_s):
                return None
            pair.parameter_tensor.copy_(self._served())
            return service.parameter_notice(self.plan, service.ParameterStamp(
                self.rules.version, self.incarnation, self._buffer_message(), self.rules.sync_step,
                self.rules.restored))

    def step_applied(self, worker_id: str, timeout_s: float | None) -> int | None:
        """Sync mode, after a push of `worker_id` joined the pending step: wait until that
        step is applied (at once when the push completed it); the version then, or None
        on timeout or stop. Its answer must be the step's result: a block redone in the
        meantime moves the version on, but not the step."""
        with self._changed:
            rank = self.rules.ranks.get(worker_id)
            applied = self._changed.wait_for(lambda: rank not in self.rules.pending or self.stopping,
                                             timeout_s)
            return self.rules.version if applied and not self.stopping else None

    def step_allowed(self, worker_id: str, step: int, epoch: int, timeout_s: float | None) -> bool | None:
        """SSP by steps, after `worker_id` pushed `step` of `epoch`: wait until it is no
        more than the bound ahead of the slowest worker that counts
        (`AggregationRules.may_go_on`), so that it computes nothing further meanwhile.
        True once it may go on (at once in every other mode), False on timeout, None on stop."""
        with self._changed:
            rank = self.rules.ranks.get(worker_id)
            if rank is None:  # not registered here (anymore): nothing to hold it by
                return True
            allowed = self._changed.wait_for(
                lambda: self.stopping or self.rules.may_go_on(rank, step, epoch), timeout_s)
            return None if self.stopping else allowed

    def holding_back(self, epoch: int) -> str:
        """Words for who a held push waits for: the slowest counted clock of `epoch`."""
        with self._lock:
            slowest = self.rules.slowest_clock(epoch)
            return f"the slowest worker is at step {slowest}, the bound is {self.rules.staleness_bound}"

    def _served(self) -> torch.Tensor:
        """The parameters as answers carry them (lock held): the broadcast copy under pull
        compression, else the parameters themselves."""
        return self.param.detach() if self.broadcast is None else self.broadcast.copy

    def broadcast_copy(self) -> torch.Tensor:
        """A copy of the parameters as workers hold them (the parameters without pull compression)."""
        with self._lock:
            return self._served().clone()

    def _buffer_message(self):
        """The buffers as they travel in a parameter answer (None: the shard holds none)."""
        return service.buffer_proto(self.buffers) if self.plan.buffers else None

    def buffer_values(self) -> torch.Tensor:
        """A copy of the current flat buffers (float64)."""
        with self._lock:
            return self.buffers.clone()

    def wait_all_done(self, timeout_s: float | None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.rules.all_done() or self.stopping, timeout_s) \
                and self.rules.all_done()

    def status(self) -> dict[str, Any]:
        """This shard's counters (the fields of `ShardStatus`)."""
        with self._lock:
            return {"shard": self.plan.shard, "num_shards": self.plan.num_shards,
                    "num_invalid": self.num_invalid, "num_refused_nonfinite": self.num_refused_nonfinite,
                    "incarnation": self.incarnation, **self.rules.status()}

    @property
    def version(self) -> int:
        with self._lock:
            return self.rules.version

    def parameters(self) -> torch.Tensor:
        """A copy of the current flat parameters."""
        with self._lock:
            return self.param.detach().clone()

    def stop(self) -> None:
        """Wake every waiter, write a final checkpoint, wait for pending writes."""
        with self._changed:
            if self.stopping:
                return
            self.stopping = True
            self._changed.notify_all()
            state = self._state() if self.checkpoints is not None else None
        self.segments.unlink_all()
        if state is not None:
            self._save_async(state)
        if self._writer is not None:
            self._writer.close()

    # -- persistence ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a restart needs (tensors are copies): see the module's docstring."""
        with self._lock:
            return self._state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what `state_dict` returned.

        Raises:
            CheckpointError: the state is of another shard, model or aggregation mode,
                does not fit this shard's optimizer, or lacks what every release writes
                (an earlier build's).
        """
        with self._changed:
            self._load(state)
            self._snapshot = None
            self._changed.notify_all()

    def restore(self, path: str | Path | None) -> None:
        """Load a checkpoint file written by this shard (a restart of it); None: it
        restarted before writing any, and comes back from the initial parameters (in sync
        mode it is then `restored` as well: the others may have gone on).

        Raises:
            CheckpointError: unreadable, or written by another shard layout or mode.
        """
        if path is None:
            with self._changed:
                self.rules.restart()
            logger.info("shard %d restarted before its first checkpoint: from the initial parameters",
                        self.plan.shard)
            return
        state = ckpt.load_checkpoint(path)
        ckpt.require_keys(state, REQUIRED_KEYS, path)
        try:
            self.load_state_dict(state)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint {path}: {e}") from e
        logger.info("shard %d restored version %d from %s", self.plan.shard, self.version, path)

    def _state(self) -> dict[str, Any]:
        """Everything a restart needs (lock held; tensors are copies)."""
        return {"strategy": STRATEGY, "shard": self.plan.shard, "num_shards": self.plan.num_shards,
                "numel": self.plan.numel, "version": self.rules.version,
                "params": self.param.detach().clone(), "buffers": self.buffers.clone(),
                **self.shard_optimizer.state_dict(),
                "rules": self.rules.state_dict(), "barriers": self.barriers.state_dict(),
                "identities": self.identities.state_dict(),
                "config": self.checkpoints.run_config if self.checkpoints is not None else {}}

    def _load(self, state: dict[str, Any]) -> None:
        """`load_state_dict` with the lock held."""
        if state["strategy"] != STRATEGY or state["shard"] != self.plan.shard \
                or state["numel"] != self.plan.numel:
            raise CheckpointError(f"it belongs to another shard or model (shard {state['shard']}, "
                                  f"{state['numel']} elements); use the checkpoint dir of this shard")
        lacking = [key for key in CURRENT_KEYS if key not in state] \
            + [f"rules.{key}" for key in CURRENT_RULES_KEYS if key not in state["rules"]]
        if lacking:
            raise CheckpointError(f"it lacks {', '.join(lacking)} (a checkpoint of an earlier disttrain); "
                                  "start a fresh run in another --checkpoint-dir")
        try:
            self.rules.load_state_dict(state["rules"])
            self.shard_optimizer.load_state_dict(state)
            self.barriers.load_state_dict(state["barriers"])
            self.identities.load_state_dict(state["identities"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"it does not fit this run: {e}") from e
        buffers = state["buffers"]
        if buffers.numel() != self.plan.buffer_numel:
            raise CheckpointError(f"it holds {buffers.numel()} buffer elements and this shard "
                                  f"{self.plan.buffer_numel}; use the checkpoint dir of this model")
        with torch.no_grad():
            self.param.copy_(state["params"])
            self.buffers.copy_(buffers)
        self.update.forget_bounds()
        if self.broadcast is not None:  # the workers register again and pull it dense
            self.broadcast.reset(self.param, self.rules.version)

    def _save_async(self, state: dict[str, Any]) -> None:
        """Queue a checkpoint (a newer one replaces one still waiting); raises CheckpointError
        when an earlier write failed."""
        self._writer.submit(state["version"], state)

    def flush_checkpoints(self) -> None:
        """Wait for the checkpoints queued (raises CheckpointError if a write failed)."""
        if self._writer is not None:
            self._writer.flush()
