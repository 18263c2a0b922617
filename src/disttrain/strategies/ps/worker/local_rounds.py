"""Local-update training on a parameter-server worker: its rounds, apart from the wire.

In this mode (`training.sync_every` H > 1, or `training.local_updates`) a worker takes H
steps with its own inner optimizer (`training.optimizer`, its schedule and clipping) on
its own copy of the model, pushing and pulling nothing. At a round's end (H steps, or
the epoch's last) it pushes the pseudo-gradient, the round-start parameters minus its
current ones, through the ordinary push path (so compression applies to it), as one
push that stands for the round's samples: sync aggregation averages the workers'
pseudo-gradients by their samples, and each shard applies the OUTER optimizer
(`server.optimizer.outer_training`) to the round-start parameters it holds. The worker
pulls the result and opens its next round there; its inner optimizer state stays its own.

A round's push is named by the round (its `step` is the round's number, 1 on), and
carries the block of the round's last batch: the servers' ledgers hold one block per
round, which stands for every batch of that round (`round_end`). A worker lost mid-round
redoes the round from its checkpoint (nothing of it was applied).

A *redone* round is one a shard lost after applying it (it came back from an older
checkpoint), or one of a worker given up on (reassigned), found missing from a ledger at
an epoch's end. A worker trains the round's batches again as inner steps from the
parameters of the moment, with its inner optimizer as it stands then (`redo`), and
pushes the pseudo-gradient as a redo of the round's block (its last batch's) to the
shards that lack it, standing for the round's samples: each shard applies it on arrival
with its outer optimizer, as a lost block is redone without local updates. It is an
extra push beside the worker's own rounds, which it leaves as they were (`aside`): their
inner optimizer state, schedule, round-start copy and place in the round.

The model's buffers (BatchNorm statistics) are taken from the servers at a round's start
and the round's change to them goes with its push.

The overlapped push during backward (`ps.overlap`) is off in this mode: a push leaves
once per round, after the round's last inner step, not during a backward pass.

Streaming DiLoCo (`training.outer_fragments` F > 1, `outer_mixing`; see
`training.fragments`, whose `StreamingRounds` keeps the rounds here for any F): each
fragment is a group of whole shards (`shard_groups`: the shards in order, cut into F
groups of about equal bytes; F <= the servers), so a fragment's push goes to its shards
alone and carries its bytes alone, and its shards' outer optimizer is the fragment's own
(its momentum, its count of rounds as their version). Fragment f ends its rounds at its
own staggered steps; a push names the block of the step that ends it, which the ledgers
of its shards hold for the batches of that round (`round_end` with the fragment's
offset). An epoch's last step ends every fragment's round: one push to every shard, each
carrying its fragment's pseudo-gradient and samples. After a fragment's push the worker
pulls its shards (the outer result) and, with mixing, keeps `outer_mixing` of its own
values (`StreamingRounds.take_outer`). A push to a shard is numbered by its fragment's round.

With a delay tau (`training.outer_delay`) a fragment's push inside an epoch leaves on a
thread of its own (`send`) and the worker trains on: the exchange's push and pull run there
on buffers of their own (the pseudo-gradient's copy, and the parameters pulled), so the
inner steps meanwhile touch none of them. Tau steps later the pulled result is waited for
and taken (`land`): the fragment's next round starts from it, counted from its sync step,
and its parameters, moved on meanwhile, are mixed with it by `outer_mixing` (with none they
take it). One push is under way at a time (pushes of two fragments due within tau steps go
one after the other), and the training thread uses the exchange only once every push in
flight has landed: an epoch's last step lands them all, then pushes every fragment without
delay. A checkpoint meanwhile waits for the pushes in flight and keeps each fragment's
result and the steps it has left (`StreamingRounds.state_dict`), so a resumed worker takes
it at the same step; its `last_block` is the push's, which the shards hold.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from disttrain.config import TrainingConfig
from disttrain.strategies.ps.wire.sharding import trainable_parameters
from disttrain.training.engine import StepResult, build_optimizer
from disttrain.training.fragments import Fragment, StreamingRounds
from disttrain.training.local_updates import LocalUpdates
from disttrain.training.stepping import OptimizerStep

if TYPE_CHECKING:
    from disttrain.strategies.ps.worker.exchange import Exchange

logger = logging.getLogger(__name__)


def round_end(index: int, batches_per_epoch: int, sync_every: int, offset: int = 0) -> int:
    """The index of the last batch of the round that holds batch `index` of an epoch
    (rounds start at each epoch's first batch and end where `(index + 1 - offset)` is a
    multiple of H (`offset`: a fragment's, see `training.fragments`), and the epoch's last
    batch ends one)."""
    return min(batches_per_epoch - 1, index + (offset - index - 1) % sync_every)


def round_start(index: int, sync_every: int, offset: int = 0) -> int:
    """The index of the first batch of the round that holds batch `index` of an epoch."""
    return max(0, index - (index - offset) % sync_every)


def shard_groups(numels: Sequence[int], num_groups: int) -> list[list[int]]:
    """Shards of `numels` elements, in order, cut into `num_groups` contiguous groups of
    about equal elements (each cut at the shard boundary nearest k/num_groups of them).

    Raises:
        ValueError: more groups than shards.
    """
    if not 1 <= num_groups <= len(numels):
        raise ValueError(f"{num_groups} fragment(s) of {len(numels)} shard(s): each fragment is a group of "
                         f"whole shards; use ps.num_servers >= {num_groups}")
    boundaries = [0]
    for numel in numels:
        boundaries.append(boundaries[-1] + numel)
    total, cuts = boundaries[-1], [0]
    for k in range(1, num_groups):
        # a boundary past the last cut that leaves a shard for each group after it
        choices = range(cuts[-1] + 1, len(numels) - (num_groups - k) + 1)
        cuts.append(min(choices, key=lambda j: (abs(boundaries[j] - k * total / num_groups), j)))
    cuts.append(len(numels))
    return [list(range(low, high)) for low, high in zip(cuts[:-1], cuts[1:], strict=True)]


@dataclass(eq=False)
class _Push:
    """A delayed push: when it started and finished on its thread (0: not yet)."""

    started: float = 0.0
    finished: float = 0.0


class _Landing:
    """One fragment's outer result on its way: the value its delayed push pulled."""

    def __init__(self, future: Future, push: _Push, index: int):
        self.future, self.push, self.index = future, push, index

    def wait(self) -> torch.Tensor:
        return self.future.result()[self.index]


class WorkerRounds:
    """One worker's rounds: its inner optimizer, its fragments' round-start copies and
    places in their rounds (one fragment but with Streaming DiLoCo), and the samples each
    round has taken so far.

    Args:
        settings: H, F and mixing (the outer optimizer itself runs on the servers).
        model: the worker's model, whose trainable parameters are views of `flat` in
            `flat`'s order (`sharding.flat_parameters`).
        flat, grads: the model's flat parameters and gradients.
        training: the inner optimizer, its schedule and clipping.
        shard_numels: the elements of each shard, in order (None: one shard); F > 1 needs
            F of them at least.
    Raises:
        ValueError: more fragments than shards, or fragments (or a delay) with a model
            that has buffers.
    """

    def __init__(self, settings: LocalUpdates, model: nn.Module, flat: torch.Tensor, grads: torch.Tensor,
                 training: TrainingConfig, shard_numels: Sequence[int] | None = None):
        self.settings = settings
        self.flat, self.grads = flat, grads
        named = trainable_parameters(model)
        self.params = [p for _, p in named]
        self.buffers = list(model.buffers())
        self.optimizer = build_optimizer(self.params, training)
        self.stepper = OptimizerStep(self.optimizer, training)
        if settings.num_fragments > 1 and self.buffers:
            # A push carries the change to the buffers of every shard that holds some.
            raise ValueError("Streaming DiLoCo on the parameter server takes models without buffers "
                             "(BatchNorm statistics); leave training.outer_fragments at 1, or train with ddp")
        if settings.delay and self.buffers:
            # A round's change to the buffers goes with its push, and its next round starts
            # from the servers' buffers: a push that lands later has no round start for them.
            raise ValueError("training.outer_delay on the parameter server takes models without buffers "
                             "(BatchNorm statistics); use training.outer_delay 0, or train with ddp")
        numels = list(shard_numels) if shard_numels is not None else [flat.numel()]
        self.groups = shard_groups(numels, settings.num_fragments)
        offsets = [0]
        for numel in numels:
            offsets.append(offsets[-1] + numel)
        self.cuts = [offsets[group[0]] for group in self.groups] + [offsets[-1]]
        # The outer step runs on the servers: these copies need no momentum buffer.
        self.outer = StreamingRounds(replace(settings, momentum=0.0), self.params, [n for n, _ in named],
                                     self.cuts)
        self.fragment_of = {shard: f for f, group in enumerate(self.groups) for shard in group}
        self.fragment_samples = [0] * settings.num_fragments  # of each fragment's round so far
        self.due: list[Fragment] = []  # the fragments whose round the last inner step ended
        self.ends_epoch = False
        self.closed = 0  # rounds the last step's push completed (of every fragment: `outer.rounds`)
        self._own: dict[int, torch.Tensor] = {}  # mixing: each due fragment's values before its push
        # A delayed push's own buffers (its pseudo-gradient, the parameters it pulls) and thread.
        self._staging = (torch.zeros_like(flat), torch.zeros_like(grads)) if settings.delay else None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def opening(self) -> bool:
        """Whether the next step opens every fragment's round (an epoch's first step)."""
        return not self.outer.in_flight and all(fragment.outer.steps_in_round == 0
                                                for fragment in self.outer.fragments)

    @property
    def samples(self) -> int:
        """The samples of fragment 0's round so far (plain local updates: the round's)."""
        return self.fragment_samples[0]

    @property
    def round_number(self) -> int:
        """The number of fragment 0's round in progress (1 on): its push's `step`."""
        return self.outer.fragments[0].outer.rounds + 1

    def shard_steps(self) -> list[int]:
        """Per shard of the run, the number of its fragment's round in progress (1 on): the
        `step` of its push (each shard takes a worker's pushes numbered one after another)."""
        return [self.outer.fragments[self.fragment_of[shard]].outer.rounds + 1
                for shard in sorted(self.fragment_of)]

    def last_push(self, shard: int) -> int:
        """The `step` of this worker's last push to `shard` (0: none)."""
        return self.outer.fragments[self.fragment_of[shard]].outer.rounds

    @property
    def due_shards(self) -> list[int]:
        """The shards the due fragments' push goes to."""
        return [shard for fragment in self.due for shard in self.groups[fragment.index]]

    def shard_samples(self) -> list[int]:
        """Per shard of the run, the samples its fragment's round stands for."""
        return [self.fragment_samples[self.fragment_of[shard]] for shard in sorted(self.fragment_of)]

    def offset_of(self, shard: int) -> int:
        """The step offset of the rounds of `shard`'s fragment (`training.fragments`)."""
        return self.outer.fragments[self.fragment_of[shard]].offset

    def open(self) -> None:
        """Start every fragment's round at the parameters the model holds (the servers' newest)."""
        self.outer.take_start()
        self.fragment_samples = [0] * len(self.fragment_samples)

    def inner_step(self, num_samples: int, ends_epoch: bool) -> bool:
        """Apply the gradient just computed with the inner optimizer; True when it ends a
        fragment's round (then `due` names them)."""
        self.stepper.step()
        self.fragment_samples = [n + num_samples for n in self.fragment_samples]
        self.due, self.ends_epoch = self.outer.end_of_step(ends_epoch), ends_epoch
        self.closed = 0
        return bool(self.due)

    @torch.no_grad()
    def pseudo_gradient(self) -> torch.Tensor:
        """Write the due fragments' pseudo-gradients (round start minus now) into their
        places in `grads`; returns a copy, for a push that must be sent again."""
        self._own = {}
        for fragment in self.due:
            low, high = self.cuts[fragment.index], self.cuts[fragment.index + 1]
            self.grads[low:high].copy_(self.outer.pseudo_gradient(fragment))
            if self.settings.mixing and not self.ends_epoch and not self.delays:
                self._own[fragment.index] = self.flat[low:high].clone()
        return self.grads.clone()

    def close(self) -> None:
        """The due fragments' push was taken and the model holds the servers' parameters
        after it in their places: their next rounds start there (mixed, see `take_outer`)."""
        completed = self.outer.rounds
        for fragment in self.due:
            low, high = self.cuts[fragment.index], self.cuts[fragment.index + 1]
            self.outer.take_outer(fragment, self.flat[low:high].clone(), self.ends_epoch,
                                  self._own.get(fragment.index))
            self.fragment_samples[fragment.index] = 0
        self.closed += self.outer.rounds - completed
        self.due, self._own = [], {}

    @property
    def delays(self) -> bool:
        """Whether the due fragments' push is delayed (`training.outer_delay`; not at an
        epoch's end): `send` it, else push it and `close`."""
        return self.settings.delay > 0 and not self.ends_epoch

    def send(self, exchange: Exchange, trade: Callable[[], None]) -> None:
        """Start the due fragments' push on the push thread: `trade` pushes their
        pseudo-gradient (`pseudo_gradient`'s copy, put into `exchange.grads`) through
        `exchange` and pulls the result into `exchange.flat`, which are this worker's own
        buffers while it runs. Their next rounds count from this step; each lands
        `training.outer_delay` inner steps later (`land`)."""
        assert self._staging is not None, "a push is delayed with training.outer_delay only"
        if self._pool is None:  # one thread: the exchange takes one push at a time
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="delayed-push")
        push = _Push()
        places = [(f.index, self.cuts[f.index], self.cuts[f.index + 1]) for f in self.due]
        future = self._pool.submit(self._trade, exchange, trade, push, places)
        for fragment in self.due:
            self.outer.send(fragment, _Landing(future, push, fragment.index), ends_epoch=False)
            self.fragment_samples[fragment.index] = 0
        self.due = []

    def _trade(self, exchange: Exchange, trade: Callable[[], None], push: _Push,
               places: list[tuple[int, int, int]]) -> dict[int, torch.Tensor]:
        """On the push thread: run `trade` on the staging buffers; returns each fragment's
        parameters pulled."""
        assert self._staging is not None
        push.started = time.perf_counter()
        held = exchange.flat, exchange.grads
        exchange.flat, exchange.grads = self._staging
        try:
            trade()
        finally:
            exchange.flat, exchange.grads = held
            push.finished = time.perf_counter()
        return {index: self._staging[0][low:high].clone() for index, low, high in places}

    def land(self) -> float:
        """Take the delayed pushes due at this step (at an epoch's end every one in flight):
        wait for each and open its fragments' next round at its result, their parameters
        mixed with it (`StreamingRounds.land`). Call after `inner_step`, before this step's
        push. Returns the seconds the pushes landed ran beside inner steps.

        Raises:
            whatever the push raised on its thread.
        """
        entered, completed = time.perf_counter(), self.outer.rounds
        landed = self.outer.land(self.ends_epoch, stepped=True)
        self.closed += self.outer.rounds - completed
        pushes = {id(e.average.push): e.average.push for e in landed if isinstance(e.average, _Landing)}
        return sum(max(0.0, min(push.finished, entered) - push.started) for push in pushes.values())

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Leave this worker's own training as it was before the block, whatever the block
        does with the model (a redone round): its parameters and buffers, its inner
        optimizer's state, its schedule, its round-start copy and place in the round."""
        saved, grad_norm = self.state_dict(), self.stepper.last_grad_norm
        buffers = [b.detach().clone() for b in self.buffers]
        try:
            yield
        finally:
            self.load_state_dict(saved)
            self.stepper.last_grad_norm = grad_norm
            with torch.no_grad():
                for buffer, value in zip(self.buffers, buffers, strict=True):
                    buffer.copy_(value)

    def redo(self, steps: Sequence[Callable[[], StepResult]]) -> StepResult:
        """Train a redone round (see the module's docstring) from the parameters the model
        holds: each of `steps` computes one batch's gradient into `grads`, applied as an
        inner step. Leaves the round's pseudo-gradient (the parameters before it minus
        after) in `grads` and returns the last step's result. Call inside `aside`: it moves
        the model, the inner optimizer and its schedule."""
        if not steps:
            raise ValueError("a redone round needs one batch at least")
        start = self.flat.detach().clone()
        for step in steps:
            result = step()
            self.stepper.step()
        with torch.no_grad():
            torch.sub(start, self.flat, out=self.grads)
        return result

    def scalars(self) -> dict[str, float]:
        """The step's figures: the inner optimizer's, and the rounds of every fragment it completed."""
        return {**self.stepper.scalars(), "local/rounds": self.closed}

    def state_dict(self) -> dict[str, Any]:
        """The worker's own: its model's parameters (mid-round they are not the servers'),
        its inner optimizer and schedule, its round-start copy and place in the round."""
        optimizer = self.optimizer.state_dict()  # its tensors are the live ones: copied
        optimizer["state"] = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in entries.items()}
                              for k, entries in optimizer["state"].items()}
        return {"params": self.flat.clone(), "outer": self.outer.state_dict(), "optimizer": optimizer,
                "schedule": self.stepper.state.state_dict(),
                "samples": self.samples if len(self.fragment_samples) == 1 else list(self.fragment_samples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back `state_dict()`.

        Raises:
            ValueError: it is of another model.
        """
        if state["params"].numel() != self.flat.numel():
            raise ValueError(f"its parameters hold {state['params'].numel()} values and this model "
                             f"{self.flat.numel()}")
        self.outer.load_state_dict(state["outer"])
        self.flat.copy_(state["params"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.stepper.state.load_state_dict(state["schedule"])
        samples = state["samples"]
        self.fragment_samples = [int(samples)] if isinstance(samples, int) else [int(n) for n in samples]
