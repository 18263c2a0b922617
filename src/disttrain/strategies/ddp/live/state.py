"""Handing a live group's training state from one member to the others, without pickle.

A state is a nested structure of dicts, lists, numbers, strings and tensors (model and
optimizer `state_dict`s, the position, the ledger). `flatten` splits it into a JSON
manifest (the structure, each tensor's dtype and shape) and one flat byte buffer of every
tensor; `unflatten` builds it back. `share_state` sends the source's manifest through
the store and its buffer by one broadcast, so a joiner takes weights, optimizer state
and position from a live peer rather than from disk.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_TENSOR, _DICT, _LIST = "tensor", "dict", "list"


def flatten(state: Any) -> tuple[str, torch.Tensor]:
    """(manifest, bytes): the structure as JSON and every tensor's bytes in one buffer."""
    tensors: list[torch.Tensor] = []

    def encode(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().cpu().contiguous())
            return {_TENSOR: [str(value.dtype).removeprefix("torch."), list(value.shape)]}
        if isinstance(value, dict):  # keys keep their type (an optimizer's are ints)
            return {_DICT: [[key, encode(item)] for key, item in value.items()]}
        if isinstance(value, (list, tuple)):
            return {_LIST: [encode(item) for item in value]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"cannot hand over a {type(value).__name__} in a live group's state")

    manifest = json.dumps(encode(state))
    pieces = [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
    buffer = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8)
    return manifest, buffer


def buffer_size(manifest: str) -> int:
    """The bytes of the buffer that goes with `manifest`."""
    total = 0

    def walk(value: Any) -> None:
        nonlocal total
        if isinstance(value, dict) and _TENSOR in value:
            dtype, shape = value[_TENSOR]
            total += _numel(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        elif isinstance(value, dict) and _DICT in value:
            for _, item in value[_DICT]:
                walk(item)
        elif isinstance(value, dict) and _LIST in value:
            for item in value[_LIST]:
                walk(item)

    walk(json.loads(manifest))
    return total


def unflatten(manifest: str, buffer: torch.Tensor) -> Any:
    """The state `flatten` split (tensors are views of fresh copies, on the CPU)."""
    offset = 0

    def decode(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, dict) and _TENSOR in value:
            dtype, shape = value[_TENSOR]
            dtype = getattr(torch, dtype)
            size = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
            piece = buffer[offset:offset + size].clone()
            offset += size
            return piece.view(dtype).reshape(shape)
        if isinstance(value, dict) and _DICT in value:
            return {key: decode(item) for key, item in value[_DICT]}
        if isinstance(value, dict) and _LIST in value:
            return [decode(item) for item in value[_LIST]]
        return value

    return decode(json.loads(manifest))


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def share_state(state: Any, source: int, rank: int, store: dist.Store, key: str,
                timeout_s: float) -> Any:
    """Every member's copy of the source's `state` (a collective of the current group).

    The source writes the manifest under `key` of `store` (a key fresh for each
    generation) and broadcasts the buffer; the others read the manifest and receive it.

    Args:
        state: this member's state (only the source's is read; a joiner passes None).
        source: the group rank whose state everyone takes.
    Raises:
        RuntimeError, dist.DistError: a member was lost on the way (the caller re-forms).
    """
    if rank == source:
        manifest, buffer = flatten(state)
        store.set(key, manifest)
    else:
        store.wait([key], timedelta(seconds=timeout_s))
        manifest = store.get(key).decode()
        buffer = torch.empty(buffer_size(manifest), dtype=torch.uint8)
    if buffer.numel():
        dist.broadcast(buffer, src=source)
    return state if rank == source else unflatten(manifest, buffer)
