"""Limits before trust, on real servers (port 0) called by raw gRPC clients: what a caller
without credentials can make a server hold, how a malformed credential is answered and
logged, and that text a caller chose cannot forge a line of a server's log."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from disttrain.core.auth import METADATA_KEY, SCHEME
from disttrain.strategies.ps.wire import service as wire
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

MESSAGE_BYTES = 60 << 20
NUM_OUTSIDERS = 16

# A shard server in a process of its own (so its memory is its own), with the run's token:
# prints its address, then its peak and current memory (MB) on each line read.
SHARD = textwrap.dedent("""
    import re, sys
    import torch
    torch.set_num_threads(1)
    from disttrain.config import config_from_dict
    from disttrain.strategies.ps.run.server import build_state
    from disttrain.strategies.ps.server.servicer import ShardServer
    config = config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp"},
        "system": {"num_workers": 1, "checkpoint_dir": sys.argv[1]}})
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0", token="the-run-token")
    print(server.address, flush=True)
    for _ in sys.stdin:
        status = open("/proc/self/status").read()
        print(*(int(re.search(key + r":\\s+(\\d+)", status).group(1)) >> 10 for key in ("VmHWM", "VmRSS")),
              flush=True)
""")


@pytest.mark.slow
def test_an_outsiders_large_messages_are_not_read_before_the_token_is_checked(tmp_path):
    """16 callers without a token send a 60 MB push each, at once: all are refused
    UNAUTHENTICATED, and the shard's peak memory grows by far less than one message (it
    grew by 570 MB, kept after the calls, when a refused unary request was read whole)."""
    server = subprocess.Popen([sys.executable, "-c", SHARD, str(tmp_path / "ckpt")], cwd=REPO_ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    channel = None
    try:
        address = server.stdout.readline().strip()
        assert address, "the shard server did not start"

        def memory_mb() -> tuple[int, int]:
            server.stdin.write("\n")
            server.stdin.flush()
            peak, current = map(int, server.stdout.readline().split())
            return peak, current

        channel = grpc.insecure_channel(address, options=wire.CHANNEL_OPTIONS)
        push = channel.unary_unary(wire.method_path("PushGradients"))
        message = b"\0" * MESSAGE_BYTES
        credentials = [None, [(METADATA_KEY, SCHEME + "not-the-token")]]

        def send(i: int) -> grpc.StatusCode:
            with pytest.raises(grpc.RpcError) as refused:
                push(message, timeout=60, metadata=credentials[i % 2])
            return refused.value.code()

        peak_before, _ = memory_mb()
        with ThreadPoolExecutor(NUM_OUTSIDERS) as pool:
            codes = set(pool.map(send, range(NUM_OUTSIDERS)))
        peak_after, current_after = memory_mb()
        assert codes == {grpc.StatusCode.UNAUTHENTICATED}
        assert peak_after - peak_before < 32, (peak_before, peak_after, current_after)
    finally:
        if channel is not None:
            channel.close()
        server.stdin.close()
        server.terminate()
        server.wait(timeout=30)
