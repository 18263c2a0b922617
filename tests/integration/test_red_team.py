"""The developers' red-team script, kept as a test: a real `disttrain ps` run (a coordinator,
two shard servers and two workers, as the launcher starts them, with a run secret from a
token file) attacked while it trains by raw gRPC clients only: an outsider with no
credentials, with a malformed one, with a token of another run and with an oversized
message; and an insider holding worker 0's own node token (what a worker process is
handed), which tries to act in another node's name at the coordinator and at the shards,
to stop or drain the shards, and to take more than its share of what every caller
shares (membership watches, long-polls).

Each attack must be refused, with a status code of its class (no credentials:
UNAUTHENTICATED; another's name: PERMISSION_DENIED; over a share: RESOURCE_EXHAUSTED; a
field out of bounds: INVALID_ARGUMENT; a shard call without the caller's own registration:
FAILED_PRECONDITION), and the run must then end as if nobody had
attacked it: exit code 0, every sample applied exactly once, no node failed or restarted.
The attacks that need a shard session of their own (pushing another worker's blocks,
redoing blocks the plan does not hold) are in `tests/distributed/test_ps_block_ownership.py`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from launched import Launched

from disttrain.core.auth import METADATA_KEY, SCHEME, new_token
from disttrain.core.identity import node_token
from disttrain.metrics.summary import SUMMARY_FILE
from disttrain.proto import coordinator_pb2 as cpb
from disttrain.proto import parameter_server_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SAMPLES, EPOCHS, WORKERS = 1280, 3, 2
ARGS = ["--dataset", "digits", "--model", "mlp", "--workers", str(WORKERS), "--servers", "2",
        "--batch-size", "32", "--max-train-samples", str(SAMPLES), "--max-test-samples", "64",
        "--num-epochs", str(EPOCHS), "--num-threads", "1", "--checkpoint-interval", "5", "--seed", "3",
        # slow enough that every attack lands while the run trains
        "--inject", "slow:worker=1:factor=8"]
COORDINATOR = "/disttrain.v1.CoordinatorService/"
SHARD = "/disttrain.v1.ParameterServerService/"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
NO_SESSION = grpc.StatusCode.FAILED_PRECONDITION  # a shard call without a registration of the caller's
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass
class Attack:
    name: str
    refused_with: tuple[grpc.StatusCode, ...]
    attempt: Callable[[], None]  # raises grpc.RpcError when refused


class Target:
    """Raw channels to the run's coordinator and shards."""

    def __init__(self, coordinator: str, shards: list[str], secret: str):
        self.secret = secret
        self.channels = [grpc.insecure_channel(address) for address in (coordinator, *shards)]
        self.coordinator, self.shards = self.channels[0], self.channels[1:]

    def call(self, channel: grpc.Channel, path: str, request, reply_type, token: str | None = None,
             raw_token: str | None = None, timeout: float = 10.0):
        metadata = []
        if token is not None:
            metadata.append((METADATA_KEY, SCHEME + token))
        if raw_token is not None:
            metadata.append((METADATA_KEY, raw_token))
        stub = channel.unary_unary(path, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=reply_type.FromString)
        return stub(request, metadata=metadata, timeout=timeout)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def attacks(target: Target) -> list[Attack]:
    insider = node_token(target.secret, "worker0", "worker")
    stranger = node_token(new_token(), "worker0", "worker")  # a node of another run
    coord, shard = target.coordinator, target.shards[0]

    def as_insider(channel, method, request, reply, prefix=COORDINATOR):
        return lambda: target.call(channel, prefix + method, request, reply, token=insider)

    def flood_watches() -> None:
        """Open 16 membership long-polls at once, each waiting for the generation after the
        current one: a caller may hold only its share, so some must be refused at once. Held
        ones end when the generation moves on (a node joined or ended): then again."""
        stub = coord.unary_unary(COORDINATOR + "WatchMembership",
                                 request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=cpb.Membership.FromString)
        metadata = [(METADATA_KEY, SCHEME + insider)]
        for _ in range(10):
            now = stub(cpb.MembershipRequest(after_generation=-1), metadata=metadata, timeout=10)
            current = now.generation
            ended = threading.Semaphore(0)
            futures = [stub.future(cpb.MembershipRequest(after_generation=current), metadata=metadata,
                                   timeout=60) for _ in range(16)]
            for future in futures:
                future.add_done_callback(lambda _, ended=ended: ended.release())
            try:
                if not ended.acquire(timeout=10):
                    return  # 16 held at once: it got in
                first = next(f for f in futures if f.done())
                if first.exception() is not None:
                    raise first.exception()  # refused: what a share means
            finally:
                for future in futures:
                    future.cancel()
        raise AssertionError("the membership changed under every flood; no share was tested")

    def register(**fields):
        request = cpb.RegisterNodeRequest(pid=1, **fields)
        return as_insider(coord, "RegisterNode", request, cpb.RegisterNodeReply)

    def oversized() -> None:
        big = cpb.RegisterNodeRequest(node_id="worker9", role="worker", hostname="x" * (8 << 20))
        target.call(coord, COORDINATOR + "RegisterNode", big, cpb.RegisterNodeReply)

    return [
        Attack("outsider: the cluster's status without credentials", (UNAUTHENTICATED,),
               lambda: target.call(coord, COORDINATOR + "GetClusterStatus", cpb.ClusterStatusRequest(),
                                   cpb.ClusterStatus)),
        Attack("outsider: a shard's status without credentials", (UNAUTHENTICATED,),
               lambda: target.call(shard, SHARD + "GetStatus", pb.StatusRequest(), pb.ShardStatus)),
        Attack("outsider: a malformed token", (UNAUTHENTICATED,),
               lambda: target.call(coord, COORDINATOR + "GetClusterStatus", cpb.ClusterStatusRequest(),
                                   cpb.ClusterStatus, raw_token="Bearer " + "A" * 5000 + "%%")),
        Attack("outsider: a worker token of another run", (UNAUTHENTICATED,),
               lambda: target.call(shard, SHARD + "GetStatus", pb.StatusRequest(), pb.ShardStatus,
                                   token=stranger)),
        Attack("outsider: an 8 MB registration before any credential", (UNAUTHENTICATED, EXHAUSTED),
               oversized),
        Attack("insider: registers at the coordinator as worker1", (DENIED,),
               register(node_id="worker1", role="worker", rank=1)),
        Attack("insider: registers as server0", (DENIED,),
               register(node_id="server0", role="server")),
        Attack("insider: registers in its own name as a server", (DENIED,),
               register(node_id="worker0", role="server")),
        Attack("insider: heartbeats as worker1", (DENIED,),
               as_insider(coord, "SendHeartbeat", cpb.HeartbeatMessage(node_id="worker1", role="worker",
                                                                       pid=1), cpb.HeartbeatReply)),
        Attack("insider: reports worker1 dead", (DENIED,),
               as_insider(coord, "ReportExit", cpb.ExitReport(node_id="worker1", exit_code=1, reason="x"),
                          cpb.ExitReply)),
        Attack("insider: reports metrics as worker1", (DENIED,),
               as_insider(coord, "ReportMetrics", cpb.MetricsReport(node_id="worker1", step=1),
                          cpb.MetricsReply)),
        Attack("insider: a node id with control characters", (DENIED, INVALID),
               register(node_id="worker0\x1b[2J", role="worker")),
        Attack("insider: registers in its own name with a rank out of bounds", (INVALID,),
               register(node_id="worker0", role="worker", rank=10 ** 6)),
        Attack("insider: takes worker1's rank at a shard with a guessed key", (DENIED,),
               as_insider(shard, "RegisterWorker", pb.RegisterRequest(
                   worker_id="worker1", requested_rank=1, key=b"k" * 32), pb.WorkerAssignment, SHARD)),
        Attack("insider: stops a shard with a forged session", (DENIED, UNAUTHENTICATED, NO_SESSION),
               as_insider(shard, "Shutdown", pb.ShutdownRequest(worker_id="worker0", session=b"s" * 16),
                          pb.ShardStatus, SHARD)),
        Attack("insider: stops a shard in worker1's name", (DENIED,),
               as_insider(shard, "Shutdown", pb.ShutdownRequest(worker_id="worker1"), pb.ShardStatus, SHARD)),
        Attack("insider: tells a shard worker1 is done", (DENIED,),
               as_insider(shard, "WorkerDone", pb.WorkerDoneRequest(worker_id="worker1"), pb.ShardStatus,
                          SHARD)),
        Attack("insider: opens a barrier without a session", (DENIED, UNAUTHENTICATED, NO_SESSION),
               as_insider(shard, "Barrier", pb.BarrierRequest(worker_id="worker0", name="start"),
                          pb.BarrierReply, SHARD)),
        Attack("insider: reads the ledger in worker1's name", (DENIED,),
               as_insider(shard, "GetLedger", pb.LedgerRequest(worker_id="worker1", end_block=10 ** 9),
                          pb.LedgerReply, SHARD)),
        Attack("insider: holds every membership watch it can", (EXHAUSTED,), flood_watches),
    ]


