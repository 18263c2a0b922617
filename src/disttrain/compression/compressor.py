"""A compressor with its state: error-feedback residuals, byte counters, a seeded RNG.

`encode` turns a flat gradient, cut into named segments, into one payload. With error
feedback, what a segment's payload leaves out is kept (the residual, per segment name)
and added to that segment's next gradient, so over many steps everything is sent. The
new residuals wait in the `Encoded` result until the caller `commit`s it, once the
payload was taken (a parameter server may refuse a push as too stale: then the
gradient is recomputed and the old residual must still hold). Residuals are keyed by
segment name, not by position, so they survive buckets or shards being cut anew.

Stochastic rounding draws each tensor's noise from a generator of its own, seeded by
(seed, tensor name, how many payloads of it were taken), so the noise does not depend on
the order tensors are encoded in (DDP's bucket order changes once, after its first step).

Top-k may apply DGC's training rules (`dgc`: momentum correction, momentum factor
masking, local clipping, sparsity warm-up): the velocities and the payloads taken per
segment wait in the `Encoded` result like the residuals. Under a warm-up or with
`compact`, a top-k block is written in the self-describing format of `compact`, whose
length varies; `payload_nbytes` is then its upper bound.

`state_dict` holds tensors and numbers only, for a `weights_only` checkpoint; restored,
a run goes on bit for bit as if it had not stopped.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field
from typing import Any

import numpy as np
import torch

from disttrain.compression import compact, dgc
from disttrain.compression.dgc import DgcRules
from disttrain.compression.schemes import (
    SCHEMES,
    InvalidPayload,
    _encode_topk,
    _top_indices,
    decode_segment,
    encode_segment,
    goes_dense,
    segment_nbytes,
    topk_count,
)
from disttrain.config import CompressionConfig

logger = logging.getLogger(__name__)

Segment = tuple[str, int]  # (name, number of elements)
_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: nearby integers in, unrelated 64-bit integers out."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


@dataclass
class Encoded:
    """One payload, and what committing it changes."""

    data: bytes
    dense_bytes: int  # the same gradient uncompressed
    dense_segments: int = 0  # segments sent raw: compressing them would not have paid
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    drawn: list[str] = field(default_factory=list)  # segments that drew rounding noise
    velocities: dict[str, torch.Tensor] = field(default_factory=dict)  # momentum correction's u

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass
class Counters:
    """Bytes before and after compression, tensors sent raw, seconds spent: a compressor's
    totals since the run started (a resumed run goes on counting), or one step's."""

    bytes_dense: int = 0
    bytes_sent: int = 0
    dense_segments: int = 0  # segment payloads sent raw because compressing would not pay
    seconds: float = 0.0

    def since(self, earlier: Counters) -> Counters:
        """What was counted after `earlier` (an earlier copy of these totals)."""
        return Counters(*(now - then for now, then in zip(astuple(self), astuple(earlier), strict=True)))

    def scalars(self) -> dict[str, float]:
        """The figures under their metric keys."""
        return {"compression/bytes_dense": self.bytes_dense, "compression/bytes_sent": self.bytes_sent,
                "compression/dense_segments": self.dense_segments, "time/compression_s": self.seconds}


