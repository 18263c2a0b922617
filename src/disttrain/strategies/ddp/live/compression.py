"""Gradient compression in a live group: the DDP hooks of `compression.ddp_hooks` (the same
codecs, the same state), registered on each generation's DDP module as restart mode
registers them (`rank.wrap_model`), and with local updates run on a round's flat
pseudo-gradient (`ddp_hooks.average_flat`, as restart mode's local updates).

What is handed over with the rest of the state (`state_dict`, taken by every member but
the source in `LiveTrainer.load_state_dict`): the byte counters, and PowerSGD's shared
state (its iteration, the random generator of Q's start, P and Q, which are all-reduced
and so the same on every member). PowerSGD's collectives depend on that state: before its
iteration reaches `powersgd.START_ITERATION` a member all-reduces the whole buffer, after
it only the uncompressed gradients, then P, then Q; a member that missed it (a joiner
with a fresh hook) sends a buffer of another size and gloo aborts on the mismatch. So
after every change of group each member holds the source's PowerSGD state, broadcast
with the model (the source is the furthest holder, not always the leader), rather than a
reset: a reset would agree as well, but it would throw away the warm start of Q and
repeat the plain all-reduces of the first iterations at every recovery, while P and Q
are small (rank r) and ride the broadcast that already happens. When the failed step
died inside the hook, the source's P or Q may be its own unreduced ones; every member
takes the same copy, so they still agree, and a warm start only seeds the next power
iteration.

What is not handed over: each member's own error-feedback residual (top-k's and
quantization's `residual/...`, the two-phase collective's `owned/...` too, PowerSGD's
`error/...`). After every change of group (a
re-form, a rejoin, a resume) every member starts again from a zero residual
(`clear_residuals`), the source of the state included. That is sound: a residual is the
gradient mass this rank's earlier payloads left out, and error feedback converges from
any starting residual (it only delays that mass); a zero residual drops at most one
residual's worth, once per recovery. Carrying the old one would be wrong: the member
that held it may be gone, the batch split that produced it changes with the group, and a
survivor's residual already includes the encoding of the failed step that the group
redoes, which would then count twice.
"""

from __future__ import annotations

from typing import Any

import torch

from disttrain.compression.ddp_hooks import (
    CompressionHook,
    GatherHook,
    PowerSGDHook,
    TwoPhaseHook,
    build_ddp_hook,
)
from disttrain.config import Config
from disttrain.training.seeding import training_seed


def live_compression(config: Config, module: torch.nn.Module, slot: int) -> CompressionHook | None:
    """The run's compression hook for this slot (None when compression is off)."""
    if not config.compression.enabled:
        return None
    seed = config.training.seed
    # `auto` chooses the collective once, for the size the run starts at
    return build_ddp_hook(config.compression, module.named_parameters(), seed, training_seed(seed, slot),
                          config.system.num_workers)


def clear_residuals(hook: CompressionHook) -> None:
    """This member's error feedback starts from zero (see the module's docstring); nothing
    in flight from a group that is gone is waited for."""
    if isinstance(hook, GatherHook):
        hook.compressor.residuals.clear()  # a missing residual reads as zeros
        hook.compressor.velocities.clear()  # DGC's momentum correction: the same reasoning
    elif isinstance(hook, TwoPhaseHook):  # both roundings', the owner's laid out for the old group
        hook.residuals.clear()
        hook.owner_residuals.clear()
    elif isinstance(hook, PowerSGDHook):
        hook.buckets.state.error_dict.clear()  # the hook starts a missing one at zeros
        hook.buckets.pending.errors.clear()
        hook.in_flight = None


def shared_state(hook: CompressionHook) -> dict[str, torch.Tensor]:
    """The hook's state without the per-rank residuals (what a joiner takes)."""
    return {name: value for name, value in hook.state_dict().items() if not _is_residual(name)}


def load_shared_state(hook: CompressionHook, state: dict[str, Any]) -> None:
    """Take a peer's `shared_state`; this member's residual is then zero.

    Raises:
        ValueError: the state is of another compression scheme.
    """
    hook.load_state_dict(state)
    clear_residuals(hook)


def _is_residual(name: str) -> bool:
    _, _, rest = name.partition("/")
    return rest.startswith(("residual/", "error/", "owned/"))
