"""Streaming DiLoCo (Douillard et al., 2025): a local-update round exchanged in fragments
at staggered steps, apart from any transport.

The trained parameters are cut into F fragments (`training.outer_fragments`) of about
equal bytes, contiguous in the model's order: whole layers, but where a layer is larger
than a fragment's share, which is then cut across fragments (`split_fragments`). Each
fragment has its own round: its own round-start copy and outer optimizer state (an
`OuterOptimizer` over its tensors).
Fragment f ends its rounds at the steps s of an epoch (counted from 1) where

    (s - offset_f) % H == 0,    offset_f = f * H // F          (F <= H)

so its first round is offset_f steps long (fragment 0's H), every later one H, and at
any step at most one fragment is exchanged: the bytes of one exchange fall from the
model's to about 1/F of them. An epoch's last step ends every fragment's round, each
exchanged on its own (every epoch ends with one model, which its evaluation and
checkpoint see); the schedule starts again with the next epoch, as the rounds of plain
local updates do. With F = 1 this is plain local updates, bit for bit (one
`OuterOptimizer` over every parameter, its state as before).

After a fragment's outer step its parameters take the outer result, or with mixing
alpha (`training.outer_mixing`) alpha x the worker's own + (1 - alpha) x the outer
result; the fragment's next round starts from the outer result either way, so its next
pseudo-gradient carries the part of the worker's own it kept. An epoch's last exchange
takes the outer result whole.

Pseudo-gradients may be exchanged as fp16 or int8 (`training.outer_compression`): the
transport encodes each worker's with `outer_compressor`'s `Compressor` (error feedback:
what a payload leaves out, per parameter, is added to that parameter's next one) and
averages the decoded payloads.

With a delay tau (`training.outer_delay`, in inner steps, less than H) a fragment's
exchange overlaps the next tau inner steps, as the paper's and torchft's do: at its sync
step s the transport starts averaging the pseudo-gradient (`send` keeps its handle) and
training goes on; after step s + tau the average is waited for and its outer result
applied (`land`), mixed with the worker's parameters of that moment, which have moved on
for tau steps. The fragment's next round counts from step s and starts from the outer
result, so the schedule is the same as without delay. An epoch's last step lands every
exchange in flight, then exchanges every fragment without delay. A checkpoint taken
while exchanges are in flight waits for them and keeps their averages and the steps
they have left (`state_dict`), so a resumed run applies each at the same step.

Call order: `StreamingRounds(settings, params)` once the parameters hold the run's start
(or `load_state_dict` after a resume); after every inner step `end_of_step(ends_epoch)`,
which names the fragments whose round ended; then `land(ends_epoch)` (a delay's
exchanges due now); then for each fragment named, in order: `pseudo_gradient(fragment)`,
start averaging it over the workers (transport), then `send(fragment, handle,
ends_epoch)`, or, without delay, wait and `apply(fragment, average, ends_epoch)`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from disttrain.compression.compressor import Compressor
from disttrain.training.local_updates import LocalUpdates, OuterOptimizer

# `training.outer_compression` -> the compression scheme that writes it.
OUTER_SCHEMES = {"fp16": "fp16", "int8": "quantization"}
# A cut between fragments moves to the nearest tensor boundary within this share of a
# fragment's bytes; farther from one, it falls inside the tensor (a large layer is split).
SNAP = 0.1


@dataclass(frozen=True)
class Piece:
    """A fragment's part of one parameter: values `start` to `stop` of it, flattened."""

    index: int
    start: int
    stop: int


