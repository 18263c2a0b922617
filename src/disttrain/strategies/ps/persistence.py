"""What a shard's checkpoint holds, and how it comes back: parameters, optimizer state,
version, the data ledger, the rules' counters, the completed barriers and who holds each
worker id, together, so they never disagree."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import CheckpointError

if TYPE_CHECKING:
    from disttrain.strategies.ps.shard import ShardState

STRATEGY = "ps-server"
KEYS = ("strategy", "shard", "numel", "params", "optimizer", "rules")


def snapshot(shard: ShardState) -> dict[str, Any]:
    """Everything a restart of `shard` needs (its lock held; tensors are copies)."""
    optimizer_state = shard.optimizer.state_dict()
    optimizer_state["state"] = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                                for k, s in optimizer_state["state"].items()}
    return {"strategy": STRATEGY, "shard": shard.plan.shard, "num_shards": shard.plan.num_shards,
            "numel": shard.plan.numel, "version": shard.rules.version,
            "params": shard.param.detach().clone(), "optimizer": optimizer_state,
            "rules": shard.rules.state_dict(), "barriers": shard.barriers.state_dict(),
            "identities": shard.identities.state_dict(),
            "config": shard.config.to_dict()}


def restore(shard: ShardState, path: str | Path) -> None:
    """Load a checkpoint into `shard` (its lock held).

    Raises:
        CheckpointError: unreadable, or written by another shard layout or mode.
    """
    state = ckpt.load_checkpoint(path)
    ckpt.require_keys(state, KEYS, path)
    if state["strategy"] != STRATEGY or state["shard"] != shard.plan.shard \
            or state["numel"] != shard.plan.numel:
        raise CheckpointError(f"checkpoint {path} belongs to another shard or model "
                              f"(shard {state['shard']}, {state['numel']} elements); use the "
                              "checkpoint dir of this shard")
    try:
        shard.rules.load_state_dict(state["rules"])
        shard.optimizer.load_state_dict(state["optimizer"])
        shard.barriers.load_state_dict(state.get("barriers", {}))
        shard.identities.load_state_dict(state.get("identities", {}))
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit this run: {e}") from e
    with torch.no_grad():
        shard.param.copy_(state["params"])
