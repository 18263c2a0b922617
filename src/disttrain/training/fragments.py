"""Streaming DiLoCo (Douillard et al., 2025): a local-update round exchanged in fragments
at staggered steps, apart from any transport.

The trained parameters are cut into F fragments (`training.outer_fragments`): whole
tensors in the model's order, contiguous, cut where the largest fragment's bytes are the
least they can be (`split_fragments`). Each fragment has its own round: its own
round-start copy and outer optimizer state (an `OuterOptimizer` over its tensors).
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

Call order: `StreamingRounds(settings, params)` once the parameters hold the run's start
(or `load_state_dict` after a resume); after every inner step `end_of_step(ends_epoch)`,
which names the fragments whose round ended; for each of them, in order:
`pseudo_gradient(fragment)`, average it over the workers (transport), then
`apply(fragment, average, ends_epoch)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.compression.compressor import Compressor
from disttrain.config import TrainingConfig
from disttrain.core.errors import ConfigError
from disttrain.training.local_updates import LocalUpdates, OuterOptimizer
from disttrain.training.models import init_model

# `training.outer_compression` -> the compression scheme that writes it.
OUTER_SCHEMES = {"fp16": "fp16", "int8": "quantization"}


def split_fragments(sizes: Sequence[int], num_fragments: int) -> list[range]:
    """Cut tensors of `sizes` bytes, in order, into `num_fragments` contiguous, non-empty
    groups whose largest byte total is the least it can be (ties: the earliest cuts).

    Returns:
        The tensor indices of each group, in order.
    Raises:
        ValueError: fewer tensors than fragments, or fewer than one fragment.
    """
    n = len(sizes)
    if not 1 <= num_fragments <= n:
        raise ValueError(f"{num_fragments} fragment(s) of {n} parameter tensor(s): a fragment holds "
                         f"whole tensors; use at most {n} fragments")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the least largest group over cuts of the first i tensors into k groups.
    infinity = prefix[-1] + 1
    best = [[infinity] * (n + 1) for _ in range(num_fragments + 1)]
    cut = [[0] * (n + 1) for _ in range(num_fragments + 1)]
    best[0][0] = 0
    for k in range(1, num_fragments + 1):
        for i in range(k, n - (num_fragments - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, end = [], n
    for k in range(num_fragments, 0, -1):
        start = cut[k][end]
        bounds.append(range(start, end))
        end = start
    return bounds[::-1]


def check_fragments(training: TrainingConfig) -> None:
    """Before any process starts: the model holds at least `training.outer_fragments`
    trained tensors (a fragment holds whole tensors).

    Raises:
        ConfigError: it holds fewer (one line).
    """
    if not training.local_update_mode or training.outer_fragments == 1:
        return
    with torch.random.fork_rng(devices=[]):  # the run's random streams are left as they were
        model = init_model(training)
    count = sum(1 for p in model.parameters() if p.requires_grad)
    if training.outer_fragments > count:
        raise ConfigError(f"training.outer_fragments: {training.outer_fragments} fragments of "
                          f"{training.model_architecture}, which holds {count} trained tensors (a fragment "
                          f"holds whole tensors); use at most {count}")


def outer_compressor(settings: LocalUpdates, seed: int) -> Compressor | None:
    """The compressor of a worker's pseudo-gradients (`training.outer_compression`), with
    error feedback; None for none. `seed`: this worker's own."""
    if settings.compression == "none":
        return None
    return Compressor(OUTER_SCHEMES[settings.compression], error_feedback=True, seed=seed)


@dataclass
class Fragment:
    """One fragment: its tensors (indices into the run's parameters), the step of a round
    it ends at (`offset`), and its own outer optimizer over its tensors."""

    index: int
    members: range
    offset: int
    outer: OuterOptimizer

    def nbytes(self) -> int:
        """The bytes of its pseudo-gradient, dense."""
        return self.outer.start.numel() * self.outer.start.element_size()


class StreamingRounds:
    """One worker's fragments and their rounds (the same on every worker after each
    exchange, but for mixing: see the module's docstring).

    Args:
        settings: H, the outer optimizer, F and mixing.
        params: the model's trained parameters, in a fixed order (the same on every worker).
    Raises:
        ValueError: more fragments than parameter tensors or than H, or parameters of
            several dtypes or devices.
    """

    def __init__(self, settings: LocalUpdates, params: Sequence[torch.Tensor]):
        if settings.num_fragments > settings.sync_every and settings.num_fragments > 1:
            raise ValueError(f"{settings.num_fragments} fragments need rounds of as many steps at least "
                             f"(sync_every is {settings.sync_every})")
        self.settings = settings
        self.params = list(params)
        groups = split_fragments([p.numel() * p.element_size() for p in self.params], settings.num_fragments)
        self.fragments = [
            Fragment(f, members, f * settings.sync_every // settings.num_fragments,
                     OuterOptimizer(settings, self.params[members.start:members.stop]))
            for f, members in enumerate(groups)]

    def tensors(self, fragment: Fragment) -> list[torch.Tensor]:
        """The parameters of `fragment`, in order."""
        return self.params[fragment.members.start:fragment.members.stop]

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
            fragment.outer.take_start(self.tensors(fragment))

    def end_of_step(self, ends_epoch: bool) -> list[Fragment]:
        """Count one inner step; returns the fragments whose round it ends, in order."""
        for fragment in self.fragments:
            fragment.outer.end_of_step(ends_epoch)
        step, every = self.position, self.settings.sync_every
        return [fragment for fragment in self.fragments
                if ends_epoch or (step - fragment.offset) % every == 0]

    def pseudo_gradient(self, fragment: Fragment) -> torch.Tensor:
        """This worker's pseudo-gradient of `fragment`, flat (a buffer the transport may
        average in place and hand back to `apply`)."""
        return fragment.outer.pseudo_gradient(self.tensors(fragment))

    @torch.no_grad()
    def apply(self, fragment: Fragment, average: torch.Tensor, ends_epoch: bool) -> None:
        """Step `fragment`'s outer optimizer on the workers' mean pseudo-gradient and set
        its parameters (mixed with the worker's own, but at an epoch's end)."""
        fragment.outer.step(average)
        tensors = self.tensors(fragment)
        if self.settings.mixing == 0 or ends_epoch:
            fragment.outer.copy_to(tensors)
            return
        for param, start in zip(tensors, fragment.outer.views(fragment.outer.start), strict=True):
            param.lerp_(start, 1.0 - self.settings.mixing)

    def state_dict(self) -> dict[str, Any]:
        """Tensors and integers only (a `weights_only` checkpoint). One fragment: the
        `OuterOptimizer`'s own state, as plain local updates write it."""
        if len(self.fragments) == 1:
            return self.fragments[0].outer.state_dict()
        return {"num_fragments": len(self.fragments),
                "fragments": [fragment.outer.state_dict() for fragment in self.fragments]}

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
