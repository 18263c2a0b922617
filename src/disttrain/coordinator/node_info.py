"""What a node tells the coordinator about itself beside its liveness: the machine it
runs on (at registration) and its balance state (in every heartbeat).

The balance state is a dict the node keeps up to date, with optional keys `batch` (its
current batch size), `speed` (samples/s measured in the warm-up before training) and
`plans` (balance plans so far: 1 = the one it started with, each re-plan adds one).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from disttrain.proto import coordinator_pb2 as pb


def capabilities() -> pb.Capabilities:
    """This machine: CPU count, total memory, and the number of visible CUDA GPUs and the
    first one's name when torch is loaded (0 and "" without CUDA)."""
    try:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory_bytes = 0
    gpu, gpu_count = "", 0
    torch = sys.modules.get("torch")  # never import torch only to describe the machine
    if torch is not None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        # After the name, CUDA is initialised and the count is the runtime's cached answer
        # (honours CUDA_VISIBLE_DEVICES); no context is created on any device.
        gpu_count = torch.cuda.device_count()
    return pb.Capabilities(cpus=os.cpu_count() or 0, memory_bytes=memory_bytes, gpu=gpu,
                           gpu_count=gpu_count)


def balance_fields(balance: Mapping[str, Any] | None) -> dict[str, Any]:
    """The HeartbeatMessage fields of a balance state: `batch_size`, `warmup_speed`,
    `plans`, each 0 (unknown) where `balance` has no such key or is None.

    Raises:
        TypeError: `balance` is not a mapping, or a value is not a number.
    """
    if balance is None:
        return {"batch_size": 0, "warmup_speed": 0.0, "plans": 0}
    if not isinstance(balance, Mapping):
        raise TypeError("a node's balance state is a dict (batch, speed, plans), not "
                        f"{type(balance).__name__}")
    state = dict(balance)  # one read: the node may update it meanwhile
    return {"batch_size": int(state.get("batch") or 0), "warmup_speed": float(state.get("speed") or 0.0),
            "plans": int(state.get("plans") or 0)}
