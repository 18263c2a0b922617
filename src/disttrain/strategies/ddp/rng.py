"""Per-rank state gathered as plain tensors for rank 0's checkpoint: RNG states, and any
other state that differs between ranks (a compression hook's).

Each rank draws its own dropout masks, so an exact resume needs every rank's RNG state,
not only rank 0's. The states travel as tensors through `all_gather`, never as pickled
objects: no rank unpickles bytes that came over the network. `encode` and `decode`
translate between `checkpoint.rng_state()` and such tensors; `gather_tensors` gathers
any dict of tensors whose names and shapes are the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from disttrain.core.errors import DistributedError

PYTHON_STATE_VERSION = 3  # random.getstate()[0] on every supported Python


def encode(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`checkpoint.rng_state()` as a dict of tensors whose shapes are the same on every rank."""
    version, key, gauss_next = state["python"]
    if version != PYTHON_STATE_VERSION:
        raise ValueError(f"unsupported Python random state version {version}")
    numpy_state = state["numpy"]
    tensors = {
        "python_key": torch.tensor(key, dtype=torch.int64),
        "python_gauss": torch.tensor([gauss_next is not None, gauss_next or 0.0], dtype=torch.float64),
        "numpy_key": numpy_state["key"].to(torch.int64),
        "numpy_misc": torch.tensor([numpy_state["pos"], numpy_state["has_gauss"],
                                    numpy_state["cached_gaussian"]], dtype=torch.float64),
        "torch": state["torch"],
    }
    if "cuda" in state:
        tensors["cuda"] = torch.stack(list(state["cuda"]))
    return tensors


def decode(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The inverse of `encode`: a state `checkpoint.set_rng_state` accepts."""
    tensors = {name: value.cpu() for name, value in tensors.items()}
    has_gauss, gauss = tensors["python_gauss"].tolist()
    pos, numpy_has_gauss, cached = tensors["numpy_misc"].tolist()
    state = {
        "python": (PYTHON_STATE_VERSION, tuple(int(v) for v in tensors["python_key"].tolist()),
                   gauss if has_gauss else None),
        "numpy": {"key": tensors["numpy_key"], "pos": int(pos), "has_gauss": int(numpy_has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": tensors["torch"],
    }
    if "cuda" in tensors:
        state["cuda"] = list(tensors["cuda"].unbind(0))
    return state


def gather_tensors(local: dict[str, torch.Tensor], world_size: int,
                   device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Every rank's `local`, in rank order, on every rank. A collective: call on all ranks
    at the same point, each with the same names and shapes (values differ).

    Raises:
        DistributedError: the ranks' names or sizes differ (checked before gathering, so
            a mismatch fails here instead of hanging in a later collective).
    """
    layout = torch.tensor([len(local), sum(t.numel() for t in local.values())], dtype=torch.int64,
                          device=device)
    layouts = [torch.empty_like(layout) for _ in range(world_size)]
    dist.all_gather(layouts, layout)
    if any(not torch.equal(other, layout) for other in layouts):
        raise DistributedError(f"ranks hold different per-rank state to checkpoint "
                               f"(tensors, elements per rank: {[t.tolist() for t in layouts]})")
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
    for name in sorted(local):
        tensor = local[name].to(device)
        parts = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(parts, tensor)
        for rank, part in enumerate(parts):
            gathered[rank][name] = part.cpu()
    return gathered
