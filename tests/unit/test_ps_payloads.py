"""The worker's side of compressed pushes: payloads cut per shard, residuals kept only
for the pushes a server took."""

from __future__ import annotations

import torch

from disttrain.compression import Compressor
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.wire.payloads import GradientEncoder, shard_segments
from disttrain.strategies.ps.wire.sharding import plan_shards

torch.set_num_threads(1)


def encoder_of(num_shards: int) -> GradientEncoder:
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Linear(30, 5))
    return GradientEncoder(Compressor("topk", ratio=0.1), plan_shards(model, num_shards))


def test_each_shard_is_compressed_on_its_own_and_decodes_to_its_slice():
    encoder = encoder_of(2)
    grads = torch.randn(sum(p.numel for p in encoder.plans))
    payloads = encoder.encode(grads, [0, 1])
    for plan, payload in zip(encoder.plans, payloads, strict=True):
        out = torch.empty(plan.numel)
        Compressor("topk", ratio=0.1).decode(payload.data, shard_segments(plan), out)
        kept = out.nonzero().flatten()
        assert torch.equal(out[kept], grads[plan.offset:plan.offset + plan.numel][kept])
    names = [name for plan in encoder.plans for name, _ in shard_segments(plan)]
    assert len(names) == len(set(names))  # residual keys never collide across shards


def test_a_push_refused_as_stale_keeps_the_old_residual():
    encoder = encoder_of(2)
    grads = torch.randn(sum(p.numel for p in encoder.plans))
    applied, stale = pb.PushReply(outcome=pb.PushReply.APPLIED), pb.PushReply(outcome=pb.PushReply.STALE)
    encoder.commit(encoder.encode(grads, [0, 1]), [applied, applied])
    before = {k: v.clone() for k, v in encoder.compressor.residuals.items()}
    encoder.commit(encoder.encode(grads * 3, [0, 1]), [stale, applied])
    shard0 = {name for name, _ in shard_segments(encoder.plans[0])}
    for name, residual in encoder.compressor.residuals.items():
        assert torch.equal(residual, before[name]) == (name in shard0), name
    scalars = encoder.scalars()
    assert scalars["compression/bytes_sent"] < scalars["compression/bytes_dense"]
    assert encoder.scalars()["compression/bytes_sent"] == 0  # since the last call
