"""An honest `disttrain ps` run with the user's secret (2 workers, sync) while a caller
holding worker 0's node token tries to act as worker 1 and a rank's token tries to stop
the shards: each worker process holds only its own node token (never the secret), every
forged call is refused PERMISSION_DENIED, and the run finishes with nothing lost and the
same model as the same run left alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from launched import Launched
from process_memory import environment_values, memory_holds

from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.coordinator.node_info import heartbeat_message
from disttrain.coordinator.registry import RegistryError, read_status
from disttrain.coordinator.reports import NodeProgress
from disttrain.core import forking
from disttrain.core.auth import TOKEN_ENV
from disttrain.core.channels import open_channel
from disttrain.core.identity import node_token
from disttrain.core.processes import PARENT_ENV
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.wire import service as wire

RUN = ["ps", "--workers", "2", "--dataset", "digits", "--num-epochs", "1", "--max-train-samples", "512",
       "--batch-size", "32", "--num-threads", "1", "--heartbeat-timeout", "60"]


def command(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "disttrain", *RUN, "--log-dir", str(tmp_path / name / "logs"),
            "--checkpoint-dir", str(tmp_path / name / "ckpt"), *extra]


def environment() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != TOKEN_ENV}, PARENT_ENV: str(os.getpid()),
            "PYTHONUNBUFFERED": "1"}


def nodes_once_up(registry: Path, names: set[str], process: subprocess.Popen) -> dict[str, dict]:
    """The registry's nodes once every one of `names` is alive there (the run is still going)."""
    while True:  # bounded by the test's timeout
        assert process.poll() is None, "the run ended before its processes could be seen"
        try:
            nodes = {node["node_id"]: node for node in read_status(registry).nodes}
        except RegistryError:
            nodes = {}
        if all(nodes.get(name, {}).get("state") == "alive" for name in names):
            return nodes
        time.sleep(0.1)


def token_in_memory(pid: int) -> str | None:
    """The token process `pid` set in its environment, read from its memory (a process
    forked from the fork server sets its environment after it started, so /proc/PID/environ
    shows the fork server's start-up variables); it must hold at most one."""
    values = environment_values(pid, TOKEN_ENV, rb"[\x21-\x7e]+")
    assert len(values) <= 1, f"process {pid} holds several tokens: {sorted(values)}"
    return next(iter(values), None)