def split_fragments(sizes: Sequence[int], num_fragments: int) -> list[list[Piece]]:
    """Cut parameters of `sizes` values, in the model's order, into `num_fragments`
    contiguous fragments of about equal size: each cut is at k/F of the values, moved to
    the nearest tensor boundary where one lies within `SNAP` of a fragment's share, so
    fragments hold whole layers but where a layer is larger than that.

    Returns:
        The pieces of each fragment, in order.
    Raises:
        ValueError: fewer than one fragment, or more than the values.
    """
    total = sum(sizes)
    if not 1 <= num_fragments <= max(total, 1):  # a model without trained values: one, empty
        raise ValueError(f"{num_fragments} fragment(s) of {total} parameter value(s): use 1 to {total}")
    boundaries = _boundaries(sizes)
    share = total / num_fragments
    cuts = [0]
    for k in range(1, num_fragments):
        ideal = round(k * share)
        at = bisect.bisect_left(boundaries, ideal)
        nearest = min(boundaries[max(at - 1, 0):at + 1], key=lambda b: (abs(b - ideal), b))
        cut = nearest if abs(nearest - ideal) <= SNAP * share else ideal
        cuts.append(min(max(cut, cuts[-1] + 1), total - (num_fragments - k)))  # none empty
    cuts.append(total)
    return pieces_between(sizes, cuts)


def pieces_between(sizes: Sequence[int], cuts: Sequence[int]) -> list[list[Piece]]:
    """The pieces of the fragments between `cuts` (value offsets into parameters of
    `sizes` values in the model's order, from 0 to their total, ascending): fragment k
    holds values `cuts[k]` to `cuts[k + 1]`.

    Raises:
        ValueError: the cuts do not start at 0, end at the total, or ascend.
    """
    total = sum(sizes)
    # ([0, 0]: a model without trained values, one empty fragment)
    ascending = all(a < b for a, b in zip(cuts, cuts[1:], strict=False)) or list(cuts) == [0, 0]
    if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != total or not ascending:
        raise ValueError(f"fragment cuts {list(cuts)} do not ascend from 0 to the {total} parameter values")
    boundaries = _boundaries(sizes)
    return [[Piece(i, max(low, begin) - begin, min(high, end) - begin)
             for i, (begin, end) in enumerate(zip(boundaries[:-1], boundaries[1:], strict=True))
             if begin < high and end > low]
            for low, high in zip(cuts[:-1], cuts[1:], strict=True)]


def _boundaries(sizes: Sequence[int]) -> list[int]:
    boundaries = [0]
    for size in sizes:
        boundaries.append(boundaries[-1] + size)
    return boundaries


def outer_compressor(settings: LocalUpdates) -> Compressor | None:
    """The compressor of a worker's pseudo-gradients (`training.outer_compression`), with
    error feedback, rounding to nearest; None for none."""
    if settings.compression == "none":
        return None
    return Compressor(OUTER_SCHEMES[settings.compression], error_feedback=True)


@dataclass
class Fragment:
    """One fragment: its tensors (whole parameters, or flat views of a part of one) with
    their names, the step of a round it ends at (`offset`), and its own outer optimizer."""

    index: int
    tensors: list[torch.Tensor]
    names: list[str]
    offset: int
    outer: OuterOptimizer

    def nbytes(self) -> int:
        """The bytes of its pseudo-gradient, dense."""
        return self.outer.start.numel() * self.outer.start.element_size()


class Average(Protocol):
    """A transport's average under way (a `torch.futures.Future` of the workers' mean)."""

    def wait(self) -> torch.Tensor: ...


@dataclass(eq=False)
class InFlight:
    """A fragment's exchange under way: its average, and the inner steps left before it lands."""

    fragment: Fragment
    average: Average
    steps_left: int


