"""Per-rank state gathered as plain tensors for rank 0's checkpoint: RNG states, and any
other state that differs between ranks (a compression hook's).

Each rank draws its own dropout masks, so an exact resume needs every rank's RNG state,
not only rank 0's. The states travel as tensors through `all_gather`, never as pickled
objects: no rank unpickles bytes that came over the network. `encode` and `decode`
translate between `checkpoint.rng_state()` and such tensors; `gather_tensors` gathers
any dict of tensors, whose names and shapes may differ between ranks.
"""

from __future__ import annotations

import json
import math
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
    """Every rank's `local`, in rank order, on every rank (on the CPU). A collective: call
    on all ranks at the same point.

    Ranks may hold different names and sizes: a rank without a GPU beside ranks with one
    has no CUDA RNG state, and nodes may differ in their number of GPUs. Each rank's
    manifest (name: dtype and shape, as JSON text) is gathered first, then each name's
    tensors padded to the largest, since every rank hands `all_gather` equal sizes.

    Raises:
        DistributedError: two ranks hold a name with different dtypes (checked before
            gathering tensors, so a mismatch fails here instead of in a later collective).
    """
    manifest = {name: [str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in local.items()}
    manifests = [json.loads(text) for text in _gather_bytes(json.dumps(manifest).encode(), world_size,
                                                           device)]
    names = sorted(set().union(*manifests))
    dtypes = {name: {m[name][0] for m in manifests if name in m} for name in names}
    for name, found in dtypes.items():
        if len(found) > 1 or not isinstance(getattr(torch, next(iter(found)), None), torch.dtype):
            raise DistributedError(f"ranks hold per-rank state {name!r} in different or unknown dtypes "
                                   f"({sorted(found)}); every rank must run the same code")
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
    for name in names:
        dtype = getattr(torch, dtypes[name].pop())
        sizes = [math.prod(m[name][1]) if name in m else 0 for m in manifests]
        parts = _gather_padded(local[name].reshape(-1) if name in local else torch.empty(0, dtype=dtype),
                               max(sizes), world_size, device)
        for rank, (part, size) in enumerate(zip(parts, sizes, strict=True)):
            if name in manifests[rank]:
                gathered[rank][name] = part[:size].cpu().reshape(manifests[rank][name][1])
    return gathered


def _gather_padded(flat: torch.Tensor, size: int, world_size: int,
                   device: torch.device) -> list[torch.Tensor]:
    """Every rank's 1-D `flat`, each padded with zeros to `size` (the largest)."""
    padded = torch.zeros(size, dtype=flat.dtype, device=device)
    padded[:flat.numel()] = flat.to(device)
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    if size:
        dist.all_gather(parts, padded)
    return parts


def _gather_bytes(data: bytes, world_size: int, device: torch.device) -> list[bytes]:
    """Every rank's `data`, in rank order."""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world_size)]
    dist.all_gather(lengths, length)
    sizes = [int(t.item()) for t in lengths]
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    parts = _gather_padded(flat, max(sizes), world_size, device)
    return [part[:size].cpu().numpy().tobytes() for part, size in zip(parts, sizes, strict=True)]
