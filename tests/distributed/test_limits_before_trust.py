"""Limits before trust, on real servers (port 0) called by raw gRPC clients: what a caller
without credentials can make a server hold, how a malformed credential is answered and
logged, and that text a caller chose cannot forge a line of a server's log."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.client import method_path
from disttrain.coordinator.service import CoordinatorServer
from disttrain.core import auth
from disttrain.core.auth import METADATA_KEY, SCHEME
from disttrain.core.credentials import Credentials
from disttrain.core.identity import PREFIX, SEPARATOR
from disttrain.core.logs import setup_logging
from disttrain.core.refusal_log import PERIOD_S
from disttrain.proto import coordinator_pb2 as cpb
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import service as wire
from tests.conftest import REPO_ROOT
from tests.distributed.test_ps_server import make_config

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
    from disttrain.core.credentials import Credentials
    from disttrain.strategies.ps.run.server import build_state
    from disttrain.strategies.ps.server.servicer import ShardServer
    config = config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp"},
        "system": {"num_workers": 1, "checkpoint_dir": sys.argv[1]}})
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0", credentials=Credentials("the-run-token"))
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


# --- malformed credentials --------------------------------------------------------------

SECRET = "the-secret-of-this-run"
PIECES = st.sampled_from(["node", "worker", "server", "rank", "coordinator", "operator", "", " ", "~",
                          "worker0", "a b", "0" * 64, SECRET, "é", "\\x1b[31m"])
# What gRPC metadata can carry (printable ASCII); the server's parser must take anything in it.
METADATA_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=120)
CREDENTIALS = st.one_of(
    METADATA_TEXT,
    METADATA_TEXT.map(lambda text: SCHEME + text),
    METADATA_TEXT.map(lambda text: SCHEME + PREFIX + text),
    st.lists(st.one_of(PIECES, METADATA_TEXT), max_size=6).map(
        lambda parts: SCHEME + PREFIX + SEPARATOR.join(parts)),
).map(lambda text: text.encode("ascii", "replace").decode("ascii"))


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    server = CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0",
                               tmp_path_factory.mktemp("malformed") / "registry.db",
                               credentials=Credentials(SECRET))
    channel = grpc.insecure_channel(server.address)
    yield server, channel
    channel.close()
    server.stop(0)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(credential=CREDENTIALS)
def test_a_malformed_credential_is_answered_unauthenticated_with_one_line(coordinator, caplog, credential):
    """Whatever an `authorization` value holds (a node token's pieces in any order, any
    text gRPC metadata can carry), the call is refused UNAUTHENTICATED, by a line of its
    own at most once per method every period, never a traceback."""
    server, channel = coordinator
    assume(credential != SCHEME + SECRET)  # a node token's HMAC is beyond a guess
    status = channel.unary_unary(method_path("GetClusterStatus"),
                                 request_serializer=cpb.ClusterStatusRequest.SerializeToString,
                                 response_deserializer=cpb.ClusterStatus.FromString)
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(grpc.RpcError) as refused:
            status(cpb.ClusterStatusRequest(), timeout=10, metadata=[(METADATA_KEY, credential)])
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) <= 1 and all("\n" not in r.getMessage() for r in warned)


def test_a_credential_its_parser_chokes_on_names_nobody(coordinator, caplog, monkeypatch):
    """A credential that makes the token check raise (as a node token naming an id with
    a space once did) is refused UNAUTHENTICATED like any wrong one, logged in one line
    per method and period however many arrive, never with a traceback."""
    server, channel = coordinator

    def choke(secret: str, presented: str):
        raise ValueError(f"node id {presented!r}:\nforged line")
    monkeypatch.setattr(auth, "verify_token", choke)
    status = channel.unary_unary(method_path("GetClusterStatus"),
                                 request_serializer=cpb.ClusterStatusRequest.SerializeToString,
                                 response_deserializer=cpb.ClusterStatus.FromString)
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG):
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as refused:
                status(cpb.ClusterStatusRequest(), timeout=10, metadata=[(METADATA_KEY, SCHEME + "node~x")])
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    periods = 1 + int((time.monotonic() - started) // PERIOD_S)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert 1 <= len(warned) <= periods and all("\n" not in line for line in warned), warned


# --- caller-supplied text in log lines --------------------------------------------------

FORGED = "12:00:00 ERROR [server 0] shard 0 restored version 0 from /forged"


@pytest.mark.parametrize("separator", ["\n", "\r", "\u2028", "\x1b[2K\r"])
def test_a_callers_text_cannot_forge_a_log_line(tmp_path, separator):
    """A worker registers with a host name holding a line break (or a terminal's erase
    sequence) and a forged line after it: the shard's log file, as a process's entry
    point sets it up, holds its line as one line, the break escaped."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    log_file = tmp_path / "server0.log"
    setup_logging("server", 0, log_file=log_file)
    server = ShardServer(build_state(make_config(tmp_path), 0, 1), "127.0.0.1:0")
    try:
        with grpc.insecure_channel(server.address) as channel:
            register = channel.unary_unary(wire.method_path("RegisterWorker"),
                                           request_serializer=pb.RegisterRequest.SerializeToString,
                                           response_deserializer=pb.WorkerAssignment.FromString)
            register(pb.RegisterRequest(worker_id="w0", key=b"k" * 32, hostname="host" + separator + FORGED,
                                        pid=1), timeout=10)
    finally:
        server.stop(0)
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    lines = log_file.read_text(encoding="utf-8").split("\n")
    assert not [line for line in lines if line.startswith(FORGED) or "\r" in line or "\u2028" in line]
    (registered,) = [line for line in lines if "worker w0 (host" in line]
    assert FORGED[:30] in registered  # the host name as sent (cut at 64 characters), its break escaped
