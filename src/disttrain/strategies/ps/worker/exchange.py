"""How a worker trades gradients for parameters in each aggregation mode.

- `sync`: push to every shard and take back the parameters of the step the push joined;
  the step ends when the servers have applied it and the worker holds it.
- `async`: push, and take back the parameters as they are once the push is applied.
- `ssp`: like async, but a push the server rejects as too stale is recomputed on the
  parameters its reply brought and sent again to the shards that rejected it.

Each push and the parameters it leads to travel in one round trip per shard where the
payload allows (`PSClient.step`). Otherwise (`one_round_trip` off, or a shard too large
for one message across machines), sync pushes and, at the same time, long-polls for the
step's version; async and ssp pull the newest parameters into a staging buffer while
computing (prefetch), push, then switch to them; ssp uses them only when they are fresh
enough that the next gradient should stay within the bound, and pulls anew otherwise.

With overlap (sync mode, `ps.overlap`, the default), each shard's push, and the pull of
the parameters it leads to in the same round trip, leaves as soon as the backward pass
has produced that shard's whole gradient (`overlap.ShardTrigger`): the last layers'
shard goes out while backward still computes the first layers. A raw push that travels
in several gRPC pieces apart from its pull starts earlier still: its pieces stream last
first as backward writes them (`overlap.Written`), the shard taking the push once whole.
The step then waits only for what is still in flight (`time/comm_blocked_s`); what
travelled during backward is `time/comm_overlapped_s`. With an
`overlap_trial.OverlapTrial` (`ps.overlap_trial_steps`, the default), the first steps
run overlapped and plain pushes in ABBA pairs (more rounds of them while undecided, up to
a cap) and the worker keeps the overlap only on a clear win over the noise it saw,
logged: on saturated cores the overlap's CPU work slows backward more than it hides.

In sync mode (without backup workers) a worker computes every gradient on parameters
of one step on every shard (`agreement`): each answer carries the run's step it is the
result of, and when the shards' answers name different steps, the shards behind are
pulled again until they reach the highest, within `ps.rpc_timeout_s`; past it the step
fails with `StepsDisagree`, and nothing was computed on the mix. A worker that restarted
while a shard still waits for its push of the step it was in first tells that shard the
push will not come (`SyncExchange.stand_in`). A shard restored from an older checkpoint
is the one exception, by design: its answers say so (`restored`), and the step that
finds it is computed on what it came back with, whichever worker computes it. A step
ends once every shard applied it. Each step logs the step its gradient was computed on
and how far apart its shards were (`ps/sync_step`, `ps/step_spread`).

In every mode, a shard that did not take the gradient (a synchronous step that went on
without it, a server that restarted from an older checkpoint) gets it again, computed
on that shard's current parameters, so every block is applied (the servers' ledgers
keep it from being applied twice). With compression on, each mode compresses the
gradient before its push (off the communication phase, as `time/compression_s`) and
keeps the error-feedback residuals of the payloads the servers took. Every push carries
the change the step made to the model buffers its shard holds (`WorkerBuffers`), and
every reply the learning rate its shard applied the push with (`learning_rate`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, replace

import torch

from disttrain.compression import all_finite
from disttrain.core.errors import DistributedError, TrainingError
from disttrain.metrics.window import StepTimer
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.wire.payloads import GradientEncoder
from disttrain.strategies.ps.wire.service import buffer_proto
from disttrain.strategies.ps.worker.agreement import Agreement, lag
from disttrain.strategies.ps.worker.buffers import WorkerBuffers
from disttrain.strategies.ps.worker.client import PSClient
from disttrain.strategies.ps.worker.overlap import PushAbandoned, ShardTrigger, Written, overlapped_s
from disttrain.strategies.ps.worker.overlap_trial import OverlapTrial
from disttrain.training.engine import StepResult

logger = logging.getLogger(__name__)

Outcome = pb.PushReply.Outcome
STALE, LATE, ROLLED_BACK = Outcome.Value("STALE"), Outcome.Value("LATE"), Outcome.Value("ROLLED_BACK")
TAKEN = (Outcome.Value("APPLIED"), Outcome.Value("BUFFERED"))  # replies that tell a learning rate


@dataclass(frozen=True)
class Block:
    """The data a gradient was computed from, as the servers' ledgers know it."""

    step: int
    block_id: int
    epoch: int
    num_samples: int
    last_in_epoch: bool = False
    redo: bool = False
    # Per shard of the run, the push's step and the samples it stands for (None: `step`
    # and `num_samples` on every shard): Streaming DiLoCo's fragments count their rounds,
    # and end rounds of their own lengths together at an epoch's end.
    shard_steps: tuple[int, ...] | None = None
    shard_samples: tuple[int, ...] | None = None

    def step_of(self, shard: int) -> int:
        return self.step if self.shard_steps is None else self.shard_steps[shard]

    def samples_of(self, shard: int) -> int:
        return self.num_samples if self.shard_samples is None else self.shard_samples[shard]


