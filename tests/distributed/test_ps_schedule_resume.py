"""A parameter-server shard restarted from its checkpoint goes on along the same
learning-rate curve: its count of updates travels in the checkpoint with the optimizer
state, so the restored shard applies the next pushes bit for bit as the one that ran on,
and tells each push the rate it applied it with."""

from __future__ import annotations

import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.core.checkpoint import latest_checkpoint, load_checkpoint
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.shard import WorkerClaim
from disttrain.strategies.ps.wire import service as wire
from tests.distributed.test_ps_server import frames

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32
SAVED_AT, LAST = 6, 10


def config(tmp_path):
    return config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "mlp_hidden_size": 16,
                     "optimizer": "adamw", "weight_decay": 0.1, "learning_rate": 0.01,
                     "lr_schedule": "cosine", "warmup_steps": 3, "lr_decay_steps": LAST, "lr_min": 0.001,
                     "clip_grad_norm": 0.5, "checkpoint_interval": SAVED_AT},
        "system": {"num_workers": 1, "checkpoint_dir": str(tmp_path / "ckpt")},
        "ps": {"aggregation_mode": "async"}})


def push(state, session, step, gradient):
    pieces = frames(state.plan, gradient, step=step, session=session)
    payload = wire.collect_payload((wire.read_gradient(raw) for raw in pieces), 2 * state.plan.nbytes)
    decision = state.push(payload)
    assert decision.outcome.name == "APPLIED"
    return decision.learning_rate  # what the reply tells the worker


def test_a_restored_shard_continues_the_schedule_bit_identically(tmp_path):
    settings = config(tmp_path)
    generator = torch.Generator().manual_seed(5)
    running = build_state(settings, 0, 1)
    gradients = [torch.randn(running.plan.numel, generator=generator) * 3 for _ in range(LAST)]
    session = running.register(WorkerClaim("w0", KEY, 0), 0).session
    rates = []
    for step in range(1, LAST + 1):
        told = push(running, session, step, gradients[step - 1])
        rates.append(running.optimizer.param_groups[0]["lr"])
        assert told == rates[-1]  # the reply carries the rate the push was applied with
        if step == SAVED_AT:
            running.flush_checkpoints()
    saved = load_checkpoint(latest_checkpoint(tmp_path / "ckpt" / "server0"))
    assert saved["version"] == SAVED_AT and saved["schedule"] == {"num_steps": SAVED_AT}
    # The curve: warm-up over 3 updates, then down to the floor at the last one.
    assert rates[:3] == pytest.approx([0.01 / 3, 0.02 / 3, 0.01]) and rates[-1] > 0.001
    assert running.shard_optimizer.num_clipped > 0

    restored = build_state(settings, 0, 1, resume=True)
    assert restored.version == SAVED_AT and restored.shard_optimizer.state.num_steps == SAVED_AT
    session = restored.register(WorkerClaim("w0", KEY, 0), 0).session
    for step in range(SAVED_AT + 1, LAST + 1):
        assert push(restored, session, step, gradients[step - 1]) == rates[step - 1]
    assert restored.optimizer.param_groups[0]["lr"] == rates[-1]
    assert torch.equal(restored.parameters(), running.parameters())
    running.stop()
    restored.stop()
