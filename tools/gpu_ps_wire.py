"""The GPU check's parameter-server step: tensors on a device through a real shard.

A worker whose model lives on a GPU hands the parameter-server client CUDA tensors: the
flat gradient it pushes, and the flat parameters the answer lands in. This starts a real
shard server (gRPC on a loopback port, or shared memory beside it with `auto`), registers
one client, and runs steps in async mode (each push applied on arrival by SGD), checking
after each that the device tensor holds exactly the shard's update, and timing them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector

from disttrain.config import config_from_dict
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps import PSClient, RetryPolicy, ShardServer, build_state, plan_shards
from disttrain.training import init_model

LEARNING_RATE = 0.5
STEPS = 6  # the first is a warm-up, left out of the timing


def exchange(folder: Path, device: torch.device, transport: str, hidden_size: int) -> dict[str, Any]:
    """Push gradients from `device` and pull parameters into `device`, STEPS times.

    Returns:
        The transport, device, parameter count, bytes moved per second (pushed plus pulled,
        over the timed steps) and whether every pulled tensor matched the expected update.
    """
    config = config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd", "momentum": 0.0,
                     "learning_rate": LEARNING_RATE, "mlp_hidden_size": hidden_size, "mlp_num_layers": 2},
        "ps": {"aggregation_mode": "async"},
        "system": {"num_workers": 1, "checkpoint_dir": str(folder / "ckpt")}})
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0")
    client = None
    try:
        plan = plan_shards(init_model(config.training), 1)[0]
        client = PSClient([server.address], [plan], RetryPolicy(timeout_s=30.0, max_attempts=3), transport)
        client.register("w0", 0)
        expected = parameters_to_vector(init_model(config.training).parameters()).detach().to(device)
        generator = torch.Generator().manual_seed(0)
        grads = (torch.randn(plan.numel, generator=generator) * 1e-3).to(device)
        flat = torch.zeros(plan.numel, device=device)
        matches, worst, started = True, 0.0, 0.0
        for step in range(1, STEPS + 1):
            if step == 2:
                _synchronize(device)
                started = time.perf_counter()
            header = pb.GradientMessage(worker_id="w0", step=step, shard=0, base_version=step - 1,
                                        block_id=step, num_samples=8)
            _, versions = client.step([header], grads, [0], flat, [0])
            expected -= LEARNING_RATE * grads
            worst = max(worst, float((flat - expected).abs().max()))
            matches = matches and versions == [step] and flat.device.type == device.type and \
                torch.allclose(flat, expected, rtol=1e-5, atol=1e-6)
        _synchronize(device)
        elapsed = time.perf_counter() - started
        return {"transport": transport, "device": str(device), "parameters": plan.numel,
                "steps_timed": STEPS - 1, "seconds": elapsed,
                "gb_per_s": 2 * plan.nbytes * (STEPS - 1) / elapsed / 1e9,
                "shared_memory": client.shared_buffers() is not None, "max_abs_diff": worst,
                "matches": matches}
    finally:
        if client is not None:
            client.close()
        server.stop(0)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
