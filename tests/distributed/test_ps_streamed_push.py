"""A shard larger than a piece, pushed through gRPC with overlap on, is streamed while
backward still computes: its pieces leave last first as backward writes them, so even a
run of one shard sends before backward ends (a bucket finer than the shard). On a real
shard server: the first frame reaches the server before backward has produced the first
layer's gradient; the run ends where one process ends; a gradient with NaN stops the
stream before its last piece, and the shard applies nothing; a reply lost after a
streamed push is answered again and applied once."""

from __future__ import annotations

import threading

import pytest
import torch

from disttrain.core.errors import TrainingError
from disttrain.metrics.window import StepTimer
from disttrain.strategies.ps.wire import service
from disttrain.strategies.ps.wire.codec import CHUNK_BYTES
from tests.distributed.test_ps_overlap import Cluster, batches, one_process, poison
from tests.distributed.test_ps_server import make_config

pytestmark = pytest.mark.timeout(90)

STEPS = 3


def wide_config(tmp_path):
    """An MLP of about 8.7 MB on digits: one shard of it is nine pieces, more than one
    Step message carries (so it is pushed apart from its pull)."""
    return make_config(tmp_path, ps={"payload_transport": "grpc"}).replace(
        training={"mlp_hidden_size": 1024, "mlp_num_layers": 3})


def one_shard(config, overlap: bool = True, before=None) -> Cluster:
    """One real shard server and one registered worker pushing to it through gRPC, each
    push of more than one piece (streamed with overlap)."""
    cluster = Cluster(config, overlap, before=before, shards=1, transport="grpc")
    assert cluster.client.streams(0) and cluster.plans[0].nbytes > 8 * CHUNK_BYTES
    return cluster


def watch_frames(monkeypatch) -> threading.Event:
    """An event set when the server reads a frame of a push streamed from its end."""
    arrived = threading.Event()
    read = service.read_gradient

    def reading(raw, max_fields=None):  # the server reads each frame of a push with this
        frame = read(raw, max_fields)
        if frame.header.from_end:
            arrived.set()
        return frame

    monkeypatch.setattr(service, "read_gradient", reading)
    return arrived


def test_a_streamed_push_reaches_the_shard_before_backward_ends_and_ends_where_one_process_ends(
        tmp_path, monkeypatch):
    arrived = watch_frames(monkeypatch)
    seen = []

    def before(model):
        def hook(_param) -> None:  # the first layer's weight: the last gradient backward writes
            seen.append(arrived.wait(timeout=20))
            arrived.clear()

        next(model.parameters()).register_post_accumulate_grad_hook(hook)

    config = wide_config(tmp_path)
    shard = one_shard(config, before=before)
    try:
        timers = []
        for step, (inputs, targets) in enumerate(batches(), start=1):
            timers.append(StepTimer())
            shard.step(step, inputs, targets, timers[-1])
        # the shard's first frame (its last piece) arrived while backward had the first
        # layer still to compute, at every step
        assert seen == [True] * STEPS
        torch.testing.assert_close(shard.parameters(), one_process(config), rtol=1e-5, atol=1e-6)
        assert torch.equal(shard.flat, shard.parameters())
        assert shard.exchange.versions == [STEPS]
        assert all(t.drain()["time/comm_overlapped_s"] > 0 for t in timers)
    finally:
        shard.close()


def test_a_streamed_push_ends_where_the_plain_push_ends(tmp_path):
    ends = []
    for overlap in (False, True):
        config = wide_config(tmp_path).replace(system={"checkpoint_dir": str(tmp_path / f"ckpt{overlap}")})
        shard = one_shard(config, overlap)
        try:
            for step, (inputs, targets) in enumerate(batches(), start=1):
                shard.step(step, inputs, targets)
            ends.append(shard.parameters())
        finally:
            shard.close()
    assert torch.equal(ends[0], ends[1])


def test_a_gradient_with_nan_stops_the_stream_before_its_last_piece(tmp_path, monkeypatch):
    """NaN in the last layer: its piece is the stream's first, sent before the gradient is
    whole; the check of the whole stops the stream, and the shard applies nothing."""
    arrived = watch_frames(monkeypatch)
    seen = []

    def before(model):
        def first_layer(_param) -> None:
            seen.append(arrived.wait(timeout=20))

        poison(-1)(model)
        next(model.parameters()).register_post_accumulate_grad_hook(first_layer)

    config = wide_config(tmp_path)
    shard = one_shard(config, before=before)
    try:
        parameters = shard.parameters().clone()
        inputs, targets = batches()[0]
        with pytest.raises(TrainingError, match="no shard was sent"):
            shard.step(1, inputs, targets)
        assert seen == [True]  # the stream had begun, the poisoned piece first
        assert shard.servers[0].state.version == 0
        assert torch.equal(shard.parameters(), parameters)
        assert set(shard.client.ledger(0, 0)[0]) == set()
    finally:
        shard.close()


def test_a_reply_lost_after_a_streamed_push_is_answered_again_and_applied_once(tmp_path):
    config = wide_config(tmp_path)
    shard = one_shard(config)
    try:
        for step, (inputs, targets) in enumerate(batches(), start=1):
            if step == 2:
                shard.client.lose_next_replies()
            shard.step(step, inputs, targets)
        torch.testing.assert_close(shard.parameters(), one_process(config), rtol=1e-5, atol=1e-6)
        assert shard.servers[0].state.version == STEPS
        assert set(shard.client.ledger(0, 0)[0]) == {1, 2, 3}
    finally:
        shard.close()
