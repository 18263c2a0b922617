"""Gradient compression, independent of any transport: compressors with their state
(error-feedback residuals, byte counters, seeded RNG) and the payload format they write.
The parameter server sends their payloads over gRPC or shared memory; DDP all-gathers
them in communication hooks."""

from disttrain.compression.compressor import Compressor, Counters, Encoded, Segment
from disttrain.compression.schemes import SCHEMES, InvalidPayload, topk_count
from disttrain.config import CompressionConfig


def from_config(section: CompressionConfig, seed: int) -> Compressor:
    """The compressor a run's `compression` section asks for (a payload scheme, not powersgd).

    Args:
        seed: seeds stochastic rounding; pass a different one per process.
    """
    return Compressor(section.type, section.ratio, section.error_feedback,
                      section.stochastic_rounding, seed)


__all__ = ["SCHEMES", "Compressor", "Counters", "Encoded", "InvalidPayload", "Segment",
           "from_config", "topk_count"]