@dataclass(frozen=True)
class WorkerTensors:
    """What a worker's exchange reads and writes: the flat parameters it holds (`flat`), the
    flat gradient it pushes (`grads`), and the model's buffers (None: pushes carry none; the
    shards must hold none)."""

    flat: torch.Tensor
    grads: torch.Tensor
    buffers: WorkerBuffers | None = None


@dataclass(frozen=True)
class ExchangeRules:
    """How a worker's pushes are taken.

    Args:
        mode: the aggregation mode, "sync", "async" or "ssp".
        staleness_bound: ssp's bound (`ps.staleness`).
        generation: the membership generation this worker joined in (0: no coordinator).
        retry_late: push a gradient a synchronous step went on without again (off with
            backup workers, which drop the slowest gradients by design).
    """

    mode: str = "sync"
    staleness_bound: int = 0
    generation: int = 0
    retry_late: bool = True


@dataclass(frozen=True)
class SyncOptions:
    """What only a synchronous exchange uses.

    Args:
        overlap: the worker's model, to push each shard's gradient as backward produces it
            (None: after backward).
        overlap_trial_steps: > 0: overlap only where the first steps measured it faster,
            timed that many per side a round, more rounds while undecided (`OverlapTrial`).
        agree_timeout_s: how long the worker waits for its shards to reach one step (None:
            one RPC deadline).
        groups: Streaming DiLoCo's fragments, each a group of whole shards
            (`local_rounds.shard_groups`) whose steps go on apart from the other groups'
            (None: the shards step together).
    """

    overlap: torch.nn.Module | None = None
    overlap_trial_steps: int = 0
    agree_timeout_s: float | None = None
    groups: list[list[int]] | None = None


