"""Shared-memory segments: made and mapped across two handles, checked, never left behind."""

import pytest
import torch

from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.wire import shared_memory
from disttrain.strategies.ps.wire.shared_memory import Segment, SegmentPair, SharedMemoryUnavailable

pytestmark = pytest.mark.skipif(not shared_memory.available(), reason="no /dev/shm here")


def offer_of(pair: SegmentPair) -> pb.SharedMemoryOffer:
    return pb.SharedMemoryOffer(gradient_path=str(pair.gradient.path),
                                parameter_path=str(pair.parameter.path), nonce=pair.gradient.nonce)


def test_both_sides_see_the_same_bytes_and_no_name_is_left():
    server = SegmentPair.create(4 * 1000, "float32")
    assert server.gradient.path.exists() and oct(server.gradient.path.stat().st_mode)[-3:] == "600"
    worker = SegmentPair.attach(offer_of(server), 4 * 1000, "float32")
    assert not server.gradient.path.exists() and not server.parameter.path.exists()
    worker.gradient_tensor.copy_(torch.arange(1000.0))
    assert torch.equal(server.gradient_tensor, torch.arange(1000.0))
    server.parameter_tensor.fill_(7.0)
    assert torch.equal(worker.parameter_tensor, torch.full((1000,), 7.0))
    server.unlink()  # idempotent


def test_another_run_or_size_is_refused():
    server = SegmentPair.create(64, "float32")
    try:
        wrong_nonce = offer_of(server)
        wrong_nonce.nonce = b"x" * 16
        with pytest.raises(SharedMemoryUnavailable, match="another run"):
            SegmentPair.attach(wrong_nonce, 64, "float32")
        with pytest.raises(SharedMemoryUnavailable, match="does not hold"):
            SegmentPair.attach(offer_of(server), 128, "float32")
    finally:
        server.unlink()
    with pytest.raises(SharedMemoryUnavailable, match="cannot open"):
        SegmentPair.attach(offer_of(server), 64, "float32")  # gone, as on another machine


@pytest.mark.parametrize("path", ["/etc/passwd", "/dev/shm/../shm/disttrain-x-gradient",
                                  "/dev/shm/other-file"])
def test_only_names_this_project_makes_are_opened(path):
    with pytest.raises(SharedMemoryUnavailable, match="not a segment name"):
        Segment.attach(path, 8, b"0" * 16)


def test_a_full_shared_memory_is_refused_up_front_and_leaves_nothing(monkeypatch):
    import errno
    import os

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    before = set(shared_memory.SEGMENT_DIR.iterdir())
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(SharedMemoryUnavailable, match="No space left"):
        SegmentPair.create(1 << 20, "float32")
    assert set(shared_memory.SEGMENT_DIR.iterdir()) == before


def test_segments_of_dead_servers_are_swept_and_live_ones_kept():
    import secrets
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    left = shared_memory.SEGMENT_DIR / f"disttrain-{int(dead.stdout)}-{secrets.token_hex(16)}-gradient"
    left.write_bytes(b"\0" * 64)  # what a server killed before its worker attached leaves
    live = SegmentPair.create(64, "float32")  # this process's own
    try:
        assert shared_memory.sweep_stale() >= 1
        assert not left.exists() and live.gradient.path.exists() and live.parameter.path.exists()
    finally:
        left.unlink(missing_ok=True)
        live.unlink()
