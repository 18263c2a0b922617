"""A parameter-server worker SIGKILLed mid-run and restarted with `ps-worker --resume`.

The killed worker goes on from its own newest checkpoint, and the server applies each of
its steps exactly once: the steps it replays between that checkpoint and the kill come
back as duplicates. Everything is checked against the server's own counters (GetStatus
on the live server, and the figures worker 0 copied from them into summary.json).
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from disttrain.config import Config, config_from_dict
from disttrain.core import checkpoint as ckpt
from disttrain.core.faults import parse_fault
from disttrain.core.process_spec import ProcessSpec, arguments
from disttrain.core.processes import Cluster, Event
from disttrain.data import ShardedSampler, load_datasets
from disttrain.metrics.logger import read_metrics
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.launcher import start_servers
from disttrain.strategies.ps.worker.shard_client import RetryPolicy, ShardClient

NUM_WORKERS = 2
KILLED_RANK = 1
RUN_TIMEOUT_S = 150.0


def make_config(tmp_path: Path) -> Config:
    return config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd",
                     "learning_rate": 0.05, "batch_size": 16, "num_epochs": 2,
                     "max_train_samples": 256, "max_test_samples": 200, "eval_batch_size": 200,
                     "checkpoint_interval": 5, "log_interval": 4},
        "system": {"num_workers": NUM_WORKERS, "num_threads": 1,
                   "checkpoint_dir": str(tmp_path / "ckpt"), "log_dir": str(tmp_path / "logs")},
        "ps": {"aggregation_mode": "async", "rpc_timeout_s": 30.0},
    })


def worker_spec(config_path: Path, address: str, rank: int, **fields) -> ProcessSpec:
    return ProcessSpec("ps-worker", config=config_path, servers=(address,), rank=rank,
                       worker_id=f"worker{rank}", **fields)


class Watcher:
    """Reads the cluster's events in order, keeping every one it has seen."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.seen: list[Event] = []
        self.exit_codes: dict[str, int] = {}

    def until_exited(self, names: set[str], timeout_s: float) -> dict[str, int]:
        """Wait for every child in `names` to exit; fail at once if any other child exits
        with an error, or when the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while not names <= set(self.exit_codes):
            event = self.cluster.next_event(max(0.0, deadline - time.monotonic()))
            if event is None:
                waiting = sorted(names - set(self.exit_codes))
                pytest.fail(f"{', '.join(waiting)} still running after {timeout_s:.0f}s\n"
                            + self.tails(waiting))
            self.seen.append(event)
            if event.kind == "exit":
                self.exit_codes[event.child] = event.fields["code"]
                if event.child not in names and event.fields["code"] != 0:
                    pytest.fail(f"{event.child} exited with {event.fields['code']}\n"
                                + self.tails([event.child]))
        return {name: self.exit_codes[name] for name in names}

    def events(self, child: str, kind: str) -> list[dict]:
        return [e.fields for e in self.seen if e.child == child and e.kind == kind]

    def tails(self, names) -> str:
        return "\n".join(f"--- {n}.log:\n{self.cluster.children[n].tail(15)}" for n in names)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkilled_async_worker_resumes_and_each_step_is_applied_once(tmp_path):
    config = make_config(tmp_path)
    config_path = tmp_path / "config.yaml"
    config.save(config_path)
    training = config.training

    # What each worker does, from the config and the sampler that cuts its shard.
    train_set, _ = load_datasets(training)
    samplers = [ShardedSampler(len(train_set), world_size=NUM_WORKERS, rank=r, seed=training.seed)
                for r in range(NUM_WORKERS)]
    steps_per_epoch = [s.num_batches(training.batch_size) for s in samplers]
    total_steps = [n * training.num_epochs for n in steps_per_epoch]
    total_samples = [len(s) * training.num_epochs for s in samplers]
    interval = training.checkpoint_interval

    # Kill on the first step of epoch 1: the newest checkpoint then sits mid-epoch 0, so
    # the resumed worker replays the end of epoch 0 (its evaluation barriers included).
    kill_step = steps_per_epoch[KILLED_RANK] + 1
    expected_checkpoint = kill_step - kill_step % interval
    assert kill_step % interval != 0 and 0 < expected_checkpoint < steps_per_epoch[KILLED_RANK]
    replayed = kill_step - expected_checkpoint

    killed_dir = Path(config.system.checkpoint_dir) / f"worker{KILLED_RANK}"
    resumed_name = f"worker{KILLED_RANK}-resumed"
    with ThreadPoolExecutor(1) as pool, Cluster(tmp_path / "cluster") as cluster:
        (address,) = start_servers(cluster, config_path, 1)
        server = ShardClient(address, 0, RetryPolicy(timeout_s=RUN_TIMEOUT_S, max_attempts=1))
        try:
            # Held open until every worker has reported done: the server answers it with
            # its final counters, before worker 0 shuts it down.
            final = pool.submit(server.unary, "GetStatus", pb.StatusRequest(wait_all_done=True))
            watcher = Watcher(cluster)
            cluster.spawn("worker0", worker_spec(config_path, address, 0))
            fault = parse_fault(f"kill:worker={KILLED_RANK}:step={kill_step}")
            killed_spec = worker_spec(config_path, address, KILLED_RANK, faults=(fault,))
            cluster.spawn(f"worker{KILLED_RANK}", killed_spec)

            killed = watcher.until_exited({f"worker{KILLED_RANK}"}, RUN_TIMEOUT_S)
            assert killed[f"worker{KILLED_RANK}"] == -signal.SIGKILL, watcher.tails([f"worker{KILLED_RANK}"])

            newest = ckpt.latest_checkpoint(killed_dir)
            assert newest is not None
            checkpoint_step = ckpt.checkpoint_step(newest)
            assert checkpoint_step == expected_checkpoint < kill_step
            state = ckpt.load_checkpoint(newest)
            assert state["position"]["step"] == checkpoint_step and state["position"]["epoch"] == 0
            assert state["position"]["samples_processed"] == checkpoint_step * training.batch_size
            assert state["sampler"]["position"] == checkpoint_step * training.batch_size

            # The dead worker's pushes all reached the server, none of them twice yet.
            before = server.unary("GetStatus", pb.StatusRequest(), timeout_s=10.0)
            assert before.num_duplicates == 0 and before.num_done == 0
            assert before.num_applied >= kill_step and before.version == before.num_applied

            cluster.spawn(resumed_name, worker_spec(config_path, address, KILLED_RANK, resume=True))
            codes = watcher.until_exited({"worker0", resumed_name, "server0"}, RUN_TIMEOUT_S)
            assert codes == {"worker0": 0, resumed_name: 0, "server0": 0}, \
                watcher.tails(["worker0", resumed_name, "server0"])
            status = final.result(timeout=10.0)
        finally:
            server.close()

    # The resumed worker started from that checkpoint, with the steps before it done.
    log = (tmp_path / "cluster" / f"{resumed_name}.log").read_text()
    assert f"resumed from {newest} (epoch 0, step {checkpoint_step})" in log
    (plan,) = watcher.events(resumed_name, "plan")
    assert (plan["rank"], plan["done_steps"], plan["total_steps"]) == \
        (KILLED_RANK, checkpoint_step, total_steps[KILLED_RANK])
    assert len(watcher.events(resumed_name, "progress")) == total_steps[KILLED_RANK] - checkpoint_step
    end = ckpt.load_checkpoint(ckpt.latest_checkpoint(killed_dir))["position"]
    assert (end["step"], end["epoch"], end["samples_processed"]) == \
        (total_steps[KILLED_RANK], training.num_epochs, total_samples[KILLED_RANK])
    # Its metrics hold each step once across the kill, and one evaluation per epoch.
    records = read_metrics(Path(config.system.log_dir) / f"worker{KILLED_RANK}" / "metrics.jsonl")
    train_steps = [r["step"] for r in records if "loss/train" in r]
    assert train_steps == sorted(set(train_steps))
    assert [r["epoch"] for r in records if "accuracy/test" in r] == list(range(training.num_epochs))

    # The server's counters: the replayed steps came back as duplicates, and every step of
    # both workers (every sample of every epoch) was applied exactly once.
    assert status.num_done == status.world_size == NUM_WORKERS
    assert status.num_duplicates == replayed
    assert status.num_applied == status.version == sum(total_steps)
    assert status.num_samples_applied == sum(total_samples)
    assert (status.num_rejected_stale, status.num_dropped_late, status.num_invalid) == (0, 0, 0)
    assert sum(status.staleness_histogram.values()) == status.num_applied

    # Worker 0's summary holds the same counters, read from the server at the end.
    summary = json.loads((Path(config.system.log_dir) / "summary.json").read_text())
    assert summary["strategy"] == "ps-async"
    assert summary["num_duplicates"] == replayed
    assert summary["steps"] == summary["shard_versions"][0] == sum(total_steps)
    assert summary["samples_applied"] == summary["samples_processed"] == sum(total_samples)
    assert [w["samples"] for w in summary["workers"]] == total_samples
    assert summary["staleness_histogram"] == {str(k): v for k, v in
                                              sorted(status.staleness_histogram.items())}
    assert summary["resumed_from_step"] is None  # worker 0's own: it never stopped


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_restart_without_resume_is_refused_and_pushes_nothing(tmp_path, cli):
    config = make_config(tmp_path)
    config_path = tmp_path / "config.yaml"
    config.save(config_path)
    folder = Path(config.system.checkpoint_dir) / f"worker{KILLED_RANK}"
    ckpt.save_checkpoint(folder, 5, {"strategy": "ps-worker"})

    with Cluster(tmp_path / "cluster") as cluster:
        (address,) = start_servers(cluster, config_path, 1)
        result = cli(*arguments(worker_spec(config_path, address, KILLED_RANK)), timeout=90)
        server = ShardClient(address, 0, RetryPolicy(timeout_s=10.0, max_attempts=1))
        try:
            status = server.unary("GetStatus", pb.StatusRequest())
        finally:
            server.close()

    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert str(folder) in errors[0] and "checkpoint_step00000005.pt" in errors[0]
    assert "--resume" in errors[0]
    assert (status.version, status.num_applied, status.num_duplicates) == (0, 0, 0)
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["checkpoint_step00000005.pt"]