def launch(tmp_path: Path) -> tuple[subprocess.Popen, str, list[str], list[str]]:
    """`disttrain ps` started with a token file; its coordinator's and shards' addresses, read
    from its log lines as they come (the lines are kept)."""
    secret_file = tmp_path / "run.token"
    secret_file.write_text(new_token())
    secret_file.chmod(0o600)
    process = Launched(
        [sys.executable, "-m", "disttrain", "ps", *ARGS, "--token-file", str(secret_file),
         "--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt")],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines, coordinator, shards = [], None, None
    for line in process.stderr:
        lines.append(line)
        if found := re.search(r"coordinator listening on (\S+)", line):
            coordinator = found[1]
        if found := re.search(r"servers listening on (.+)$", line):
            shards = [address.strip() for address in found[1].split(",")]
        if coordinator and shards:
            break
    assert coordinator and shards, "".join(lines[-30:])
    # the rest of its output, read as it comes (a full pipe would block the run)
    threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True).start()
    return process, coordinator, shards, lines


def test_every_attack_on_a_live_run_is_refused_and_the_run_ends_untouched(tmp_path):
    process, coordinator, shards, lines = launch(tmp_path)
    target = Target(coordinator, shards, (tmp_path / "run.token").read_text())
    outcomes: dict[str, str] = {}
    started = time.monotonic()
    try:
        for attack in attacks(target):
            try:
                attack.attempt()
                outcomes[attack.name] = "GOT IN"
            except grpc.RpcError as e:
                code = e.code()
                outcomes[attack.name] = "refused" if code in attack.refused_with else \
                    f"answered {code.name}: {e.details()}"
        # the run was alive through every attack: it still answers its own
        assert target.call(target.coordinator, COORDINATOR + "GetClusterStatus", cpb.ClusterStatusRequest(),
                           cpb.ClusterStatus, token=node_token(target.secret, "worker0", "worker"))
        attacked_s = time.monotonic() - started
    finally:
        target.close()
        try:
            code = process.wait(timeout=240)
        finally:
            process.kill()
    report = json.dumps(outcomes, indent=1)
    assert len(outcomes) >= 20
    assert all(outcome == "refused" for outcome in outcomes.values()), report
    assert code == 0, "".join(lines[-40:])
    print(f"{len(outcomes)} attacks in {attacked_s:.1f}s, each refused; the run went on and ended well")
    summary = json.loads((tmp_path / "logs" / SUMMARY_FILE).read_text())
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == EPOCHS * SAMPLES, summary
    assert summary["num_failures"] == 0, summary["failures"]