class Exchange:
    """Shared state of every mode: the versions this worker holds, per shard. Each mode is
    a subclass, complete once constructed (`make_exchange` picks it by the mode)."""

    def __init__(self, client: PSClient, worker_id: str, tensors: WorkerTensors, rules: ExchangeRules,
                 encoder: GradientEncoder | None = None):
        self.client = client
        self.buffers = tensors.buffers
        self.encoder = encoder
        self.worker_id = worker_id
        self.flat = tensors.flat
        self.grads = tensors.grads
        self.generation = rules.generation
        self.num_shards = len(client.shards)
        self.versions = [0] * self.num_shards
        self.num_rejected = 0
        self.from_step = 0  # sync: the run's step the pushes of the step in progress start from
        # blocks a synchronous step went on without (backup workers; none in other modes)
        self.dropped: set[int] = set()
        # The rate shard 0 applied this worker's latest gradient it took with (None: none yet).
        # In sync mode every shard applies the step's; in async and ssp each counts its own
        # updates, so another shard's may be one schedule step apart.
        self.learning_rate: float | None = None

    def start(self) -> None:
        """Pull the initial parameters."""
        self.versions = self.client.pull(self.worker_id, self.flat, [0] * self.num_shards)

    def refresh(self) -> None:
        """Hold the servers' newest parameters (before an evaluation)."""
        self.versions = self.client.pull(self.worker_id, self.flat, self.versions)

    def pull_current(self, shards: list[int]) -> None:
        """Hold the current parameters of `shards` (whatever their version)."""
        self.versions = self.client.pull(self.worker_id, self.flat,
                                         [0 if s in shards else v for s, v in enumerate(self.versions)],
                                         shards)

    def prepare(self, block: Block, shards: list[int], timer: StepTimer, then_pull: list[int] | None = None
                ) -> Callable[[], list[pb.PushReply]] | Callable[[], tuple[list[pb.PushReply], list]]:
        """The push of the gradient now in `grads` to `shards`, compressed first where the run
        compresses; call the result to send it. With `then_pull` (a min version per shard
        of the run), the call also brings the parameters each push leads to into `flat`
        (`PSClient.step`) and returns the replies with the versions.

        Raises:
            TrainingError: the gradient holds NaN or infinity. It is checked whole before
                any shard gets a byte, so a push is applied on every shard or on none.
        """
        headers, payloads = self.outgoing(block, shards, timer, self.grads)

        def send():
            if then_pull is None:
                replies = self.client.push(headers, self.grads, shards, payloads)
                self.settle(shards, payloads, replies)
                return replies
            replies, versions = self.client.step(headers, self.grads, shards, self.flat, then_pull, payloads)
            self.settle(shards, payloads, replies, versions)
            return replies, versions

        return send

    def outgoing(self, block: Block, shards: list[int], timer: StepTimer, checked: torch.Tensor,
                 sent: list[int] = ()) -> tuple[list[pb.GradientMessage], list | None]:
        """The headers of a push of the gradient now in `grads` to `shards`, and its
        compressed payloads (None: the run sends raw values).

        Raises:
            TrainingError: `checked` (the gradient, or the part of it these shards hold)
                holds NaN or infinity; no shard but those in `sent` was sent any of it.
        """
        self.check_finite(block, checked, sent)
        headers = self.headers(block, shards)
        payloads = None
        if self.encoder is not None:
            with timer.phase("compression"):
                payloads = self.encoder.encode(self.grads, shards)
            for header in headers:
                header.compressed, header.compression_type = True, self.encoder.scheme
        return headers, payloads

    def headers(self, block: Block, shards: list[int]) -> list[pb.GradientMessage]:
        """The headers of a push of `block`'s gradient to `shards` (uncompressed), each with
        the change the step made to the shard's buffers."""
        headers = [pb.GradientMessage(worker_id=self.worker_id, step=block.step_of(s), shard=s,
                                      base_version=self.versions[s], block_id=block.block_id,
                                      num_samples=block.samples_of(s),
                                      generation=self.generation, epoch=block.epoch,
                                      last_in_epoch=block.last_in_epoch, redo=block.redo,
                                      sync_step=self.from_step)
                   for s in shards]
        if self.buffers is not None:
            for header in headers:
                change = self.buffers.change(header.shard)
                if change is not None:
                    header.buffers.CopyFrom(change)
        return headers

    @staticmethod
    def check_finite(block: Block, checked: torch.Tensor, sent: list[int] = ()) -> None:
        """Raises TrainingError when `checked` (a gradient, or part of it) holds NaN or
        infinity; `sent` names the shards that were sent their part already."""
        if not all_finite(checked):
            sent_to = f"shard(s) {sorted(sent)} were sent their part before it was found, no other shard " \
                if sent else "no shard was sent any of it"
            raise TrainingError(f"the gradient of step {block.step} holds NaN or infinity, so {sent_to}: "
                                "training diverged; lower the learning rate or check the data")

    def settle(self, shards: list[int], payloads: list | None, replies: list[pb.PushReply],
               versions: list[int | None] | None = None) -> None:
        """After the replies of a push to `shards` came (on the training thread): keep the
        versions the parameters now in `flat` have (None: untouched), the error-feedback
        residuals of the payloads taken, and shard 0's learning rate."""
        if versions is not None:
            self.versions = [held if got is None else got
                             for held, got in zip(self.versions, versions, strict=True)]
        if payloads is not None:
            self.encoder.commit(payloads, replies)
        self._note_rate(shards, replies)

    def redo(self, compute: Callable[[], StepResult], block: Block, shards: list[int], timer: StepTimer
             ) -> None:
        """Apply a block missing from `shards` (found after a failure), on their current parameters."""
        self.pull_current(list(range(self.num_shards)))
        compute()
        self.prepare(block, shards, timer)()
        self.pull_current(shards)

    def _note_rate(self, shards: list[int], replies: list[pb.PushReply]) -> None:
        for shard, reply in zip(shards, replies, strict=True):
            if shard == 0 and reply.outcome in TAKEN:
                self.learning_rate = reply.learning_rate

    @staticmethod
    def _untaken(shards: list[int], replies: list[pb.PushReply], outcomes: tuple[int, ...]) -> list[int]:
        return [s for s, r in zip(shards, replies, strict=True) if r.outcome in outcomes]

    def step(self, compute: Callable[[], StepResult], block: Block, timer: StepTimer,
             shards: Sequence[int] | None = None) -> tuple[StepResult, int]:
        """Compute one gradient and trade it with `shards` (None: every shard; a subset:
        sync mode only, see `SyncExchange.groups`). Returns the step's result and its
        staleness."""
        raise NotImplementedError

    def scalars(self) -> dict[str, float]:
        """The mode's own metrics of the last step."""
        return {}