def done(value: torch.Tensor) -> torch.futures.Future:
    """An average already at hand (loaded from a checkpoint), as a transport's handle."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


class StreamingRounds:
    """One worker's fragments and their rounds (the same on every worker after each
    exchange, but for mixing: see the module's docstring).

    Args:
        settings: H, the outer optimizer, F and mixing.
        params: the model's trained parameters, in a fixed order (the same on every
            worker), each contiguous (a fragment may hold a view of part of one).
        names: the parameters' names (default `p0`, `p1`, ...); a part is named
            `name[start:stop]`.
        cuts: where the fragments lie, as value offsets into the parameters in order
            (`pieces_between`), when the transport fixes them (the parameter server's
            shards); None: `split_fragments`.
    Raises:
        ValueError: more fragments than H, cuts that are not F fragments of the
            parameters, or parameters of several dtypes or devices.
    """

    def __init__(self, settings: LocalUpdates, params: Sequence[torch.Tensor],
                 names: Sequence[str] | None = None, cuts: Sequence[int] | None = None):
        if settings.num_fragments > settings.sync_every and settings.num_fragments > 1:
            raise ValueError(f"{settings.num_fragments} fragments need rounds of as many steps at least "
                             f"(sync_every is {settings.sync_every})")
        if not 0 <= settings.delay < settings.sync_every:
            raise ValueError(f"an exchange delayed by {settings.delay} step(s) must land before the "
                             f"fragment's next one (sync_every is {settings.sync_every})")
        self.settings = settings
        self.params = list(params)
        names = list(names) if names is not None else [f"p{i}" for i in range(len(self.params))]
        self.fragments: list[Fragment] = []
        self.in_flight: list[InFlight] = []  # in the order they were sent
        sizes = [p.numel() for p in self.params]
        if cuts is not None and len(cuts) != settings.num_fragments + 1:
            raise ValueError(f"{len(cuts)} cuts make {len(cuts) - 1} fragment(s), not "
                             f"{settings.num_fragments}")
        split = split_fragments(sizes, settings.num_fragments) if cuts is None \
            else pieces_between(sizes, cuts)
        for f, pieces in enumerate(split):
            tensors = [self._tensor(piece) for piece in pieces]
            labels = [names[piece.index] if tensor is self.params[piece.index]
                      else f"{names[piece.index]}[{piece.start}:{piece.stop}]"
                      for piece, tensor in zip(pieces, tensors, strict=True)]
            offset = f * settings.sync_every // settings.num_fragments
            self.fragments.append(Fragment(f, tensors, labels, offset, OuterOptimizer(settings, tensors)))

    def _tensor(self, piece: Piece) -> torch.Tensor:
        """The parameter itself when the piece is all of it, else a flat view of the part
        (writes go through to the parameter)."""
        param = self.params[piece.index]
        if piece.start == 0 and piece.stop == param.numel():
            return param
        return param.detach().view(-1)[piece.start:piece.stop]

    @property
    def rounds(self) -> int:
        """Rounds every fragment has completed (plain local updates: the rounds)."""
        return min(fragment.outer.rounds for fragment in self.fragments)

    @property
    def position(self) -> int:
        """Steps taken since fragment 0's round began: the place in the schedule."""
        return self.fragments[0].outer.steps_in_round

    def take_start(self) -> None:
        """Start every fragment's round at the parameters of the moment (the run's start, or
        parameters loaded from elsewhere); the schedule starts again."""
        for fragment in self.fragments:
            fragment.outer.take_start(fragment.tensors)

    def end_of_step(self, ends_epoch: bool) -> list[Fragment]:
        """Count one inner step; returns the fragments whose round it ends, in order."""
        for fragment in self.fragments:
            fragment.outer.end_of_step(ends_epoch)
        for exchange in self.in_flight:
            exchange.steps_left -= 1
        step, every = self.position, self.settings.sync_every
        return [fragment for fragment in self.fragments
                if ends_epoch or (step - fragment.offset) % every == 0]

    def pseudo_gradient(self, fragment: Fragment) -> torch.Tensor:
        """This worker's pseudo-gradient of `fragment`, flat (a buffer the transport may
        average in place and hand back to `apply`)."""
        return fragment.outer.pseudo_gradient(fragment.tensors)

    @torch.no_grad()
    def apply(self, fragment: Fragment, average: torch.Tensor, ends_epoch: bool) -> None:
        """Step `fragment`'s outer optimizer on the workers' mean pseudo-gradient and set
        its parameters (mixed with the worker's own, but at an epoch's end)."""
        fragment.outer.step(average)
        self._set(fragment, ends_epoch)

    def send(self, fragment: Fragment, average: Average, ends_epoch: bool) -> None:
        """`fragment`'s exchange has started (`average`: the transport's handle on the
        workers' mean of its `pseudo_gradient`): it lands `settings.delay` steps later
        (`land`); without delay, or at an epoch's end, it is waited for and applied now.
        Its next round counts from this step either way."""
        if self.settings.delay == 0 or ends_epoch:
            self.apply(fragment, average.wait(), ends_epoch)
            return
        fragment.outer.steps_in_round = 0
        self.in_flight.append(InFlight(fragment, average, self.settings.delay))

    def land(self, ends_epoch: bool, stepped: bool = False) -> list[InFlight]:
        """Wait for the exchanges due at this step (at an epoch's end every one in flight)
        and apply each, in the order sent; returns them. Call after `end_of_step`, before
        this step's `send`s. `stepped`: the transport ran the outer step itself (the
        parameter server's shards), so each handle's value is the fragment's outer result,
        taken as `take_outer` takes it."""
        due = [e for e in self.in_flight if ends_epoch or e.steps_left <= 0]
        self.in_flight = [e for e in self.in_flight if e not in due]
        for exchange in due:
            outer = exchange.fragment.outer
            steps = outer.steps_in_round  # its next round began when the exchange was sent
            if stepped:
                self.take_outer(exchange.fragment, exchange.average.wait(), ends_epoch)
            else:
                self.apply(exchange.fragment, exchange.average.wait(), ends_epoch)
            outer.steps_in_round = steps
        return due

    @torch.no_grad()
    def take_outer(self, fragment: Fragment, result: torch.Tensor, ends_epoch: bool,
                   own: torch.Tensor | None = None) -> None:
        """For a transport that steps the outer optimizer itself (the parameter server's
        shards, on the workers' pseudo-gradients): open `fragment`'s next round at its
        result `result` (flat) and set its parameters as `apply` does. `own`: this
        worker's parameters of the fragment before the exchange (flat), needed for mixing
        where the transport wrote the result over them."""
        outer = fragment.outer
        outer.start.copy_(result)
        outer.steps_in_round = 0
        outer.rounds += 1
        if own is not None:
            for param, value in zip(fragment.tensors, outer.views(own), strict=True):
                param.copy_(value)
        self._set(fragment, ends_epoch)

    def _set(self, fragment: Fragment, ends_epoch: bool) -> None:
        """Set `fragment`'s parameters to its round start (just stepped), or mix them."""
        tensors = fragment.tensors
        if self.settings.mixing == 0 or ends_epoch:
            fragment.outer.copy_to(tensors)
            return
        for param, start in zip(tensors, fragment.outer.views(fragment.outer.start), strict=True):
            param.lerp_(start, 1.0 - self.settings.mixing)

    def state_dict(self) -> dict[str, Any]:
        """Tensors and integers only (a `weights_only` checkpoint). One fragment: the
        `OuterOptimizer`'s own state, as plain local updates write it. Exchanges in flight
        are waited for: their averages and steps left go in (`in_flight`)."""
        if len(self.fragments) == 1:
            state = self.fragments[0].outer.state_dict()
        else:
            state = {"num_fragments": len(self.fragments),
                     "fragments": [fragment.outer.state_dict() for fragment in self.fragments]}
        if self.in_flight:
            state["in_flight"] = [{"fragment": e.fragment.index, "steps_left": e.steps_left,
                                   "average": e.average.wait().clone()} for e in self.in_flight]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back `state_dict()`.

        Raises:
            ValueError: it was written with another number of fragments, or does not fit
                a fragment (see `OuterOptimizer.load_state_dict`).
        """
        written = int(state.get("num_fragments", 1))
        if written != len(self.fragments):
            raise ValueError(f"it was written with training.outer_fragments={written} and this run has "
                             f"{len(self.fragments)}; resume with training.outer_fragments={written}")
        states = [state] if written == 1 else state["fragments"]
        for fragment, own in zip(self.fragments, states, strict=True):
            fragment.outer.load_state_dict(own)
        self.in_flight = []
        for entry in state.get("in_flight", []):
            if self.settings.delay == 0:
                raise ValueError("it was written with exchanges in flight (training.outer_delay > 0); "
                                 "resume with the run's training.outer_delay")
            fragment = self.fragments[int(entry["fragment"])]
            average = fragment.outer.delta.copy_(entry["average"])
            self.in_flight.append(InFlight(fragment, done(average), int(entry["steps_left"])))
