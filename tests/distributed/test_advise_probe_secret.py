"""`disttrain advise --peer` proves it holds the run's token without sending it: every byte
of a real probe (`measure_link` against `advise --serve`'s server, on real sockets) is
recorded by a relay between the two, and no byte sequence of the token is among them;
the recorded opening, replayed on a new connection, is refused (a fresh challenge each
time), and a wrong token is refused."""

from __future__ import annotations

import secrets
import socket
import threading

import pytest

from disttrain.advise.probe import MAGIC, ProbeServer, measure_link
from disttrain.core.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


class Relay:
    """Listens on 127.0.0.1 (port 0), forwards one connection to `target` and back, and
    records every byte each way."""

    def __init__(self, target: str):
        self.target = target
        self.sent = bytearray()  # client -> server
        self.answered = bytearray()  # server -> client
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client, _ = self._listener.accept()
        host, port = self.target.rsplit(":", 1)
        server = socket.create_connection((host, int(port)))
        pumps = [threading.Thread(target=self._pump, args=(client, server, self.sent)),
                 threading.Thread(target=self._pump, args=(server, client, self.answered))]
        for pump in pumps:
            pump.start()
        for pump in pumps:
            pump.join()
        client.close()
        server.close()
        self._listener.close()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, record: bytearray) -> None:
        while True:
            try:
                data = source.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                try:
                    sink.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            record += data
            sink.sendall(data)

    def join(self) -> None:
        self._thread.join(timeout=30)


def test_the_probe_never_sends_the_token_and_its_proof_cannot_be_replayed():
    token = secrets.token_urlsafe(32)
    server = ProbeServer(token=token).start()
    try:
        relay = Relay(server.address)
        link = measure_link(relay.address, token, num_pings=3, num_bytes=1 << 16)
        relay.join()
        assert link.bandwidth_bytes_per_s > 0 and link.source == f"peer {relay.address}"
        assert relay.sent.startswith(MAGIC)
        for record in (relay.sent, relay.answered):
            assert token.encode() not in record
            # nor any sizeable piece of it
            assert not any(token[i:i + 8].encode() in record for i in range(len(token) - 7))
        # what an eavesdropper recorded opens no session: the challenge is new each time
        opening = bytes(relay.sent[:len(MAGIC) + 2 + 32])
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(opening)
            answer = b""
            while len(answer) < 33:
                piece = conn.recv(64)
                if not piece:
                    break
                answer += piece
        assert answer[32:33] == b"N"  # after the 32-byte challenge
        with pytest.raises(ConfigError, match="refused"):
            measure_link(server.address, "not-" + token, num_pings=1, num_bytes=1024)
        with pytest.raises(ConfigError, match="refused"):
            measure_link(server.address, None, num_pings=1, num_bytes=1024)
    finally:
        server.stop()
