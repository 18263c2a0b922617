"""A real coordinator on a socket (port 0) in this process, driven by the client, the
heartbeat sender and the membership watcher: registration, failure detection, status
codes, long-polls, re-registration, metrics reports, recovery records and a restart on
the same registry."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import pytest

from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.background import HeartbeatSender, MembershipWatcher
from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.coordinator.registry import read_status
from disttrain.coordinator.reports import LatestMetrics, NodeIdentity, NodeMetrics, NodeProgress, NodeReports
from disttrain.coordinator.service import CoordinatorHooks, CoordinatorServer
from disttrain.proto import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(60)

INTERVAL_S, TIMEOUT_S = 0.1, 0.5
CONFIG = CoordinatorConfig(heartbeat_interval=INTERVAL_S, heartbeat_timeout=TIMEOUT_S)


class Recorder:
    """Callbacks of the server, each setting an Event the test waits on."""

    def __init__(self):
        self.failures: list[tuple[str, str]] = []
        self.failed = threading.Event()
        self.max_step = 0
        self.stepped = threading.Event()

    def on_failure(self, node_id: str, reason: str) -> None:
        self.failures.append((node_id, reason))
        self.failed.set()

    def on_step(self, step: int) -> None:
        self.max_step = step
        self.stepped.set()


@pytest.fixture
def coordinator(tmp_path):
    recorder = Recorder()
    server = CoordinatorServer(CONFIG, "127.0.0.1:0", tmp_path / "registry.db",
                               CoordinatorHooks(recorder.on_step, recorder.on_failure))
    client = CoordinatorClient(server.address, timeout_s=5.0)
    yield server, client, recorder
    client.close()
    server.stop(0)


def wait_for_state(client: CoordinatorClient, node_id: str, state: str, timeout_s: float = 5.0) -> pb.Member:
    """Long-poll the membership until `node_id` is in `state`."""
    deadline, generation = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        membership = client.watch_membership(generation, deadline - time.monotonic())
        if membership is None:
            break
        generation = membership.generation
        for member in membership.members:
            if member.node_id == node_id and member.state == state:
                return member
    raise AssertionError(f"{node_id} not {state} within {timeout_s}s")


def heartbeat(client: CoordinatorClient, node_id: str, step: int = 0) -> pb.HeartbeatReply:
    return client.heartbeat(pb.HeartbeatMessage(node_id=node_id, step=step, role="worker", pid=os.getpid()))


def test_register_then_heartbeat_shows_in_status(coordinator):
    server, client, recorder = coordinator
    reply = client.register("worker-0", "worker", rank=0, address="127.0.0.1:1234")
    assert (reply.generation, reply.restarts, reply.heartbeat_timeout_s) == (1, 0, TIMEOUT_S)
    assert heartbeat(client, "worker-0", step=7).alive
    assert recorder.max_step == 7
    (node,) = client.status().nodes
    assert (node.node_id, node.role, node.rank, node.state) == ("worker-0", "worker", 0, "alive")
    assert node.step == 7
    assert node.capabilities.cpus > 0 and node.capabilities.memory_bytes > 0
    assert 0 <= node.heartbeat_age_s < TIMEOUT_S


def test_a_silent_node_is_failed_within_timeout_plus_interval(coordinator):
    server, client, recorder = coordinator
    # timed from before the call: the coordinator starts its clock when it registers the
    # node, before the reply returns (taken after it, the lower bound failed at 0.483 s)
    registered = time.monotonic()
    client.register("worker-0", "worker")
    wait_for_state(client, "worker-0", "failed")
    elapsed = time.monotonic() - registered
    assert TIMEOUT_S <= elapsed <= TIMEOUT_S + INTERVAL_S + 0.5  # slack for a loaded machine
    assert recorder.failed.wait(5.0)
    assert recorder.failures[0][0] == "worker-0" and "no heartbeat" in recorder.failures[0][1]
    assert not heartbeat(client, "worker-0").alive  # it is told to exit


def test_heartbeat_from_an_unknown_node_is_not_found(coordinator):
    _, client, _ = coordinator
    with pytest.raises(CoordinatorError, match="register") as caught:
        heartbeat(client, "ghost")
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


def test_a_heartbeat_with_a_negative_balance_figure_is_refused_and_changes_nothing(coordinator):
    _, client, _ = coordinator
    client.register("worker-0", "worker")
    with pytest.raises(CoordinatorError, match="batch_size is -4") as caught:
        client.heartbeat(pb.HeartbeatMessage(node_id="worker-0", step=9, batch_size=-4, pid=os.getpid()))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    (node,) = client.status().nodes
    assert (node.step, node.batch_size, node.heartbeat_age_s) == (0, 0, -1.0)


def test_bad_role_is_invalid_argument(coordinator):
    _, client, _ = coordinator
    with pytest.raises(CoordinatorError) as caught:
        client.register("x", "boss", retry_s=0)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_second_live_process_cannot_take_an_id(coordinator):
    server, client, recorder = coordinator
    client.register("worker-0", "worker")
    sender = HeartbeatSender(client, NodeIdentity("worker-0", "worker"), INTERVAL_S,
                             NodeReports(lambda: NodeProgress(0, 0, 0)), lambda: None)
    sender.start()
    try:
        code = ("import sys; from disttrain.coordinator.client import CoordinatorClient, CoordinatorError\n"
                f"try: CoordinatorClient({server.address!r}).register('worker-0', 'worker', retry_s=5)\n"
                "except CoordinatorError as e: print(e.code.name, e); sys.exit(3)\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    finally:
        sender.stop()
    assert result.returncode == 3, result.stderr
    assert result.stdout.startswith("ALREADY_EXISTS") and "worker-0" in result.stdout


def test_watch_membership_wakes_on_change(coordinator):
    _, client, _ = coordinator
    changes: list[pb.Membership] = []
    changed = threading.Event()
    watcher = MembershipWatcher(client, lambda m: (changes.append(m), changed.set()), poll_s=10.0)
    watcher.start()
    try:
        client.register("server-0", "server", rank=0, address="127.0.0.1:50051")
        assert changed.wait(5.0)  # well before the 10 s poll ends
    finally:
        watcher.stop()
    member = changes[-1].members[0]
    assert (member.node_id, member.state, member.address) == ("server-0", "alive", "127.0.0.1:50051")


def test_the_sender_reports_progress_and_hears_it_was_declared_dead(coordinator):
    _, client, recorder = coordinator
    client.register("worker-0", "worker")
    position = {"step": 0}

    def progress() -> NodeProgress:
        position["step"] += 1
        return NodeProgress(0, position["step"], 32 * position["step"])

    dead = threading.Event()
    sender = HeartbeatSender(client, NodeIdentity("worker-0", "worker"), INTERVAL_S, NodeReports(progress),
                             dead.set)
    sender.start()
    try:
        while recorder.max_step < 3:
            assert recorder.stepped.wait(5.0)
            recorder.stepped.clear()
        node = client.status().nodes[0]
        assert node.step_time_s > 0 and node.throughput == pytest.approx(32 / node.step_time_s, rel=1e-6)
        client.report_exit("worker-0", 1, "killed by SIGKILL")
        assert dead.wait(5.0)
    finally:
        sender.stop()


def test_step_time_counts_seconds_of_work_when_given(coordinator):
    _, client, recorder = coordinator
    client.register("worker-0", "worker")
    position = {"step": 0}

    def progress() -> NodeProgress:
        position["step"] += 2
        return NodeProgress(0, position["step"], 0, work_s=0.05 * position["step"])  # waits left out

    sender = HeartbeatSender(client, NodeIdentity("worker-0", "worker"), INTERVAL_S, NodeReports(progress),
                             lambda: None)
    sender.start()
    try:
        while recorder.max_step < 4:
            assert recorder.stepped.wait(5.0)
            recorder.stepped.clear()
    finally:
        sender.stop()
    assert client.status().nodes[0].step_time_s == pytest.approx(0.05)


def test_the_sender_registers_again_with_a_coordinator_that_lost_its_registry(tmp_path):
    first = CoordinatorServer(CONFIG, "127.0.0.1:0", tmp_path / "one.db")
    client = CoordinatorClient(first.address, timeout_s=1.0)
    client.register("worker-0", "worker", rank=2)
    sender = HeartbeatSender(client, NodeIdentity("worker-0", "worker", rank=2), INTERVAL_S,
                             NodeReports(lambda: NodeProgress(0, 5, 0)), lambda: None)
    sender.start()
    first.stop(0)
    second = CoordinatorServer(CONFIG, first.address, tmp_path / "two.db")  # same port, empty registry
    # Another client to watch with. gRPC shares one connection per address between a
    # process's channels, so it may still be in the reconnect backoff of the stop
    # ("Connection refused", CI), as the sender's beats are: it waits until the channel is
    # connected again, as the sender retries its beats at each interval until through.
    watcher = CoordinatorClient(second.address, timeout_s=1.0)
    try:
        grpc.channel_ready_future(watcher.channel).result(timeout=30.0)
        member = wait_for_state(watcher, "worker-0", "alive", timeout_s=30.0)
        assert member.rank == 2
    finally:
        sender.stop()
        watcher.close()
        client.close()
        second.stop(0)


def test_a_restarted_coordinator_shows_the_same_cluster(tmp_path):
    path = tmp_path / "registry.db"
    first = CoordinatorServer(CONFIG, "127.0.0.1:0", path)
    client = CoordinatorClient(first.address)
    client.register("server-0", "server", rank=0)
    client.register("worker-0", "worker", rank=0)
    client.report_exit("worker-0", 137, "killed by SIGKILL")
    heartbeat(client, "server-0", step=12)
    before = client.status()
    assert len(before.recoveries) == 0
    client.register("worker-0", "worker", rank=0)  # its restart: back at work at its first heartbeat
    heartbeat(client, "worker-0", step=3)
    before = client.status()
    (recovery,) = before.recoveries
    assert (recovery.node_id, recovery.reason, recovery.detect_s) == ("worker-0", "killed by SIGKILL", 0.0)
    assert recovery.recover_s > 0 and recovery.generation == before.generation == 4
    first.stop(0)
    client.close()

    second = CoordinatorServer(CONFIG, "127.0.0.1:0", path)
    client = CoordinatorClient(second.address)
    try:
        after = client.status()
        assert after.generation == before.generation == 4
        assert [(n.node_id, n.state, n.restarts, n.step) for n in after.nodes] == \
               [(n.node_id, n.state, n.restarts, n.step) for n in before.nodes]
        assert [(e.node_id, e.kind) for e in after.events] == [(e.node_id, e.kind) for e in before.events]
        assert list(after.recoveries) == list(before.recoveries)
        client.report_exit("worker-0", 1, "exit code 1")
        assert client.register("worker-0", "worker", rank=0).restarts == 2
    finally:
        client.close()
        second.stop(0)


def test_a_flood_of_membership_watches_leaves_threads_for_heartbeats(tmp_path):
    # worker-0 must stay alive while the flood is refused: a membership change would answer
    # the admitted watches (OK) among the refusals, as it did on a loaded machine
    config = CoordinatorConfig(heartbeat_interval=INTERVAL_S, heartbeat_timeout=60.0)
    server = CoordinatorServer(config, "127.0.0.1:0", tmp_path / "registry.db", max_threads=16)
    client = CoordinatorClient(server.address, timeout_s=5.0)
    try:
        client.register("worker-0", "worker")
        watch = client.channel.unary_unary("/disttrain.v1.CoordinatorService/WatchMembership",
                                           request_serializer=pb.MembershipRequest.SerializeToString,
                                           response_deserializer=pb.Membership.FromString)
        generation = client.status().generation
        ended, lock, refused_all = [], threading.Lock(), threading.Event()
        admitted = server.servicer.watches.max_total

        def on_done(future):
            with lock:
                ended.append(future.code())
                if len(ended) == 40 - admitted:
                    refused_all.set()

        request = pb.MembershipRequest(after_generation=generation)
        floods = [watch.future(request, timeout=30) for _ in range(40)]
        for future in floods:
            future.add_done_callback(on_done)
        assert refused_all.wait(10)  # the watches over the cap are turned away at once
        with lock:
            assert set(ended) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert server.servicer.watches.total == admitted
        assert heartbeat(client, "worker-0").alive  # a free thread answers at once
        for future in floods:
            future.cancel()
    finally:
        client.close()
        server.stop(0)


def test_the_sender_reports_new_metrics_once_and_status_and_registry_keep_the_latest(coordinator):
    server, client, recorder = coordinator
    client.register("worker-0", "worker")
    metrics = LatestMetrics()
    reported: list[int] = []
    report = client.report_metrics
    client.report_metrics = lambda node_id, latest: (reported.append(latest.step), report(node_id, latest))[1]
    sender = HeartbeatSender(client, NodeIdentity("worker-0", "worker"), INTERVAL_S,
                             NodeReports(lambda: NodeProgress(0, 0, 0), metrics.latest), lambda: None)
    assert sender._beat() and reported == []  # noqa: SLF001 - one heartbeat; nothing logged yet
    metrics.publish(10, 0, {"loss/train": 0.9, "throughput/samples_per_s": 512.0})
    metrics.publish(12, 0, {"loss/test": 0.8, "accuracy/test": 0.75})
    assert sender._beat() and sender._beat()  # noqa: SLF001 - the second has nothing new to report
    assert reported == [12]
    metrics.publish(20, 1, {"loss/train": 0.5})
    assert sender.send_metrics() and sender.send_metrics()  # as a node leaves: once, too
    assert reported == [12, 20]
    (node,) = client.status().nodes
    assert dict(node.metrics) == {"loss/train": 0.5, "throughput/samples_per_s": 512.0, "loss/test": 0.8,
                                  "accuracy/test": 0.75}
    assert node.metrics_step == 20
    client.register("worker-1", "worker")  # a membership change writes every node at once
    row = next(n for n in read_status(server.registry.path).nodes if n["node_id"] == "worker-0")
    assert (row["metrics"], row["metrics_step"]) == (dict(node.metrics), 20)


def test_metrics_of_an_unknown_node_or_not_finite_are_refused_and_the_sender_tries_again(coordinator):
    _, client, _ = coordinator
    metrics = LatestMetrics()
    metrics.publish(5, 0, {"loss/train": 1.5})
    sender = HeartbeatSender(client, NodeIdentity("ghost", "worker"), INTERVAL_S,
                             NodeReports(lambda: NodeProgress(0, 5, 0), metrics.latest), lambda: None)
    with pytest.raises(CoordinatorError, match="register") as caught:
        client.report_metrics("ghost", metrics.latest())
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert not sender.send_metrics()  # best effort: refused, and due again
    client.register("ghost", "worker")
    assert sender.send_metrics()
    assert dict(client.status().nodes[0].metrics) == {"loss/train": 1.5}
    with pytest.raises(CoordinatorError, match="loss/train not finite") as caught:
        client.report_metrics("ghost", NodeMetrics(6, 0, {"loss/train": float("inf")}))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(client.status().nodes[0].metrics) == {"loss/train": 1.5}