def token_in_environment(pid: int) -> str | None:
    """The token process `pid` was started with (exec'd: its initial environment)."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    prefix = f"{TOKEN_ENV}=".encode()
    values = [entry[len(prefix):].decode() for entry in entries if entry.startswith(prefix)]
    return values[0] if values else None


def refused_code(attempt) -> grpc.StatusCode | None:
    try:
        attempt()
    except grpc.RpcError as e:
        return e.code()
    except CoordinatorError as e:
        return e.code
    return None


def final_model(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "ckpt" / "parameter_server_final.pt", weights_only=True)["model"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_honest_ps_run_ends_whole_and_unchanged_while_forged_calls_are_refused(tmp_path, cli):
    secret_file = tmp_path / "run.token"
    cli("token", "new", secret_file).check_returncode()
    secret = secret_file.read_text().strip()
    log = tmp_path / "attacked.out"
    with log.open("wb") as out:
        # worker 0 pauses after its step 2 (SIGSTOP, then SIGCONT), so the run is surely going
        process = forking.start(command(tmp_path, "attacked", "--token-file", str(secret_file),
                                        "--inject", "stop:worker=0:step=2:for=6s"),
                                environment(), out.fileno(), out.fileno(), parent_env=PARENT_ENV)
    try:
        nodes = nodes_once_up(tmp_path / "attacked" / "logs" / "cluster.db",
                              {"server0", "worker0", "worker1"}, process)
        for name in ("worker0", "worker1"):  # each worker was handed its own node token, not the secret
            assert token_in_memory(nodes[name]["pid"]) == node_token(secret, name, "worker")
            assert not memory_holds(nodes[name]["pid"], secret.encode())
        as_worker0 = node_token(secret, "worker0", "worker")
        shard = open_channel(nodes["server0"]["address"], token=as_worker0)
        register = shard.unary_unary(wire.method_path("RegisterWorker"),
                                     request_serializer=pb.RegisterRequest.SerializeToString,
                                     response_deserializer=pb.WorkerAssignment.FromString)
        push = shard.stream_unary(wire.method_path("SendGradients"), request_serializer=wire.identity,
                                  response_deserializer=pb.PushReply.FromString)
        header = pb.GradientMessage(worker_id="worker1", step=3, base_version=2, shard=0, num_samples=32,
                                    block_id=3)
        assert refused_code(lambda: register(pb.RegisterRequest(worker_id="worker1", requested_rank=1,
                                                                key=b"k" * 32), timeout=10)) \
            == grpc.StatusCode.PERMISSION_DENIED
        assert refused_code(lambda: push(iter([header.SerializeToString()]), timeout=10)) \
            == grpc.StatusCode.PERMISSION_DENIED
        rank = open_channel(nodes["server0"]["address"], token=node_token(secret, "rank0", "rank"))
        shutdown = rank.unary_unary(wire.method_path("Shutdown"),
                                    request_serializer=pb.ShutdownRequest.SerializeToString,
                                    response_deserializer=pb.ShardStatus.FromString)
        assert refused_code(lambda: shutdown(pb.ShutdownRequest(), timeout=10)) \
            == grpc.StatusCode.PERMISSION_DENIED
        # where the launcher's coordinator listens: in the config it hands every process
        config = yaml.safe_load((tmp_path / "attacked" / "logs" / "config.yaml").read_text())
        client = CoordinatorClient(config["coordinator"]["address"], token=as_worker0)
        victim = nodes["worker1"]
        assert refused_code(lambda: client.heartbeat(heartbeat_message(
            "worker1", "worker", NodeProgress(0, 99, 1), victim["joined_generation"]))) \
            == grpc.StatusCode.PERMISSION_DENIED
        assert refused_code(lambda: client.report_exit("worker1", 1, "forged", pid=victim["pid"],
                                                       generation=victim["joined_generation"])) \
            == grpc.StatusCode.PERMISSION_DENIED
        for channel in (shard, rank):
            channel.close()
        client.close()
        assert process.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    summary = json.loads((tmp_path / "attacked" / "logs" / "summary.json").read_text())
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == 512
    assert {node["node_id"]: node["restarts"] for node in read_status(
        tmp_path / "attacked" / "logs" / "cluster.db").nodes}["worker1"] == 0
    alone = Launched(command(tmp_path, "alone"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env=environment(), parent_env=PARENT_ENV)
    _, said = alone.communicate(timeout=240)
    assert alone.returncode == 0, said[-3000:]
    attacked, reference = final_model(tmp_path / "attacked"), final_model(tmp_path / "alone")
    assert attacked.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(attacked[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)


LIVE = ["ddp", "--ddp-recovery", "live", "--world-size", "2", "--dataset", "digits", "--num-epochs", "1",
        "--max-train-samples", "512", "--batch-size", "32", "--num-threads", "1",
        "--set", "coordinator.heartbeat_timeout=60"]


def start_with_secret(cli, tmp_path: Path, run: list[str], name: str, in_environment: bool = False
                      ) -> tuple[str, Path, subprocess.Popen]:
    """A new secret, and `disttrain RUN` started with it (in a file, or in its environment;
    rank 0 stopped for 6 s after step 2, so the run outlasts what the test looks at):
    (secret, log dir, process; its output in `<name>.out`)."""
    secret_file = tmp_path / "run.token"
    cli("token", "new", secret_file).check_returncode()
    secret = secret_file.read_text().strip()
    log_dir = tmp_path / "logs"
    given = [] if in_environment else ["--token-file", str(secret_file)]
    env = {**environment(), TOKEN_ENV: secret} if in_environment else environment()
    with (tmp_path / f"{name}.out").open("wb") as out:
        process = forking.start([sys.executable, "-m", "disttrain", *run, *given,
                                 "--log-dir", str(log_dir), "--checkpoint-dir", str(tmp_path / "ckpt"),
                                 "--inject", "stop:rank=0:step=2:for=6s"],
                                env, out.fileno(), out.fileno(), parent_env=PARENT_ENV)
    return secret, log_dir, process


def holds(pid: int, secret: str) -> bool:
    """Whether process `pid` was started with `secret` in its environment or argv."""
    return any(secret.encode() in Path(f"/proc/{pid}/{part}").read_bytes() for part in ("environ", "cmdline"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_live_ddp_ranks_call_the_coordinator_in_their_own_name(tmp_path, cli):
    """Each rank of a live-recovery run holds its own node token (rank R, role rank), never
    the secret: a heartbeat it forges for the other rank is refused, and the run ends."""
    secret, log_dir, process = start_with_secret(cli, tmp_path, LIVE, "live")
    try:
        nodes = nodes_once_up(log_dir / "cluster.db", {"rank0", "rank1"}, process)
        for name in ("rank0", "rank1"):
            assert token_in_memory(nodes[name]["pid"]) == node_token(secret, name, "rank")
            assert not memory_holds(nodes[name]["pid"], secret.encode())
        said = re.search(r"coordinator listening on (\S+)", (tmp_path / "live.out").read_text())
        client = CoordinatorClient(said.group(1), token=node_token(secret, "rank0", "rank"))
        victim = nodes["rank1"]
        assert refused_code(lambda: client.heartbeat(heartbeat_message(
            "rank1", "rank", NodeProgress(0, 99, 1), victim["joined_generation"]))) \
            == grpc.StatusCode.PERMISSION_DENIED
        client.close()
        assert process.wait(timeout=200) == 0, (tmp_path / "live.out").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["samples_lost"] == 0 and summary["samples_applied_twice"] == 0


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` that run their own program: a child between its
    fork and its exec still shows its parent's command line and environment (the loader
    workers start by spawn: fork, then exec), so it is left out until it has exec'd."""
    found = []
    parent = Path(f"/proc/{pid}/cmdline").read_bytes()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            lines = status.read_text().splitlines()
            if f"PPid:\t{pid}" in lines and (status.parent / "cmdline").read_bytes() != parent:
                found.append(int(status.parent.name))
        except OSError:  # it ended meanwhile
            continue
    return found


