"""Top-k's self-describing block: its own count, delta-coded indices, values in fp16
(`compression.compact`) or the gradient's dtype. Written where the count is not a
function of the block's size alone (the sparsity warm-up changes it step by step) or
where the bytes should be fewest (`compact`). All numbers little-endian:

- kind uint8: 0 dense, 1 sparse;
- dense: the `n` raw values (written only where not one index fits in fewer bytes than
  the dense values: a block of a few elements, see `encode_block`);
- sparse: uint32 count `k` (1 <= k <= n), uint32 `length` of the index bytes, then the
  indices as `length` bytes of LEB128 varints, each the gap to the previous index minus
  one (the first: the index itself), so indices are strictly ascending by construction
  (at a ratio of 1%, gaps of about 100: one or two bytes each instead of four); then
  the `k` values.

`decode_block` checks every field (kind, count, lengths, varint structure, index range,
finite values) and raises `InvalidPayload` before writing into `out`.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from disttrain.compression.schemes import FP16_MAX, InvalidPayload, _frombuffer, all_finite, little_endian

DENSE, SPARSE = 0, 1
_KIND = struct.Struct("<B")
_SPARSE_HEADER = struct.Struct("<BII")  # kind, count, index bytes
_MAX_VARINT = 5  # bytes of a 32-bit gap


def encode_gaps(indices: torch.Tensor) -> bytes:
    """Strictly ascending indices as LEB128 varints of their gaps minus one."""
    values = indices.numpy().astype(np.int64)
    gaps = np.diff(values, prepend=-1).astype(np.uint64) - np.uint64(1)
    widths = np.ones(gaps.size, dtype=np.int64)
    for bits in (7, 14, 21, 28):
        widths += gaps >= np.uint64(1 << bits)
    starts = np.cumsum(widths) - widths
    out = np.empty(int(widths.sum()), dtype=np.uint8)
    for j in range(_MAX_VARINT):
        has = widths > j
        chunk = (gaps[has] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (widths[has] > j + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + j] = (chunk | more).astype(np.uint8)
    return out.tobytes()


def decode_gaps(data: np.ndarray, count: int, n: int, name: str) -> torch.Tensor:
    """The `count` indices of the varint bytes `data` (uint8), each checked in [0, n).

    Raises:
        InvalidPayload: a varint is unterminated or too long, the count is wrong, or an
            index falls outside the block.
    """
    ends = (data & 0x80) == 0
    if data.size == 0 or not ends[-1]:
        raise InvalidPayload(f"{name}: the index bytes end inside a varint")
    if int(ends.sum()) != count:
        raise InvalidPayload(f"{name}: the index bytes hold {int(ends.sum())} varints, expected {count}")
    group = np.concatenate(([0], np.cumsum(ends[:-1])))
    firsts = np.flatnonzero(np.concatenate(([True], ends[:-1])))
    position = np.arange(data.size) - firsts[group]
    if int(position.max()) >= _MAX_VARINT:
        raise InvalidPayload(f"{name}: a varint index gap is longer than {_MAX_VARINT} bytes")
    # Each term is below 2**35 and a gap has at most 5 of them: float64 adds them exactly.
    weights = (data & 0x7F).astype(np.float64) * np.exp2(7.0 * position)
    gaps = np.bincount(group, weights=weights, minlength=count)
    if float(gaps.max()) >= n:
        raise InvalidPayload(f"{name}: a top-k index gap of {int(gaps.max())} leaves a block of {n} elements")
    indices = np.cumsum(gaps.astype(np.int64) + 1) - 1  # each gap < n, so no overflow for n < 2**31
    if int(indices[-1]) >= n:
        raise InvalidPayload(f"{name}: top-k indices reach {int(indices[-1])}, outside [0, {n})")
    return torch.from_numpy(indices)


def encode_block(x: torch.Tensor, indices: torch.Tensor, half: bool
                 ) -> tuple[bytes, torch.Tensor, torch.Tensor | None]:
    """The block of `x` (1-D) keeping `indices` (strictly ascending): sparse while it is
    smaller than the dense values; where it is not, sparse with the largest of `indices`
    that surely fit (error feedback keeps the rest); dense, with its kind byte, only where
    not one fits (a block of a few elements). So a block never takes more than the dense
    values, but for those few-element blocks, which take one byte more. Returns the bytes,
    what the receiver decodes from them, and the indices kept (None: dense, all of them)."""
    dense_nbytes = x.numel() * x.element_size()
    value_size = 2 if half else x.element_size()
    written = _sparse(x, indices, half)
    if len(written[0]) < dense_nbytes:
        return written
    fit = (dense_nbytes - 1 - _SPARSE_HEADER.size) // (_MAX_VARINT + value_size)
    if fit < 1:
        return _KIND.pack(DENSE) + little_endian(x), x, None
    largest = torch.topk(x[indices].abs(), min(fit, indices.numel()), sorted=False).indices
    return _sparse(x, torch.sort(indices[largest]).values, half)


def _sparse(x: torch.Tensor, indices: torch.Tensor, half: bool
            ) -> tuple[bytes, torch.Tensor, torch.Tensor | None]:
    values = x[indices]
    if half:
        values = values.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    gaps = encode_gaps(indices)
    decoded = torch.zeros_like(x)
    decoded[indices] = values.to(x.dtype)
    return b"".join((_SPARSE_HEADER.pack(SPARSE, indices.numel(), len(gaps)), gaps,
                     little_endian(values))), decoded, indices


def max_block_nbytes(n: int, itemsize: int) -> int:
    """The most bytes a block of `n` elements takes (the encoder never writes more than dense)."""
    return _KIND.size + n * itemsize


def decode_block(data: memoryview, offset: int, out: torch.Tensor, half: bool, name: str) -> int:
    """Read the block at `offset` of `data` into `out` (1-D, the block's length); returns
    the offset after it.

    Raises:
        InvalidPayload: short bytes, an unknown kind, a wrong count or length, a bad index
            or a non-finite value.
    """
    n, itemsize = out.numel(), out.element_size()
    if offset + _KIND.size > data.nbytes:
        raise InvalidPayload(f"{name}: payload ends at byte {data.nbytes}, before the block's kind")
    (kind,) = _KIND.unpack_from(data, offset)
    if kind == DENSE:
        end = offset + _KIND.size + n * itemsize
        if end > data.nbytes:
            raise InvalidPayload(f"{name}: payload ends at byte {data.nbytes}, the dense block needs {end}")
        values = _frombuffer(data, out.dtype, n, offset + _KIND.size)
        if not all_finite(values):
            raise InvalidPayload(f"{name}: decodes to NaN or infinite values")
        out.copy_(values)
        return end
    if kind != SPARSE:
        raise InvalidPayload(f"{name}: block kind {kind} is neither dense (0) nor sparse (1)")
    if offset + _SPARSE_HEADER.size > data.nbytes:
        raise InvalidPayload(f"{name}: payload ends at byte {data.nbytes}, inside the top-k header")
    _, count, length = _SPARSE_HEADER.unpack_from(data, offset)
    if not 1 <= count <= n:
        raise InvalidPayload(f"{name}: top-k count {count} is outside [1, {n}]")
    if not count <= length <= _MAX_VARINT * count:
        raise InvalidPayload(f"{name}: {length} index bytes cannot hold {count} varints")
    value_type = torch.float16 if half else out.dtype
    value_size = 2 if half else itemsize
    start = offset + _SPARSE_HEADER.size
    end = start + length + count * value_size
    if end > data.nbytes:
        raise InvalidPayload(f"{name}: payload ends at byte {data.nbytes}, the top-k block needs {end}")
    raw = np.frombuffer(data, dtype=np.uint8, count=length, offset=start)
    indices = decode_gaps(raw, count, n, name)
    values = _frombuffer(data, value_type, count, start + length)
    if not all_finite(values):
        raise InvalidPayload(f"{name}: decodes to NaN or infinite values")
    out.zero_()
    out[indices] = values.to(out.dtype)
    return end
