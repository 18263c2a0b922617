"""Gradient compression, independent of any transport: compressors with their state
(error-feedback residuals, byte counters, seeded RNG) and the payload format they write.
The parameter server sends their payloads over gRPC or shared memory; DDP all-gathers
them in communication hooks."""

from disttrain.compression.compressor import Compressor, Counters, Encoded, Segment
from disttrain.compression.schemes import SCHEMES, InvalidPayload, all_finite, topk_count

__all__ = ["SCHEMES", "Compressor", "Counters", "Encoded", "InvalidPayload", "Segment",
           "all_finite", "topk_count"]
