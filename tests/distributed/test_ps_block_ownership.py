"""A parameter-server run whose shards are started as the launcher starts them (`ps-server`
subprocesses on port 0, given the run's config and nothing else), attacked by an insider:
a raw gRPC client holding worker 0's own credentials (its node token, made from the run's
secret as `disttrain ps` hands it to worker 0, and its key). It pushes a block of worker
1's batch, and redos of blocks the run's plan does not hold. Each is refused
INVALID_ARGUMENT by every shard, whose version and ledger stay as they were; then the
real workers train the run to its end, and every sample is applied exactly once (no push
of worker 1 turned away as a duplicate, nothing lost). A training set that gives no worker
a batch (no layout) stops `disttrain ps` before it starts a process.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from disttrain.config import Config, config_from_dict
from disttrain.coordinator.launch import token_env
from disttrain.core.auth import new_token
from disttrain.core.credentials import Credentials
from disttrain.core.identity import node_token
from disttrain.core.process_spec import ProcessSpec
from disttrain.core.processes import Cluster
from disttrain.metrics.summary import SUMMARY_FILE, RunSummary
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.proto import tensor_pb2
from disttrain.strategies.ps.run.launcher import start_servers
from disttrain.strategies.ps.run.worker import keep_key
from disttrain.strategies.ps.wire import codec
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model

pytestmark = pytest.mark.timeout(240)

SECRET = new_token()
NUM_SERVERS = 2
SAMPLES, BATCH, WORKERS, EPOCHS = 128, 16, 2, 1
BATCHES_PER_EPOCH = SAMPLES // WORKERS // BATCH  # worker 0: blocks 0-3, worker 1: blocks 4-7
RUN_TIMEOUT_S = 180.0


def make_config(folder: Path) -> Config:
    return config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd", "momentum": 0.0,
                     "learning_rate": 0.05, "batch_size": BATCH, "num_epochs": EPOCHS,
                     "max_train_samples": SAMPLES, "max_test_samples": 64, "checkpoint_interval": 100},
        "system": {"num_workers": WORKERS, "num_threads": 1, "checkpoint_dir": str(folder / "ckpt"),
                   "log_dir": str(folder / "logs")},
        "ps": {"aggregation_mode": "sync", "num_servers": NUM_SERVERS, "rpc_timeout_s": 30.0}})


def wait_exit(cluster: Cluster, name: str) -> int:
    """`name`'s exit code once it exited (its exit event may have gone by while the test
    waited for another child's)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (code := cluster.children[name].process.poll()) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"{name} still running after {RUN_TIMEOUT_S:.0f}s:\n"
                        f"{cluster.children[name].tail(30)}")
        cluster.next_event(remaining)  # wakes on any child's event, its exit among them
    return code


class Insider:
    """Worker 0's own credentials in a raw client: its node token and its key."""

    def __init__(self, addresses: list[str], config: Config, key: bytes):
        self.plans = plan_shards(init_model(config.training), len(addresses))
        self.client = PSClient(addresses, self.plans, RetryPolicy(timeout_s=10.0, max_attempts=1),
                               transport="grpc",
                               credentials=Credentials(node_token(SECRET, "worker0", "worker")))
        self.client.register("worker0", 0, 0, key)

    def push(self, shard: int, block: int, epoch: int = 0, redo: bool = False) -> pb.PushReply:
        plan, link = self.plans[shard], self.client.shards[shard]
        header = pb.GradientMessage(worker_id="worker0", step=1, base_version=0, shard=shard,
                                    num_samples=BATCH, block_id=block, epoch=epoch, redo=redo,
                                    session=link.session)
        header.layout.extend(wire.slice_specs(plan))
        meta = tensor_pb2.TensorProto(shape=[plan.numel], dtype="float32")
        frames = list(codec.encode_frames(header, wire.GRADIENT_PAYLOAD_FIELD, meta,
                                          codec.tensor_bytes(torch.full((plan.numel,), 0.5))))
        send = link.channel.stream_unary(wire.method_path("SendGradients"), request_serializer=wire.identity,
                                         response_deserializer=pb.PushReply.FromString)
        return send(iter(frames), timeout=10)

    def state(self) -> list[tuple[int, int, int, int]]:
        """Each shard's version, samples applied, blocks in its ledger and duplicates."""
        statuses = self.client.call_all("GetStatus", pb.StatusRequest())
        return [(s.version, s.num_samples_applied, s.num_blocks_applied, s.num_duplicates) for s in statuses]

    def close(self) -> None:
        self.client.close()


def refused(attempt, *words: str) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        attempt()
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert all(word in error.details() for word in words), error.details()


@pytest.mark.slow
def test_an_insider_with_worker0s_credentials_cannot_push_or_redo_outside_its_blocks(tmp_path):
    config = make_config(tmp_path)
    config_path = tmp_path / "config.yaml"
    config.save(config_path)
    key = secrets.token_bytes(32)  # worker 0's key, kept where its process reads it back
    keep_key(Path(config.system.checkpoint_dir) / "worker0", key)
    with Cluster(tmp_path / "cluster", env_of=token_env(SECRET)) as cluster:
        addresses = start_servers(cluster, config_path, NUM_SERVERS)
        insider = Insider(addresses, config, key)
        try:
            before = insider.state()
            assert before == [(0, 0, 0, 0)] * NUM_SERVERS
            for shard in range(NUM_SERVERS):
                # worker 1's first batch: taken, it would turn worker 1's own push away as a duplicate
                refused(lambda s=shard: insider.push(s, BATCHES_PER_EPOCH), "rank 1's", "its own blocks")
                # blocks that do not exist in the plan: applied at once, they would move a sync shard alone
                for block in (WORKERS * BATCHES_PER_EPOCH, 10 ** 9):
                    refused(lambda s=shard, b=block: insider.push(s, b, redo=True), "past the run")
            assert insider.state() == before
            assert insider.client.ledger(0, 10 ** 10) == [set()] * NUM_SERVERS
        finally:
            insider.close()
        # the real workers: worker 0 with its own key again (it takes its id back), worker 1
        for rank in range(WORKERS):
            spec = ProcessSpec("ps-worker", config=config_path, servers=tuple(addresses), rank=rank,
                               worker_id=f"worker{rank}", resume=rank == 0)
            cluster.spawn(f"worker{rank}", spec)
        for name in [f"worker{r}" for r in range(WORKERS)] + [f"server{s}" for s in range(NUM_SERVERS)]:
            assert wait_exit(cluster, name) == 0, cluster.children[name].tail(30)
    summary = RunSummary.read(Path(config.system.log_dir) / SUMMARY_FILE).extra
    # every sample of the run applied once on every shard: none lost, none turned away
    assert summary["samples_applied"] == SAMPLES * EPOCHS, summary
    assert summary["samples_lost"] == 0 and summary["samples_redone"] == 0, summary



@pytest.mark.slow  # a process of the command line
def test_a_training_set_that_gives_no_worker_a_batch_stops_the_run_before_any_process_starts(tmp_path):
    flags = ["--workers", "4", "--balance", "proportional", "--dataset", "digits",
             "--max-train-samples", "40", "--batch-size", "16",
             "--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    result = subprocess.run([sys.executable, "-m", "disttrain", "ps", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "40 training samples" in result.stderr and "at least 64 needed" in result.stderr, result.stderr
    assert not (tmp_path / "logs").exists()  # no process started, nothing written
