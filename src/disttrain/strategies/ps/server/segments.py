"""A shard's shared-memory segments, one pair per worker on its machine (see
`wire.shared_memory` for what a segment is and how the names are kept out of /dev/shm).

A pair is offered at registration to a worker that connects from this host; a push that
says its bytes are in shared memory is read in place from the worker's gradient segment,
and a pull answered through shared memory is written into its parameter segment.
"""

from __future__ import annotations

import logging
import threading

from disttrain.strategies.ps.server.decisions import PushRefused
from disttrain.strategies.ps.server.validation import InvalidPush
from disttrain.strategies.ps.wire.codec import Payload, tensor_bytes
from disttrain.strategies.ps.wire.shared_memory import (
    SegmentPair,
    SharedMemoryUnavailable,
    available,
    sweep_stale,
)

logger = logging.getLogger(__name__)


class WorkerSegments:
    """A server shard's segment pairs, one per worker (thread-safe).

    Args:
        nbytes, dtype: the size and element type of the shard's payloads.
    """

    def __init__(self, nbytes: int, dtype: str):
        self.nbytes = nbytes
        self.dtype = dtype
        self._lock = threading.Lock()
        self._pairs: dict[str, SegmentPair] = {}
        if available():
            sweep_stale()

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._pairs)

    def offer(self, worker_id: str) -> SegmentPair | None:
        """Fresh segments for `worker_id` (replacing earlier ones), or None when this
        machine has none to give."""
        if not available():
            return None
        try:
            pair = SegmentPair.create(self.nbytes, self.dtype)
        except SharedMemoryUnavailable as e:
            logger.warning("no shared memory for worker %s (%s); its payloads use gRPC", worker_id, e)
            return None
        with self._lock:
            old = self._pairs.pop(worker_id, None)
            self._pairs[worker_id] = pair
        if old is not None:
            old.unlink()
        return pair

    def of(self, worker_id: str) -> SegmentPair | None:
        """The worker's segments, or None. Any call from the worker means it has mapped
        them or given up on them (another machine): either way their names can go now."""
        with self._lock:
            pair = self._pairs.get(worker_id)
        if pair is not None:
            pair.unlink()
        return pair

    def require(self, worker_id: str) -> SegmentPair:
        """The worker's segments. Raises PushRefused when it has none here."""
        pair = self.of(worker_id)
        if pair is None:
            raise PushRefused(f"worker {worker_id!r} has no shared-memory segments here; register "
                              "asking for them (from this host), or send the bytes")
        return pair

    def read_push(self, payload: Payload, nbytes: int) -> Payload:
        """A shared-memory push with its `nbytes` payload bytes, copied out of the
        worker's gradient segment.

        A copy: the checks (layout, finiteness) and the update must see the same bytes,
        and the worker can write its segment at any time, also between the two (an
        honest worker writes it only between the answer to one push and its next push;
        another could write NaN after the check, and a synchronous step applies its
        gradient later still).

        Raises:
            InvalidPush: the message carries payload bytes too.
            PushRefused: the worker has no segments here.
        """
        if payload.nbytes:
            raise InvalidPush(f"a shared-memory push also carries {payload.nbytes} payload bytes")
        pair = self.require(payload.header.worker_id)
        copied = bytearray(tensor_bytes(pair.gradient_tensor)[:nbytes])
        return Payload(payload.header, payload.meta, [memoryview(copied)])

    def drop(self, worker_id: str) -> None:
        """Forget the worker's segments (it registered again without asking for them)."""
        with self._lock:
            pair = self._pairs.pop(worker_id, None)
        if pair is not None:
            pair.unlink()

    def unlink_all(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.unlink()
