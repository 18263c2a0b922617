"""What a node tells the coordinator about itself, on the wire: the machine it runs on
(at registration) and its heartbeat, built from its typed progress (`reports.py`)."""

from __future__ import annotations

import os
import sys
import time

from disttrain.coordinator.reports import BalanceState, NodeProgress
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


def heartbeat_message(node_id: str, role: str, progress: NodeProgress, generation: int,
                      throughput: float = 0.0, step_time_s: float = 0.0) -> pb.HeartbeatMessage:
    """The heartbeat of node `node_id` at `progress`: the one place a HeartbeatMessage is
    built (the heartbeat thread's, and a DDP rank's final one).

    Args:
        generation: the generation the node registered in.
        throughput, step_time_s: samples/s and seconds per step, over whatever span the
            caller measured (0: unknown, e.g. no step finished).
    """
    balance = progress.balance or BalanceState()
    return pb.HeartbeatMessage(node_id=node_id, timestamp=time.time(), epoch=progress.epoch,
                               step=progress.step, role=role, throughput=throughput,
                               step_time_s=step_time_s, pid=os.getpid(), generation=generation,
                               batch_size=balance.batch_size, warmup_speed=balance.warmup_speed,
                               plans=balance.plans)
