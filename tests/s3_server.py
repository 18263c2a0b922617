"""A real S3-compatible server for tests (moto's, in a subprocess on a free port it reports),
and a TCP proxy in front of it that can cut one upload mid-request.

The proxy cuts an upload as the client sees it: once the bytes of a matching request have
started to flow, it forwards `after` more bytes, then closes both sides and refuses every
later connection; or, given `on_cut`, it calls it there first (a test kills the server).
Given `heal_after`, the outage ends by itself: that many connections after the cut are
closed as soon as they are accepted (the store unreachable, as often as its client tried),
then connections go through again.

Moto keeps its objects in memory. Started with a `journal`, it appends every request it has
received whole to that file before acting on it; a server started again on the same journal
and `replay`ed holds what the killed one held, as a store that keeps its data on disk would.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

# Runs in the subprocess: start the server on a free port, print it, serve until stdin closes.
SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}


def start_moto(journal: Path | None = None) -> tuple[subprocess.Popen, int]:
    """Start moto's server, recording every request to `journal` if given; returns the
    process and its port. Raises RuntimeError if it does not report a port (moto missing or
    broken)."""
    env = dict(os.environ)
    if journal is not None:
        env.update(MOTO_ENABLE_RECORDING="True", MOTO_RECORDER_FILEPATH=str(journal))
    # Its log goes to a file: a pipe nobody reads fills up with the tracebacks of requests cut
    # short, and the server then blocks on its next line, every request with it.
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, env=env,
                               stdout=subprocess.PIPE, stderr=log, text=True)
    line = process.stdout.readline()  # the child prints its port first, or dies
    if not line.strip().isdigit():
        process.kill()
        process.wait()
        log.seek(0)
        raise RuntimeError(f"moto's server did not start: {log.read()[-500:]}")
    return process, int(line)


def replay(port: int) -> None:
    """Have the server on `port` (started on a journal) apply every request the journal holds."""
    url = f"http://127.0.0.1:{port}/moto-api/recorder/replay-recording"
    request = urllib.request.Request(url, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def stop_moto(process: subprocess.Popen) -> None:
    process.stdin.close()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class CuttingProxy:
    """Forward 127.0.0.1:`port` to the server at `target_port`; cut the first request whose
    bytes match `pattern` after `after` bytes of it (calling `on_cut` first, if given), and
    refuse connections from then on, or only the next `heal_after` of them.

    Attributes:
        port: where clients connect.
        cut: set once the cut happened.
        healed: set once `heal_after` connections were refused after the cut.
        refused: connections refused since the cut.
    """

    def __init__(self, target_port: int, pattern: bytes, after: int,
                 on_cut: Callable[[], None] | None = None, heal_after: int | None = None):
        self.target_port, self.pattern, self.after = target_port, re.compile(pattern), after
        self.on_cut, self.heal_after = on_cut, heal_after
        self.cut, self.healed = threading.Event(), threading.Event()
        self.refused = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.cut.is_set() and not self.healed.is_set():
                client.close()  # the store is unreachable for this attempt
                self.refused += 1
                if self.heal_after is not None and self.refused >= self.heal_after:
                    self.healed.set()
                continue
            server = socket.create_connection(("127.0.0.1", self.target_port))
            before_cut = not self.cut.is_set()  # a connection made before the cut ends with it
            threading.Thread(target=self._pump, args=(client, server, True, before_cut), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False, before_cut), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, watch: bool, before_cut: bool) -> None:
        seen, budget = b"", None  # budget: bytes still to forward once the request matched
        try:
            while not (before_cut and self.cut.is_set()):
                data = source.recv(65536)
                if not data:
                    break
                if watch and budget is None and not self.cut.is_set():
                    seen = seen[-4096:] + data  # a request line split across reads still matches
                    match = self.pattern.search(seen)
                    if match:  # count from the match: what came before it went through
                        budget = max(self.after + match.start() - (len(seen) - len(data)), 0)
                if budget is not None:
                    data, budget = data[:budget], budget - len(data[:budget])
                    sink.sendall(data)
                    if budget == 0:
                        if self.on_cut is not None:
                            self.on_cut()
                        self.cut.set()
                        if self.heal_after is None:
                            self._listener.close()
                        break
                    continue
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                end.close()