class SyncExchange(Exchange):
    """Sync mode's step. With a `trigger` (overlap on), the first push of each step goes
    out shard by shard while backward still computes (`overlap.ShardTrigger`); a shard
    that did not take it gets it again as without overlap, after backward. With an
    `agreement` (no backup workers), every gradient is computed on one step of every
    shard (see the module's docstring).

    Args:
        client, worker_id, tensors, encoder: as every mode's (`Exchange`).
        rules: `retry_late` off (backup workers) drops a gradient its step went on
            without, and lets the shards' steps part (no agreement).
        sync: overlap, its trial, the agreement's deadline and Streaming DiLoCo's groups.
    """

    def __init__(self, client: PSClient, worker_id: str, tensors: WorkerTensors,
                 rules: ExchangeRules = ExchangeRules(), encoder: GradientEncoder | None = None,
                 sync: SyncOptions = SyncOptions()):
        super().__init__(client, worker_id, tensors, rules, encoder)
        self.retry_late = rules.retry_late
        self.trigger = None if sync.overlap is None else ShardTrigger(sync.overlap, client.plans)
        # with a trigger: overlap only where it measured faster
        self.trial = OverlapTrial(sync.overlap_trial_steps) \
            if self.trigger is not None and sync.overlap_trial_steps > 0 else None
        # Backup workers let the shards' steps part by design.
        self.agreement = Agreement(sync.agree_timeout_s or client.shards[0].policy.timeout_s) \
            if rules.retry_late else None
        # Streaming DiLoCo: the shards of each fragment, whose steps go on apart from the
        # other fragments' (a fragment's push goes to its shards alone): the steps must agree
        # within each group, and do across groups after a push to every shard (an epoch's end).
        self.groups = sync.groups
        self.trained_on = (0, 0)  # the lowest and highest step of the last gradient's shards
        self._started = False  # `start` pulled; the first step has not begun

    def sync_steps(self) -> list[int]:
        """Per shard, the run's step of the parameters held."""
        return [shard.sync_step for shard in self.client.shards]

    def restored(self) -> list[int]:
        """The shards whose parameters held were answered as restored (see `agreement`)."""
        return [s for s, shard in enumerate(self.client.shards) if shard.restored]

    def start(self) -> None:
        """Pull the initial parameters; the first step makes them of one step on every
        shard before it computes (see `catch_up`)."""
        super().start()
        self._started = True

    def catch_up(self, block: Block, timer: StepTimer) -> None:
        """Before the first step after `start`: when a shard is a step behind the others
        (and not restored: see `agreement`), this worker (restarted) may be what it waits
        for, its push of the step it was in lost with it. It stands in for that step on
        each such shard (`stand_in`), which then applies the step without it (its block
        stays missing there, to be redone like any block a failure lost), and waits for
        every shard to reach one step."""
        from_start, self._started = self._started, False
        if not from_start or self.agreement is None or block.redo:
            return
        steps, restored, behind = self.sync_steps(), set(self.restored()), []
        for group in self._groups():  # a step behind the others of its group (`groups`)
            within = lag([steps[s] for s in group], [self.versions[s] for s in group],
                         [k for k, s in enumerate(group) if s in restored])
            behind += [group[k] for k in within.wait_for]
        behind.sort()
        if behind:
            logger.warning("shard(s) %s are a step behind the others after this worker started; standing in "
                           "for the step they wait for, and waiting for them", behind)
            with timer.phase("comm_blocked"):
                self.stand_in(block, behind)
                self.agree()

    def stand_in(self, block: Block, shards: list[int]) -> list[pb.PushReply]:
        """Tell `shards` that this worker's push of the step they wait for will not come
        (`GradientMessage.stand_in`, named by the step before `block`'s, or the first): it changes
        nothing on a shard that holds this worker's push of its pending step, and counts
        for this worker, with no samples, on a shard that waits for it (named by the
        step the shard holds: the one its pending step is computed on). The payload is
        zeros, never applied (compressed without keeping its residuals)."""
        zeros = torch.zeros_like(self.grads)
        headers = [pb.GradientMessage(worker_id=self.worker_id, step=max(block.step_of(s) - 1, 1), shard=s,
                                      base_version=self.versions[s], block_id=-1, num_samples=1,
                                      generation=self.generation, epoch=block.epoch,
                                      sync_step=self.client.shards[s].sync_step, stand_in=True)
                   for s in shards]
        for header in headers:
            plan = self.client.plans[header.shard]
            if plan.buffers:
                header.buffers.CopyFrom(buffer_proto(torch.zeros(plan.buffer_numel, dtype=torch.float64)))
        payloads = None
        if self.encoder is not None:
            payloads = self.encoder.encode(zeros, shards)  # not committed: the residuals stay as they were
            for header in headers:
                header.compressed, header.compression_type = True, self.encoder.scheme
        return self.client.push(headers, zeros, shards, payloads)

    def agree(self, now: Callable[[], float] = time.monotonic, floor: int = 0, pushing: Sequence[int] = (),
              only: Sequence[int] | None = None) -> None:
        """Pull the shards whose parameters are of an earlier step than another's (or than
        `floor`) again, until every shard's are of one step, but those restored (see
        `agreement`) and those this worker is about to push to again (`pushing`: they may
        wait for that very push); nothing without an agreement. With `groups`, within each
        group; `only`: among those shards alone.

        Raises:
            StepsDisagree: they are not within the agreement's deadline (a shard that
                cannot be reached as long counts as not).
        """
        if self.agreement is None:
            return
        for group in self._groups() if only is None else [list(only)]:
            self._agree_within(group, now, floor, pushing)

    def _groups(self) -> list[list[int]]:
        return self.groups or [list(range(self.num_shards))]

    def _agree_within(self, group: list[int], now: Callable[[], float], floor: int, pushing: Sequence[int]
                      ) -> None:
        """`agree` among the shards of `group` alone."""
        while True:
            steps, restored, started = self.sync_steps(), set(self.restored()) | set(pushing), now()
            steps, versions = [steps[s] for s in group], [self.versions[s] for s in group]
            local = [k for k, s in enumerate(group) if s in restored]
            behind = self.agreement.check(steps, versions, started, local, floor, group)
            if not behind.wait_for:
                return
            wait_for = {group[k]: v for k, v in behind.wait_for.items()}
            remaining = self.agreement.remaining_s(started)
            wanted = [wait_for.get(s, v) for s, v in enumerate(self.versions)]
            policy = replace(self.client.shards[0].policy, timeout_s=max(remaining, 0.05),
                             max_total_s=remaining)
            try:
                self.versions = self.client.pull(self.worker_id, self.flat, wanted, sorted(wait_for), policy)
            except DistributedError as e:  # the shard did not answer that version within the deadline
                raise self.agreement.failure(steps, versions, str(e), local, floor, group) from e

    def scalars(self) -> dict[str, float]:
        if self.agreement is None:
            return {}
        lowest, highest = self.trained_on
        return {"ps/sync_step": lowest, "ps/step_spread": highest - lowest}

    def _noting(self, compute: Callable[[], StepResult], shards: Sequence[int]) -> Callable[[], StepResult]:
        """`compute`, noting the steps of the parameters of `shards` it computes on: the
        lowest, and the lowest plus the widest spread within a group (the groups' steps
        part by design, see `groups`)."""
        def noted() -> StepResult:
            steps = self.sync_steps()
            spread = max(max(steps[s] for s in group) - min(steps[s] for s in group)
                         for group in self._groups() if set(group) & set(shards))
            lowest = min(steps[s] for s in shards)
            self.trained_on = (lowest, lowest + spread)
            return compute()

        return noted

    def step(self, compute, block, timer, shards=None):
        overlap = self.trigger is not None and shards is None
        if not overlap or self.trial is None:
            return self._step(compute, block, timer, shards, overlap)
        overlap = self.trial.overlaps()
        started = time.perf_counter()
        answer = self._step(compute, block, timer, shards, overlap)
        if self.trial.record(overlap, time.perf_counter() - started):
            logger.info("%s", self.trial.describe())
        return answer

    def _step(self, compute, block, timer, shards, overlap: bool):
        """`step`, its first push overlapped with backward or not."""
        group = None if shards is None else list(shards)
        shards, staleness = list(range(self.num_shards)) if group is None else group, 0
        compute = self._noting(compute, shards)
        self.catch_up(block, timer)
        # Every push of this step names the step it starts from, a shard restored from an
        # older checkpoint too, so that it counts on from there (see `server.aggregation`).
        self.from_step = max(self.sync_steps())
        taken = False  # a shard took this step's push: the step is under way
        while True:
            wanted = [v + 1 for v in self.versions]
            if overlap:
                result, replies, versions = self.overlapped(compute, block, timer, wanted)
                overlap = False
            else:
                result = compute()
                replies, versions = self.trade(block, shards, timer, wanted)
            staleness = max([staleness] + [r.staleness for r in replies])
            outcomes = (LATE, ROLLED_BACK) if self.retry_late else (ROLLED_BACK,)
            if not self.retry_late and any(r.outcome == LATE for r in replies):
                self.dropped.add(block.block_id)  # a backup worker's gradient, dropped by design
            behind = {s for s in shards if versions[s] < wanted[s]}  # the server restarted
            again = set(self._untaken(shards, replies, outcomes)) | behind
            if not again:
                with timer.phase("comm_blocked"):
                    self.agree(floor=self.from_step + 1, only=group)  # the next gradient is computed on these
                return result, staleness
            self.num_rejected += len(again)
            taken = taken or len(again) < len(shards)
            restarted = sorted(set(self._untaken(shards, replies, (ROLLED_BACK,))) | behind)
            shards = sorted(again)
            with timer.phase("comm_blocked"):
                self.pull_current(shards)
                if not taken:
                    # No shard took it (the step went on without this worker everywhere: a
                    # worker that finished its epoch while a restarted one caught up): the
                    # step starts again from what the shards hold now, named by their step.
                    self.agree(pushing=restarted, only=group)
                    self.from_step = max(self.sync_steps())
                    continue
                # A shard that did not take the push was restored (it says so: no wait for
                # the steps it lost), or is still in the step, waiting for this very push
                # (restored, it went on without this worker, restarted then): either way its
                # part is computed on what it holds now.
                self.agree(pushing=shards, only=group)

    def trade(self, block: Block, shards: list[int], timer: StepTimer, wanted: list[int]
              ) -> tuple[list[pb.PushReply], list[int]]:
        """Push the gradient now in `grads` to `shards` and take the step's parameters
        back, after backward; the replies and the versions held."""
        timer.add("comm_overlapped", 0.0)
        if self.client.one_round_trip:
            trade = self.prepare(block, shards, timer, then_pull=wanted)
            with timer.phase("comm_blocked"):
                replies, _ = trade()
            return replies, self.versions
        # a push and, at the same time, a pull waiting for the step
        push = self.prepare(block, shards, timer)
        with timer.phase("comm_blocked"):
            replies, versions = self.client.gather([
                push, lambda: self.client.pull(self.worker_id, self.flat, wanted, shards)])
        self.versions = versions
        return replies, versions

    def overlapped(self, compute: Callable[[], StepResult], block: Block, timer: StepTimer,
                   wanted: list[int]) -> tuple[StepResult, list[pb.PushReply], list[int]]:
        """Compute the gradient and trade each shard's part of it (`PSClient.step`) as soon
        as backward has produced it; the result, the replies in shard order and the
        versions held once every trade came back.

        Raises:
            TrainingError: a shard's part of the gradient holds NaN or infinity. Each part
                is checked before it goes, so that shard and those after it were sent none
                of it; shards launched before it during backward may have taken theirs (a
                diverged run stops: training cannot go on; on a resume, the data ledger
                redoes the block on the shards that lack it).
        """
        launched: dict[int, tuple[Future, list | None]] = {}
        written: dict[int, Written] = {}  # the pushes streamed as backward writes them
        size = self.grads.element_size()
        streamed = set() if self.encoder is not None else \
            {s for s in range(self.num_shards) if self.client.streams(s)}

        def begin() -> None:  # before the first push's headers, which carry the buffers' change
            if not launched and self.buffers is not None:
                self.buffers.finish()  # the forward pass is over: its change to the buffers is known

        def send(shard: int, headers: list[pb.GradientMessage], payloads: list | None) -> None:
            started = time.perf_counter()
            stream = written.get(shard)

            def trade():
                if stream is None:
                    answer = self.client.step(headers, self.grads, [shard], self.flat, wanted, payloads)
                else:
                    answer = self.client.step_streamed(headers[0], self.grads, shard, self.flat, wanted,
                                                       stream)
                return answer, (started, time.perf_counter())

            launched[shard] = (self.client.submit(trade), payloads)

        def progress(shard: int, start: int) -> None:
            if shard not in written:
                if shard not in streamed:
                    return
                begin()
                written[shard] = Written(self.client.plans[shard].numel * size)
                send(shard, self.headers(block, [shard]), None)
            written[shard].advance(start * size)

        def whole() -> list[int]:  # the shards sent their whole part: a streamed one once released
            return [s for s in launched if s not in written or written[s].released]

        def launch(shard: int) -> None:
            plan = self.client.plans[shard]
            part = self.grads[plan.offset:plan.offset + plan.numel]
            if shard in written:  # streaming already: its first piece goes once the whole is checked
                self.check_finite(block, part, whole())
                written[shard].release()
                return
            begin()
            headers, payloads = self.outgoing(block, [shard], timer, part, whole())
            send(shard, headers, payloads)

        self.trigger.arm(launch, progress if streamed else None)  # no bookkeeping where none streams
        try:
            result = compute()
            rest = self.trigger.disarm()
            for shard in rest:  # checked before any of them goes (a shard taking no gradient is rare)
                plan = self.client.plans[shard]
                self.check_finite(block, self.grads[plan.offset:plan.offset + plan.numel], whole())
            for shard in rest:
                launch(shard)
        except BaseException:
            self.trigger.disarm()
            for stream in written.values():
                stream.abort(PushAbandoned("the step failed while this push was under way"))
            wait([f for f, _ in launched.values()])  # nothing left writing into `flat`
            raise
        computed = time.perf_counter()
        with timer.phase("comm_blocked"):
            futures = [launched[s][0] for s in range(self.num_shards)]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    raise f.exception()
        answers = [f.result() for f in futures]
        timer.add("comm_overlapped", overlapped_s([interval for _, interval in answers], computed))
        replies = [answer[0][0] for answer, _ in answers]
        versions: list[int | None] = [answer[1][s] for s, (answer, _) in enumerate(answers)]
        payloads = None if self.encoder is None else [launched[s][1][0] for s in range(self.num_shards)]
        self.settle(list(range(self.num_shards)), payloads, replies, versions)
        return result, replies, self.versions

    def redo(self, compute: Callable[[], StepResult], block: Block, shards: list[int], timer: StepTimer
             ) -> None:
        """Redo a block as every mode does (on the current parameters: a failure's own
        rule), then hold one step of every shard again for the next gradient (the others
        may have been mid-step when the current parameters were pulled)."""
        super().redo(compute, block, shards, timer)
        self.agree()

    def refresh(self) -> None:
        """The parameters pulled at the end of each step are already the servers' newest."""


