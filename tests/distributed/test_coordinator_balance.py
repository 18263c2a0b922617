"""Balance state through a real coordinator on a socket (port 0): a real HeartbeatSender
whose progress carries the node's BalanceState (batch, warm-up speed and plans); the
coordinator keeps them in its status and registry, records one "rebalanced" event per
re-plan, takes progress without a balance state (or without seconds of work), and
`disttrain status` shows it all, from the coordinator and from the registry file. A DDP
rank's state comes from its real Rebalancer. Each heartbeat is sent by calling the
sender's beat directly: the reply means the coordinator has taken it."""

from __future__ import annotations

import argparse
import threading

import pytest

from disttrain.cli import status
from disttrain.config.schema import CoordinatorConfig, SystemConfig
from disttrain.coordinator.background import HeartbeatSender
from disttrain.coordinator.client import CoordinatorClient
from disttrain.coordinator.registry import read_status
from disttrain.coordinator.reports import BalanceState, NodeIdentity, NodeProgress, NodeReports
from disttrain.coordinator.service import CoordinatorHooks, CoordinatorServer
from disttrain.data import PlannedSampler
from disttrain.strategies.ddp.heartbeats import LoopProgress, RankLink
from disttrain.training.checkpoints import Position
from disttrain.training.rebalance import Rebalancer

pytestmark = pytest.mark.timeout(60)

# Heartbeats are sent by hand; the long timeout keeps the monitor from failing anyone meanwhile.
CONFIG = CoordinatorConfig(heartbeat_interval=0.1, heartbeat_timeout=60.0)


@pytest.fixture
def coordinator(tmp_path):
    server = CoordinatorServer(CONFIG, "127.0.0.1:0", tmp_path / "registry.db")
    client = CoordinatorClient(server.address, timeout_s=5.0)
    yield server, client
    client.close()
    server.stop(0)


class Node:
    """A registered node whose progress the test moves by hand."""

    def __init__(self, client: CoordinatorClient, node_id: str, timed: bool = True):
        client.register(node_id, "worker", rank=int(node_id.rpartition("-")[2]))
        self.step, self.timed = 0, timed
        self.balance: BalanceState | None = None
        self.sender = HeartbeatSender(client, NodeIdentity(node_id, "worker"), CONFIG.heartbeat_interval,
                                      NodeReports(self.progress), lambda: None)

    def progress(self) -> NodeProgress:
        work_s = 0.01 * self.step if self.timed else None
        return NodeProgress(0, self.step, 32 * self.step, work_s, self.balance)

    def beat(self, steps: int = 1) -> None:
        self.step += steps
        assert self.sender._beat()  # noqa: SLF001 - one heartbeat, answered before it returns


def node_status(client: CoordinatorClient, node_id: str):
    (node,) = [n for n in client.status().nodes if n.node_id == node_id]
    return node


def rebalanced(events) -> list[tuple[str, str]]:
    return [(e.node_id, e.detail) for e in events if e.kind == "rebalanced"]


def test_balance_state_and_one_event_per_replan_reach_status_and_registry(coordinator):
    server, client = coordinator
    node = Node(client, "worker-0")
    node.balance = BalanceState(64, 812.5, 1)
    node.beat()
    shown = node_status(client, "worker-0")
    assert (shown.batch_size, shown.warmup_speed, shown.plans, shown.step) == (64, 812.5, 1, 1)
    assert rebalanced(client.status().events) == []  # a first report is no re-plan

    node.balance = BalanceState(96, 0.0, 2)  # the speed unknown: the coordinator keeps its own
    node.beat()
    node.beat()  # the same plan again: no second event
    shown = node_status(client, "worker-0")
    assert (shown.batch_size, shown.warmup_speed, shown.plans) == (96, 812.5, 2)
    assert rebalanced(client.status().events) == [("worker-0", "batch 64 -> 96 (plan 2)")]

    # A re-plan is written at once: the registry file has it while the coordinator runs.
    snapshot = read_status(server.registry.path, max_events=100)
    (row,) = snapshot.nodes
    assert (row["batch_size"], row["warmup_speed"], row["plans"]) == (96, 812.5, 2)
    assert rebalanced(argparse.Namespace(**e) for e in snapshot.events) == [
        ("worker-0", "batch 64 -> 96 (plan 2)")]


@pytest.mark.parametrize("timed", [False, True])
def test_progress_without_balance_still_heartbeats(coordinator, timed):
    _, client = coordinator
    node = Node(client, "worker-0", timed)
    node.beat(2)
    node.beat(3)
    shown = node_status(client, "worker-0")
    assert shown.step == 5 and shown.throughput > 0
    assert (shown.batch_size, shown.warmup_speed, shown.plans) == (0, 0.0, 0)
    if timed:  # step time from the seconds of work: 0.01 s a step
        assert shown.step_time_s == pytest.approx(0.01)


