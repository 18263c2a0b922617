"""Measuring a link: a small TCP server (`disttrain advise --serve`) and the client that
times round trips and bulk transfers against it (`--peer HOST:PORT`, or this machine's
loopback).

The protocol, plain TCP and nothing to unpickle: the client opens with `DTADV2`; the
server answers with a fresh random challenge of 32 bytes; the client proves it holds the
run's token with a u16 length and HMAC-SHA256(token, `PROOF_CONTEXT` + challenge) (empty
without a token); the server answers `Y`, or `N` with a u16-length reason and closes.
Then commands, one byte each: `P` (ping, echoed), `U` + u64 n (the client sends n bytes,
the server answers `D` once it has them all), `G` + u64 n (the server sends n bytes), `Q`
(quit). The token itself never crosses the network: whoever listens sees a challenge and
a proof good for that challenge alone (a new connection gets a new one), so it can
neither learn the token nor replay the proof. The proof is compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import statistics
import struct
import threading
import time

from disttrain.advise.link import Link
from disttrain.core.auth import REFUSED
from disttrain.core.errors import ConfigError

logger = logging.getLogger(__name__)

MAGIC = b"DTADV2"
CHALLENGE_BYTES = 32
PROOF_CONTEXT = b"disttrain advise probe v2\0"  # a proof made here serves no other protocol
_LENGTH = struct.Struct("<H")
_SIZE = struct.Struct("<Q")
MAX_TRANSFER_BYTES = 1 << 30
_CHUNK = 1 << 20
_ZEROS = bytes(_CHUNK)


def prove(token: str | None, challenge: bytes) -> bytes:
    """The proof that a client holds `token`, for the server's `challenge` (empty without a token)."""
    if token is None:
        return b""
    return hmac.new(token.encode(), PROOF_CONTEXT + challenge, hashlib.sha256).digest()


def _read_exactly(conn: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        piece = conn.recv(min(count - len(data), _CHUNK))
        if not piece:
            raise ConnectionError("the other end closed the connection")
        data += piece
    return bytes(data)


def _discard(conn: socket.socket, count: int) -> None:
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    while count > 0:
        got = conn.recv_into(view[:min(count, _CHUNK)])
        if not got:
            raise ConnectionError("the other end closed the connection")
        count -= got


def _send_zeros(conn: socket.socket, count: int) -> None:
    while count > 0:
        piece = min(count, _CHUNK)
        conn.sendall(_ZEROS[:piece])
        count -= piece


class ProbeServer:
    """Answers probes, one connection at a time, in a background thread.

    Args:
        host, port: where to listen (port 0: any free port; see `address`).
        token: the run's token; None: anyone who reaches the port may probe.
        timeout_s: a silent connection is dropped after this long.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 timeout_s: float = 30.0):
        self.token = token
        self.timeout_s = timeout_s
        self._listener = socket.create_server((host, port))
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="advise-probe", daemon=True)
        self.num_served = 0

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> ProbeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        try:  # wake accept()
            socket.create_connection(self._listener.getsockname()[:2], timeout=1).close()
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._listener.close()

    def wait(self) -> None:
        """Serve until interrupted."""
        self._thread.join()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            if self._stopping.is_set():
                conn.close()
                return
            with conn:
                conn.settimeout(self.timeout_s)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    self._answer(conn)
                    self.num_served += 1
                except (OSError, ConnectionError, struct.error) as e:
                    logger.info("probe from %s:%s ended: %s", peer[0], peer[1], e)

    def _answer(self, conn: socket.socket) -> None:
        if _read_exactly(conn, len(MAGIC)) != MAGIC:
            return
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        conn.sendall(challenge)
        (length,) = _LENGTH.unpack(_read_exactly(conn, _LENGTH.size))
        offered = _read_exactly(conn, length)
        if self.token is not None and not hmac.compare_digest(offered, prove(self.token, challenge)):
            reason = REFUSED.encode()
            conn.sendall(b"N" + _LENGTH.pack(len(reason)) + reason)
            return
        conn.sendall(b"Y")
        while True:
            command = _read_exactly(conn, 1)
            if command == b"P":
                conn.sendall(b"P")
            elif command in (b"U", b"G"):
                (count,) = _SIZE.unpack(_read_exactly(conn, _SIZE.size))
                if count > MAX_TRANSFER_BYTES:
                    return
                if command == b"U":
                    _discard(conn, count)
                    conn.sendall(b"D")
                else:
                    _send_zeros(conn, count)
            else:
                return


def measure_link(address: str, token: str | None = None, num_pings: int = 20,
                 num_bytes: int = 16 * 2**20, timeout_s: float = 10.0, source: str | None = None) -> Link:
    """Round-trip latency (median of `num_pings`) and bandwidth (the slower direction of
    one `num_bytes` transfer each way) to a `ProbeServer` at HOST:PORT `address`.

    Raises:
        ConfigError: the peer cannot be reached, refuses the token, or is not a probe server.
    """
    host, _, port = address.rpartition(":")
    what = f"--peer {address}"
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except (OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"{what}: cannot connect ({reason}); is `disttrain advise --serve` "
                          "running there, and the port open?") from e
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn.sendall(MAGIC)
            proof = prove(token, _read_exactly(conn, CHALLENGE_BYTES))  # never the token itself
            conn.sendall(_LENGTH.pack(len(proof)) + proof)
            answer = _read_exactly(conn, 1)
            if answer == b"N":
                (length,) = _LENGTH.unpack(_read_exactly(conn, _LENGTH.size))
                raise ConfigError(f"{what}: refused: {_read_exactly(conn, length).decode(errors='replace')}")
            if answer != b"Y":
                raise ConfigError(f"{what}: not a `disttrain advise --serve` server")
            rtts = []
            for _ in range(num_pings + 1):
                start = time.perf_counter()
                conn.sendall(b"P")
                _read_exactly(conn, 1)
                rtts.append(time.perf_counter() - start)
            rtt = statistics.median(rtts[1:])
            start = time.perf_counter()
            conn.sendall(b"U" + _SIZE.pack(num_bytes))
            _send_zeros(conn, num_bytes)
            _read_exactly(conn, 1)
            upload_s = time.perf_counter() - start
            start = time.perf_counter()
            conn.sendall(b"G" + _SIZE.pack(num_bytes))
            _discard(conn, num_bytes)
            download_s = time.perf_counter() - start
            conn.sendall(b"Q")
        except (OSError, ConnectionError) as e:
            raise ConfigError(f"{what}: the probe failed ({getattr(e, 'strerror', None) or e})") from e
    slowest = max(upload_s, download_s) - rtt
    bandwidth = num_bytes / max(slowest, 1e-9)
    return Link(bandwidth, rtt / 2, source or f"peer {address}")


def measure_loopback(num_bytes: int = 64 * 2**20) -> Link:
    """This machine's loopback: a probe server in a thread, measured by the client."""
    server = ProbeServer("127.0.0.1", 0).start()
    try:
        return measure_link(server.address, None, num_bytes=num_bytes, source="loopback")
    finally:
        server.stop()