class AsyncExchange(Exchange):
    """Async mode's step: every push is applied on arrival; the parameters are prefetched
    while computing (or brought back by each push's round trip) and used as they come."""

    def __init__(self, client: PSClient, worker_id: str, tensors: WorkerTensors,
                 rules: ExchangeRules = ExchangeRules(mode="async"), encoder: GradientEncoder | None = None):
        super().__init__(client, worker_id, tensors, rules, encoder)
        self.staged = torch.empty_like(self.flat)
        self.prefetched_in: tuple[float, float] | None = None  # (started, done) of the last prefetch

    def prefetch(self) -> Future:
        current, started = list(self.versions), time.perf_counter()

        def pull() -> list[int]:
            versions = self.client.pull(self.worker_id, self.staged, current)
            self.prefetched_in = (started, time.perf_counter())
            return versions

        self.prefetched_in = None
        return self.client.submit(pull)

    def use_prefetched(self, fetched: Future) -> None:
        self.versions = fetched.result()
        self.flat.copy_(self.staged)

    def push_until_taken(self, compute, block, timer, fetched: Future | None
                         ) -> tuple[StepResult, int, Future | None, list[int], list[pb.PushReply]]:
        """Push to every shard, recomputing for shards that refused the gradient as too
        stale or restarted, until all took it. Returns the result, the staleness, the
        prefetch (None once pulls went over it), and the last shards pushed and replies."""
        shards, staleness = list(range(self.num_shards)), 0
        while True:
            result = compute()
            push = self.prepare(block, shards, timer)
            with timer.phase("comm_blocked"):
                replies = push()
            staleness = max([staleness] + [r.staleness for r in replies if r.outcome != STALE])
            again = self._untaken(shards, replies, (STALE, ROLLED_BACK))
            if not again:
                return result, staleness, fetched, shards, replies
            self.num_rejected += len(again)
            with timer.phase("comm_blocked"):
                if fetched is not None:
                    fetched.result()  # let the prefetch finish before pulling over it
                self.pull_current(again)
            fetched, shards = None, again

    def step(self, compute, block, timer, shards=None):
        assert shards is None, "a push to some shards only is sync mode's (Streaming DiLoCo)"
        if self.client.one_round_trip:
            timer.add("comm_overlapped", 0.0)  # every push and pull goes after the computation
            return self.trade_until_taken(compute, block, timer)
        computed: list[float] = []

        def timed() -> StepResult:
            result = compute()
            computed.append(time.perf_counter())
            return result

        answer = self.prefetching_step(timed, block, timer)
        # The prefetch is waited for (or went over) by now: its interval is known.
        interval = self.prefetched_in
        timer.add("comm_overlapped", overlapped_s([interval], computed[0]) if interval else 0.0)
        return answer

    def trade_until_taken(self, compute, block, timer) -> tuple[StepResult, int]:
        """Compute, then push and take the parameters back in one call per shard; again for
        the shards that refused the gradient as too stale (their reply brought the
        parameters to recompute on) or restarted, until all took it."""
        shards, staleness = list(range(self.num_shards)), 0
        while True:
            result = compute()
            trade = self.prepare(block, shards, timer, then_pull=[0] * self.num_shards)
            with timer.phase("comm_blocked"):
                replies, versions = trade()
            staleness = max([staleness] + [r.staleness for r in replies if r.outcome != STALE])
            again = self._untaken(shards, replies, (STALE, ROLLED_BACK))
            if not again:
                return result, staleness
            self.num_rejected += len(again)
            missing = [s for s in again if versions[s] is None]  # restarted: no parameters came
            if missing:
                with timer.phase("comm_blocked"):
                    self.pull_current(missing)
            shards = again

    def prefetching_step(self, compute, block, timer) -> tuple[StepResult, int]:
        """Pull while computing, push, then switch to the prefetched parameters where they
        are `fresh_enough` (or pull the newest)."""
        fetched = self.prefetch()
        result, staleness, fetched, shards, replies = self.push_until_taken(compute, block, timer, fetched)
        with timer.phase("comm_blocked"):
            if fetched is not None and self.fresh_enough(fetched.result(), shards, replies):
                self.use_prefetched(fetched)
            else:
                self.refresh()
        return result, staleness

    def fresh_enough(self, prefetched: list[int], shards: list[int], replies: list[pb.PushReply]) -> bool:
        """Whether the next gradient may be computed on the parameters prefetched (of
        versions `prefetched`), given the replies of the last push to `shards`: always in
        async mode."""
        return True