RESTART = ["ddp", "--world-size", "2", "--dataset", "digits", "--num-epochs", "1",
           "--max-train-samples", "512", "--batch-size", "32", "--num-threads", "1", "--loader-workers", "1",
           "--set", "coordinator.heartbeat_timeout=60"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_restart_mode_ranks_call_the_coordinator_in_their_own_name(tmp_path, cli):
    """torch's elastic agent hands every rank the environment it was given: the launcher
    keeps the run's secret out of it (the secret was given in the launcher's environment
    here, the way most likely to leak) and hands the ranks only the folder of their own
    node tokens; each rank calls the coordinator with its own alone (the coordinator takes
    its calls as rank R's, and the run finishes), and the processes a rank starts (its
    loader workers) get only that token. Nothing a rank or a loader worker was started with
    (environment, argv) holds the secret."""
    secret, log_dir, process = start_with_secret(cli, tmp_path, RESTART, "restart", in_environment=True)
    try:
        nodes = nodes_once_up(log_dir / "cluster.db", {"rank0", "rank1"}, process)
        for name in ("rank0", "rank1"):
            pid = nodes[name]["pid"]
            assert not holds(pid, secret), f"{name} was started with the run's secret"
            assert token_in_environment(pid) is None  # its own token it reads from its own file
            workers = children(nodes[name]["pid"])
            while not workers:  # started once its data is loaded; bounded by the test's timeout
                assert process.poll() is None, f"the run ended before {name}'s loader worker could be seen"
                time.sleep(0.1)
                workers = children(nodes[name]["pid"])
            assert {token_in_environment(pid) for pid in workers} == {node_token(secret, name, "rank")}
            assert not any(holds(pid, secret) for pid in workers)
        assert process.wait(timeout=200) == 0, (tmp_path / "restart.out").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["final_accuracy"] > 0
