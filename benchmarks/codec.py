"""Codec: encode + decode of 10 MB of gradients against a plain memory copy of the same bytes.

Encode is what a worker does before gRPC takes the bytes: frame the flat gradient into
~1 MB wire messages. Decode is what a server does with the received messages: split
header from payload and view each chunk as a tensor. Target: memcpy time / codec time
>= 0.5.
"""

from __future__ import annotations

import numpy as np
import torch
from common import median, parse_args, report, time_interleaved

from disttrain.core import tune_allocator
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps import ShardPlan, TensorSlice
from disttrain.strategies.ps.wire import codec
from disttrain.strategies.ps.wire import service as wire


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    torch.set_num_threads(1)
    tune_allocator()
    nbytes = 1_000_000 if args.quick else 10_000_000
    numel = nbytes // 4
    gradient = torch.randn(numel)
    plan = ShardPlan(0, 1, (TensorSlice("gradient", (numel,), 0, numel),), 0, numel, "float32")
    source, target = gradient.numpy(), np.empty_like(gradient.numpy())

    def memcpy() -> None:
        np.copyto(target, source)

    def encode_decode() -> None:
        header = pb.GradientMessage(worker_id="w", step=1, num_samples=64)
        frames = list(wire.gradient_frames(header, plan, codec.tensor_bytes(gradient)))
        payload = wire.collect_payload(iter([wire.read_gradient(f) for f in frames]), plan.nbytes)
        chunks = codec.decode_chunks(payload.chunks, plan.dtype)
        assert sum(c.numel() for c in chunks) == numel

    times = time_interleaved({"memcpy": memcpy, "codec": encode_decode}, max(args.repeats, 20))
    memcpy_s, codec_s = median(times["memcpy"]), median(times["codec"])
    report(
        "codec",
        {
            "bytes": nbytes,
            "memcpy_s": memcpy_s,
            "codec_s": codec_s,
            "codec_gb_per_s": nbytes / codec_s / 1e9,
            "ratio": memcpy_s / codec_s,
        },
        args.output,
        target="ratio >= 0.5",
    )


if __name__ == "__main__":
    main()