def test_a_ddp_rank_sends_its_balance_state_and_its_final_heartbeat_its_metrics(tmp_path):
    heard = threading.Event()
    server = CoordinatorServer(CONFIG, "127.0.0.1:0", tmp_path / "registry.db",
                               CoordinatorHooks(on_step=lambda _: heard.set()))
    client = CoordinatorClient(server.address, timeout_s=5.0)
    progress = LoopProgress(Position(), num_epochs=2)
    sampler = PlannedSampler(640, world_size=2, rank=0, seed=1, shares=(40, 24))
    speeds: list[float] = []  # what the re-plan's gather answers
    system = SystemConfig(balance="proportional", balance_margin=0.2, balance_interval=1)
    progress.rebalancer = Rebalancer(sampler, system, lambda name, mine, step: speeds, warmup_speed=640.0)
    # One heartbeat at its start, then none for 30 s: the next one is the final one.
    settings = CoordinatorConfig(heartbeat_interval=30.0, heartbeat_timeout=60.0)
    link = RankLink(CoordinatorClient(server.address, timeout_s=5.0), settings, 1, 0, progress)
    try:
        link.start()
        assert heard.wait(10.0)
        shown = node_status(client, "rank1")
        assert (shown.batch_size, shown.warmup_speed, shown.plans) == (40, 640.0, 1)
        position = progress.position
        position.step, position.samples_processed, position.train_time_s = 12, 480, 1.5
        next(iter(sampler.batches()))  # its first step, on the first plan
        speeds[:] = [1200.0, 400.0]  # rank 0 three times faster: batches of 48 and 16 from the next
        assert progress.rebalancer.after_step(1, 0, 40, 0.0)
        progress.metrics.publish(12, 1, {"loss/train": 0.42, "accuracy/test": 0.9})
        link.leave(0, "finished", final=True)
        shown = node_status(client, "rank1")
        assert (shown.state, shown.step, shown.throughput) == ("done", 12, 320.0)  # the final heartbeat
        assert (shown.batch_size, shown.warmup_speed, shown.plans) == (48, 640.0, 2)
        assert rebalanced(client.status().events) == [("rank1", "batch 40 -> 48 (plan 2)")]
        # its latest metrics go with the final heartbeat (no heartbeat came since they were logged)
        assert (dict(shown.metrics), shown.metrics_step) == ({"loss/train": 0.42, "accuracy/test": 0.9}, 12)
    finally:
        client.close()
        server.stop(0)


def show(capsys, *source: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """`disttrain status` run on `source`: its lines, and each node's cells by column."""
    parser = argparse.ArgumentParser()
    status.add_arguments(parser)
    status.run(parser.parse_args(list(source)))
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("NODE"))
    starts = [header.index(name) for name in status.COLUMNS]
    ends = starts[1:] + [None]
    rows = {line.split()[0]: {name: line[start:end].strip()
                              for name, start, end in zip(status.COLUMNS, starts, ends, strict=True)}
            for line in lines if line.startswith("worker-")}
    return lines, rows


def test_status_shows_gpus_batch_warmup_speed_and_rebalanced_events(coordinator, capsys):
    server, client = coordinator
    fast, plain = Node(client, "worker-0"), Node(client, "worker-1", timed=False)
    fast.balance = BalanceState(64, 812.5, 1)
    fast.beat()
    fast.balance = BalanceState(96, 812.5, 2)
    fast.beat()
    plain.beat()
    capabilities = server.state.membership.get("worker-0").capabilities  # this machine's, as registered
    assert "gpu_count" in capabilities
    for source in (("--coordinator", server.address), ("--registry", str(server.registry.path))):
        lines, rows = show(capsys, *source)
        fast_row, plain_row = rows["worker-0"], rows["worker-1"]
        assert fast_row["MACHINE"].endswith(status.describe_gpus(capabilities)), source
        assert (fast_row["BATCH"], fast_row["WARM-UP/S"]) == ("96 (plan 2)", "812.5"), source
        assert float(fast_row["SAMPLES/S"]) > 0
        assert (plain_row["BATCH"], plain_row["WARM-UP/S"]) == ("-", "-"), source  # no balance state
        assert any(line.startswith("BATCH: ") for line in lines)  # the legend
        assert any(line.endswith("worker-0  rebalanced: batch 64 -> 96 (plan 2)") for line in lines), lines


def test_the_machine_column_shows_the_gpu_count_beside_the_model():
    assert status.describe_gpus({"gpu": "NVIDIA H100", "gpu_count": 2}) == "2x NVIDIA H100"
    assert status.describe_gpus({"gpu": "NVIDIA H100"}) == "NVIDIA H100"  # an older node: no count
    assert status.describe_gpus({"gpu": "", "gpu_count": 0}) == "no GPU"
    node = {"hostname": "gpu1", "capabilities": {"cpus": 32, "memory_bytes": 270e9, "gpu": "NVIDIA H100",
                                                 "gpu_count": 8}}
    assert status.describe_machine(node) == "gpu1: 32 CPU, 270.0 GB, 8x NVIDIA H100"