class SSPExchange(AsyncExchange):
    """SSP's step (`ps.ssp_clock` versions or steps, as the servers count it): async's,
    but the prefetched parameters are taken only when the next gradient computed on them
    should stay within the staleness bound, and a push refused as too stale is
    recomputed (`push_until_taken`)."""

    def __init__(self, client: PSClient, worker_id: str, tensors: WorkerTensors,
                 rules: ExchangeRules = ExchangeRules(mode="ssp"), encoder: GradientEncoder | None = None):
        super().__init__(client, worker_id, tensors, rules, encoder)
        self.staleness_bound = rules.staleness_bound

    def fresh_enough(self, prefetched: list[int], shards: list[int], replies: list[pb.PushReply]) -> bool:
        acked = {s: r.version for s, r in zip(shards, replies, strict=True)}
        # The next gradient is computed on these parameters; each later update adds one.
        lag = max(acked.get(s, v) - v for s, v in enumerate(prefetched))
        return lag < self.staleness_bound


def make_exchange(client: PSClient, worker_id: str, tensors: WorkerTensors,
                  rules: ExchangeRules = ExchangeRules(), encoder: GradientEncoder | None = None,
                  sync: SyncOptions = SyncOptions()) -> Exchange:
    """The exchange of `rules.mode`, complete; `encoder` compresses each push (None: raw
    values); `sync`'s options apply in sync mode alone.

    Raises:
        ValueError: an unknown mode.
    """
    modes: dict[str, Callable[[], Exchange]] = {
        "sync": lambda: SyncExchange(client, worker_id, tensors, rules, encoder, sync),
        "async": lambda: AsyncExchange(client, worker_id, tensors, rules, encoder),
        "ssp": lambda: SSPExchange(client, worker_id, tensors, rules, encoder),
    }
    if rules.mode not in modes:
        raise ValueError(f"unknown aggregation mode {rules.mode!r}")
    return modes[rules.mode]()