class Compressor:
    """One process's compressor. Not thread-safe: encode from one thread.

    Args:
        scheme: quantization, topk, fp16 or bf16.
        ratio: topk's share of elements kept per segment, in (0, 1].
        error_feedback: keep what was not sent and add it to the next gradient.
        rounding_seed: quantization rounds up with the fraction's probability (unbiased),
            drawing from a generator seeded with it; None: to nearest.
        rules: topk: DGC's training rules (None: none).
        compact: topk: values in fp16 and delta-coded indices (`compact`).
    Raises:
        ValueError: an unknown scheme, a ratio outside (0, 1], rules or `compact` for a
            scheme other than topk, or momentum correction without error feedback.
    """

    def __init__(self, scheme: str, ratio: float = 0.01, error_feedback: bool = True,
                 rounding_seed: int | None = None, rules: DgcRules | None = None, compact: bool = False):
        if scheme not in SCHEMES:
            raise ValueError(f"unknown compression scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
        if not 0 < ratio <= 1:
            raise ValueError(f"compression ratio {ratio} must be in (0, 1]")
        if (rules is not None or compact) and scheme != "topk":
            raise ValueError(f"DGC's rules and compact payloads are top-k's; the scheme is {scheme}")
        if rules is not None and rules.momentum and not error_feedback:
            raise ValueError("momentum correction accumulates what was not sent: it needs error feedback")
        self.rules = rules
        self.compact = compact
        # The self-describing block: its count varies under a warm-up, its length with compact.
        self.variable = compact or (rules is not None and rules.warmup_steps > 0)
        self.velocities: dict[str, torch.Tensor] = {}  # segment -> momentum correction's u
        self.steps: dict[str, int] = {}  # segment -> payloads of it taken (warm-up)
        self.scheme = scheme
        self.ratio = ratio
        self.error_feedback = error_feedback
        self.seed = rounding_seed or 0
        self.stochastic = rounding_seed is not None and scheme == "quantization"
        self.draws: dict[str, int] = {}  # segment -> payloads of it taken (stochastic rounding)
        self._bits = np.random.PCG64(0)
        self._generator = np.random.Generator(self._bits)
        self.residuals: dict[str, torch.Tensor] = {}
        self.counters = Counters()
        self._told_dense: set[str] = set()

    @classmethod
    def from_config(cls, section: CompressionConfig, seed: int, num_workers: int = 1) -> Compressor:
        """The compressor a run's `compression` section asks for (a payload scheme, not
        powersgd); `seed` seeds stochastic rounding: pass each process its own;
        `num_workers` scales DGC's local clipping (N^-1/2). A receiver, which only decodes,
        may pass any seed and worker count."""
        topk = section.type == "topk"
        return cls(section.type, section.ratio, section.error_feedback,
                   seed if section.stochastic_rounding else None,
                   DgcRules.of(section, num_workers) if topk else None, section.compact and topk)

    def blocks(self, segments: Sequence[Segment]) -> list[tuple[str, int, list[Segment]]]:
        """How a payload is written: (name, elements, segments) of each block, in order.

        `topk` picks its k over the whole payload, so each tensor's share follows the size
        of its gradients (k per tensor gave SimpleCNN's first convolution 3 of its 288
        values a step, however large; in a simulation of two synchronous workers on MNIST
        it lost 0.9 points of test accuracy where k over the payload lost 0.3). The other
        schemes write each tensor on its own (quantization: its own int8 range).
        """
        if self.scheme == "topk" and len(segments) > 1:
            name = f"{segments[0][0]}..{segments[-1][0]}"
            return [(name, sum(n for _, n in segments), list(segments))]
        return [(name, n, [(name, n)]) for name, n in segments]

    def payload_nbytes(self, segments: Sequence[Segment], itemsize: int) -> int:
        """Bytes of the payload of a gradient cut into `segments` (self-describing top-k
        blocks: the most it can take)."""
        if self.variable:
            return sum(compact.max_block_nbytes(n, itemsize) for _, n, _ in self.blocks(segments))
        return sum(segment_nbytes(self.scheme, n, itemsize, self.ratio) for _, n, _ in self.blocks(segments))

    def encode(self, flat: torch.Tensor, segments: Sequence[Segment]) -> Encoded:
        """The payload of `flat` (1-D, the segments' total length); `flat` is not changed."""
        if self.rules is not None or self.variable:
            return self._encode_topk(flat, segments)
        pieces: list[bytes] = []
        residuals: dict[str, torch.Tensor] = {}
        offset, num_dense, drawn = 0, 0, []
        for name, n, parts in self.blocks(segments):
            x = flat[offset:offset + n]
            offset += n
            dense = goes_dense(self.scheme, n, x.element_size(), self.ratio)
            if dense:
                num_dense += 1
                self._tell_dense(name, n)
            elif self.error_feedback and any(part in self.residuals for part, _ in parts):
                x = x + self._kept(self.residuals, parts, x)
            noise = None
            if self.stochastic and not dense:
                noise = self._noise(name)
                drawn.append(name)
            written, decoded = encode_segment(self.scheme, x, self.ratio, noise)
            pieces.extend(written)
            if self.error_feedback and not dense:
                residuals.update(self._split(x - decoded, parts))
        self._check_covered(offset, flat)
        data = b"".join(pieces)
        return Encoded(data, flat.numel() * flat.element_size(), num_dense, residuals, drawn)

    def _encode_topk(self, flat: torch.Tensor, segments: Sequence[Segment]) -> Encoded:
        """Top-k with DGC's rules (`dgc`) and/or the self-describing block (`compact`)."""
        rules = self.rules or DgcRules()
        pieces: list[bytes] = []
        residuals: dict[str, torch.Tensor] = {}
        velocities: dict[str, torch.Tensor] = {}
        offset, num_dense = 0, 0
        for name, n, parts in self.blocks(segments):
            x = flat[offset:offset + n]
            offset += n
            if rules.clip_norm:
                x = dgc.clip_parts(x, [size for _, size in parts], rules.clip_norm)
            velocity = self._kept(self.velocities, parts, x) if rules.momentum else None
            residual = self._kept(self.residuals, parts, x) if self.error_feedback else None
            x, velocity = dgc.accumulate(x, velocity, residual, rules.momentum)
            ratio = rules.ratio_at(self.steps.get(parts[0][0], 0), self.ratio) if parts else self.ratio
            k = topk_count(n, ratio) if n else 0
            if self.variable:
                indices = _top_indices(x, k) if k else torch.zeros(0, dtype=torch.int64)
                written, decoded, indices = compact.encode_block(x, indices, self.compact)
                pieces.append(written)
                dense = indices is None
            else:
                dense = goes_dense(self.scheme, n, x.element_size(), ratio)
                indices = None if dense else _top_indices(x, k)
                written_pieces, decoded = (encode_segment(self.scheme, x, ratio, None) if dense
                                           else _encode_topk(x, k, indices))
                pieces.extend(written_pieces)
            if dense:
                num_dense += 1
                self._tell_dense(name, n)
            if self.error_feedback:
                residuals.update(self._split(x - decoded, parts))
            if velocity is not None:
                if rules.masking:  # momentum factor masking: what was sent stops pushing
                    if dense:
                        velocity = torch.zeros_like(velocity)
                    else:  # the block's own copy (`_kept` concatenates), not x: x is v + u
                        velocity[indices] = 0.0
                velocities.update(self._split(velocity, parts))
        self._check_covered(offset, flat)
        return Encoded(b"".join(pieces), flat.numel() * flat.element_size(), num_dense, residuals,
                       [name for name, _ in segments], velocities)

    @staticmethod
    def _kept(kept: dict[str, torch.Tensor], parts: Sequence[Segment], like: torch.Tensor) -> torch.Tensor:
        """The block's state laid out as the block (zeros for a part without one yet): a new
        tensor, which the caller may write."""
        return torch.cat([kept[part] if part in kept else like.new_zeros(size) for part, size in parts]) \
            if parts else like.new_zeros(0)

    @staticmethod
    def _split(block: torch.Tensor, parts: Sequence[Segment]) -> dict[str, torch.Tensor]:
        return dict(zip([part for part, _ in parts], block.split([size for _, size in parts]), strict=True))

    @staticmethod
    def _check_covered(offset: int, flat: torch.Tensor) -> None:
        if offset != flat.numel():
            raise ValueError(f"segments cover {offset} elements of a gradient of {flat.numel()}")

    def commit(self, encoded: Encoded) -> None:
        """The payload was taken: its residuals replace the old ones, its bytes count."""
        self.residuals.update(encoded.residuals)
        self.velocities.update(encoded.velocities)
        taken = self.draws if self.stochastic else self.steps
        for name in encoded.drawn:
            taken[name] = taken.get(name, 0) + 1
        self.counters.bytes_dense += encoded.dense_bytes
        self.counters.bytes_sent += encoded.nbytes
        self.counters.dense_segments += encoded.dense_segments

    def decode(self, data: bytes | memoryview, segments: Sequence[Segment], out: torch.Tensor,
               padded: bool = False) -> None:
        """Write the gradient of a payload into `out` (1-D, the segments' total length).

        `padded`: `data` may run on past the payload (it was read as `payload_nbytes`
        from a buffer the sender wrote less of); only self-describing top-k blocks, whose
        length the bytes tell, can be padded.

        Raises:
            InvalidPayload: the payload's length does not match the segments, or a segment
                does not decode (`out` may then hold part of it: decode into scratch).
        """
        data = memoryview(data).cast("B")
        expected = self.payload_nbytes(segments, out.element_size())
        if self.variable:
            self._decode_variable(data, segments, out, padded)
            return
        if data.nbytes != expected:
            raise InvalidPayload(f"{self.scheme} payload has {data.nbytes} bytes, expected {expected} "
                                 f"for {len(segments)} segment(s) of {out.numel()} elements")
        offset, start = 0, 0
        for name, n, _ in self.blocks(segments):
            offset = decode_segment(self.scheme, data, offset, out[start:start + n], self.ratio, name)
            start += n

    def _decode_variable(self, data: memoryview, segments: Sequence[Segment], out: torch.Tensor,
                         padded: bool) -> None:
        bound = self.payload_nbytes(segments, out.element_size())
        if data.nbytes > bound and not padded:
            raise InvalidPayload(f"topk payload has {data.nbytes} bytes, more than the {bound} that "
                                 f"{len(segments)} segment(s) of {out.numel()} elements can take")
        offset, start = 0, 0
        for name, n, _ in self.blocks(segments):
            offset = compact.decode_block(data, offset, out[start:start + n], self.compact, name)
            start += n
        if offset != data.nbytes and not padded:
            raise InvalidPayload(f"topk payload has {data.nbytes} bytes, its blocks end at byte {offset}")

    def _noise(self, name: str) -> np.random.Generator:
        """The generator of the next payload of `name`: its state is a function of (seed,
        name, payloads of it taken). Setting PCG64's state costs 2 us where seeding a new
        generator through numpy's SeedSequence costs 100 us per tensor and step."""
        key = _mix((self.seed << 32) ^ zlib.crc32(name.encode()))
        position = _mix(key ^ self.draws.get(name, 0))
        self._bits.state = {"bit_generator": "PCG64", "state": {"state": key << 64 | position,
                                                                "inc": position << 64 | key | 1},
                            "has_uint32": 0, "uinteger": 0}
        return self._generator

    def _tell_dense(self, name: str, n: int) -> None:
        if name not in self._told_dense:
            self._told_dense.add(name)
            logger.info("%s (%d elements) goes uncompressed: %s would not make it smaller",
                        name, n, self.scheme)

    def state_dict(self) -> dict[str, Any]:
        c = self.counters
        state = {"scheme": self.scheme, "residuals": {k: v.clone() for k, v in self.residuals.items()},
                 "counters": [c.bytes_dense, c.bytes_sent, c.dense_segments, c.seconds]}
        if self.stochastic:
            state["draws"] = dict(self.draws)
        if self.rules is not None:
            state["velocities"] = {k: v.clone() for k, v in self.velocities.items()}
            state["steps"] = dict(self.steps)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["scheme"] != self.scheme:
            raise ValueError(f"the checkpoint was written with {state['scheme']} compression and this "
                             f"run uses {self.scheme}; resume with compression.type={state['scheme']}")
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        dense, sent, segments, seconds = state["counters"]
        self.counters = Counters(int(dense), int(sent), int(segments), float(seconds))
        if self.stochastic:
            self.draws = {name: int(count) for name, count in state.get("draws", {}).items()}
        if self.rules is not None:
            self.velocities = {k: v.clone() for k, v in state.get("velocities", {}).items()}
            self.steps = {name: int(count) for name, count in state.get("steps", {}).items()}
