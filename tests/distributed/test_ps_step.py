"""Step: a push and the parameters it leads to in one round trip, on a real shard server.

Sync answers with the step the push joined, async at once; a refused push ends the
stream, changes nothing, and the next step opens a new one.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from disttrain.config import config_from_dict
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.wire.sharding import flat_parameters, plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model

pytestmark = pytest.mark.timeout(120)

Outcome = pb.PushReply.Outcome
LR = 0.5


def make_config(tmp_path, mode="sync", workers=2):
    return config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd", "momentum": 0.0,
                     "learning_rate": LR, "mlp_hidden_size": 32},
        "ps": {"aggregation_mode": mode},
        "system": {"num_workers": workers, "checkpoint_dir": str(tmp_path / "ckpt")}})


@contextmanager
def running(tmp_path, mode="sync", workers=2, transport="auto"):
    """A shard server and its registered clients, closed and stopped on the way out."""
    config = make_config(tmp_path, mode, workers)
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0")
    plan = plan_shards(init_model(config.training), 1)[0]
    initial = parameters_to_vector(init_model(config.training).parameters()).detach()
    made = []
    try:
        for rank in range(workers):
            made.append(PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0, max_attempts=3),
                                 transport))
            made[-1].register(f"w{rank}", rank, key=bytes([65 + rank]) * 32)
        yield server, made, plan, initial
    finally:
        for client in made:
            client.close()
        server.stop(0)


def header(rank, step=1, base_version=0):
    return pb.GradientMessage(worker_id=f"w{rank}", step=step, shard=0, base_version=base_version,
                              block_id=step * 10 + rank, num_samples=8)


def trade(client, rank, grads, flat, step=1, base_version=0, min_version=1):
    return client.step([header(rank, step, base_version)], grads, [0], flat, [min_version])


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_sync_step_answers_with_the_step_the_push_joined(tmp_path, transport):
    with running(tmp_path, transport=transport) as (server, clients, plan, initial):
        assert all(c.can_step(0) for c in clients)
        grads = [torch.full((plan.numel,), float(rank + 1)) for rank in range(2)]
        flats = [torch.zeros(plan.numel) for _ in range(2)]
        results = [None, None]
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(
            r, trade(clients[r], r, grads[r], flats[r]))) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        expected = initial - LR * (grads[0] + grads[1]) / 2  # equal samples: the plain mean
        for (replies, versions), flat in zip(results, flats, strict=True):
            assert {replies[0].outcome} <= {Outcome.Value("APPLIED"), Outcome.Value("BUFFERED")}
            assert versions == [1]
            torch.testing.assert_close(flat, expected)
        torch.testing.assert_close(server.state.parameters(), expected)
        assert server.state.version == 1


def test_async_step_answers_at_once_with_the_push_applied(tmp_path):
    with running(tmp_path, mode="async", workers=1) as (server, (client,), plan, initial):
        flat, grads = torch.zeros(plan.numel), torch.ones(plan.numel)
        for step in (1, 2):
            replies, versions = trade(client, 0, grads, flat, step, step - 1, 0)
            assert replies[0].outcome == Outcome.Value("APPLIED") and versions == [step]
        torch.testing.assert_close(flat, initial - 2 * LR * grads)


def test_a_refused_push_ends_the_stream_changes_nothing_and_the_next_step_goes_on(tmp_path):
    with running(tmp_path, mode="async", workers=1, transport="grpc") as (server, (client,), plan, initial):
        shard = client.shards[0]
        bad = pb.GradientMessage()
        bad.CopyFrom(header(0))
        bad.session = shard.session
        (message,) = wire.gradient_frames(bad, plan, memoryview(b"\x00" * (plan.nbytes - 4)))  # short
        with pytest.raises(Exception) as refused:
            shard.stream.exchange(message, 10.0)
        assert refused.value.code().name == "INVALID_ARGUMENT"
        assert server.state.version == 0
        torch.testing.assert_close(server.state.parameters(), initial)
        flat = torch.zeros(plan.numel)
        replies, versions = trade(client, 0, torch.ones(plan.numel), flat, 1, 0, 0)
        assert replies[0].outcome == Outcome.Value("APPLIED") and versions == [1]


def test_a_single_shard_model_lives_in_the_shared_segments(tmp_path):
    with running(tmp_path, mode="async", workers=1) as (server, (client,), plan, initial):
        buffers = client.shared_buffers()
        assert buffers is not None
        model = init_model(make_config(tmp_path, "async", 1).training)
        flat, grads = flat_parameters(model, *buffers)
        assert flat.data_ptr() == buffers[0].data_ptr() and grads.data_ptr() == buffers[1].data_ptr()
        torch.testing.assert_close(flat, initial)
        next(model.parameters()).grad.fill_(1.0)  # a backward pass writes here: the segment
        _, versions = trade(client, 0, grads, flat, 1, 0, 0)
        assert versions == [1]
        expected = initial.clone()
        expected[:next(model.parameters()).numel()] -= LR
        torch.testing.assert_close(flat, expected)  # landed in the model's own memory
        torch.testing.assert_close(server.state.parameters(), expected)


def test_over_grpc_the_model_keeps_its_own_memory(tmp_path):
    with running(tmp_path, mode="async", workers=1, transport="grpc") as (server, (client,), _, _):
        assert client.shared_buffers() is None
