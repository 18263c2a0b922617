"""The project's image built by a real container engine (`make image`: podman, else docker)
and the compose cluster of docker-compose.yml started by it: a coordinator, one shard
server and two workers, each in its container, on digits (nothing downloaded).

- The image: small, no compiler and no pip, run by a user without privileges.
- A run to the end: the summary and the final model read from the shared volume, every
  sample applied once by the shard's own ledger (its newest checkpoint).
- Credentials: the coordinator and the server hold the run's secret, each worker only its
  own node token; both servers refuse calls without a token (asked from this machine).
- A worker container killed mid-run by the engine (`kill`): the engine leaves a container
  stopped that way stopped, the coordinator declares the worker failed and the other one
  takes its blocks over; nothing is lost.
- A worker's process killed mid-run (as a crash or the kernel's OOM killer ends it): the
  engine restarts the container (restart: on-failure), the worker goes on from its own
  checkpoint (--resume); nothing is lost.

Skipped, saying why, where no engine can start containers (none installed, not root, or
the engine refuses to start one: see docker/podman_host.sh). The image's build is cached
by the engine: after a change to src/ alone, `make image` rebuilds the project's layer
only (under a minute); a first build takes a few minutes (docs/deploy.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import yaml
from conftest import REPO_ROOT

from disttrain.core.checkpoint import latest_checkpoint, load_checkpoint
from disttrain.proto import coordinator_pb2, parameter_server_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

IMAGE = "disttrain:latest"
BASE_IMAGE = "localhost/disttrain-base:bookworm"  # the Makefile's DEBIAN_BASE
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
CONFIG_IN_CONTAINER = "/app/config/digits.yaml"
# 2 workers of 512 samples each, batches of 8: 64 steps an epoch each, 320 in all, with a
# checkpoint every 10 steps; short heartbeats, so a dead worker is declared in seconds.
EPOCHS, TRAIN, BATCH, WORKERS = 5, 1024, 8, 2
RUN_CONFIG = {
    "training": {"dataset": "digits", "model_architecture": "mlp", "batch_size": BATCH,
                 "num_epochs": EPOCHS, "max_train_samples": TRAIN, "max_test_samples": 200,
                 "checkpoint_interval": 10, "optimizer": "adam", "learning_rate": 0.003, "seed": 3},
    "system": {"num_workers": WORKERS, "architecture": "parameter_server", "aggregation_mode": "sync",
               "heartbeat_interval": 0.5, "heartbeat_timeout": 3.0, "num_threads": 1},
}
RUN_TIMEOUT_S = 300


def run(*args, timeout: float = 120, env: dict | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)


def tail(result: subprocess.CompletedProcess, lines: int = 30) -> str:
    return "\n".join((result.stdout + result.stderr).splitlines()[-lines:])


def wait_until(predicate, timeout_s: float, what: str, on_timeout=lambda: ""):
    """Poll `predicate` until it returns something true (returned), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}\n{on_timeout()}")
        time.sleep(0.1)


def find_engine() -> tuple[str, list[str]] | str:
    """(engine, compose command) of the first engine that answers, or why there is none."""
    reasons = []
    for engine, compose in (("podman", ["podman-compose"]), ("docker", ["docker", "compose"])):
        if shutil.which(engine) is None:
            reasons.append(f"{engine} is not installed")
            continue
        info = run(engine, "info", timeout=60)
        if info.returncode != 0:
            reasons.append(f"`{engine} info` fails: {tail(info, 1)}")
            continue
        if shutil.which(compose[0]) is None or run(*compose, "version", timeout=60).returncode != 0:
            reasons.append(f"{engine} answers but {' '.join(compose)} does not")
            continue
        return engine, compose
    return "no container engine: " + "; ".join(reasons)


@pytest.fixture(scope="module")
def engine() -> SimpleNamespace:
    """The engine, and the image built by `make image` with it (once for this module)."""
    found = find_engine()
    if isinstance(found, str):
        pytest.skip(found)
    name, compose = found
    if os.geteuid() != 0:
        pytest.skip(f"not root: the test runs {name} as root (its base image is made by debootstrap, "
                    "and the shared folders are given to the containers' user)")
    base = run(REPO_ROOT / "docker" / "base.sh", name, BASE_IMAGE, timeout=900)
    probe = run(name, "run", "--rm", BASE_IMAGE, "true", timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"{name} cannot start a container here ({tail(probe, 1)}); docker/podman_host.sh "
                    "sets up a Debian host for podman")
    assert base.returncode == 0, tail(base)
    started = time.monotonic()
    build = run("make", "image", f"ENGINE={name}", timeout=1800, cwd=REPO_ROOT)
    build_s = time.monotonic() - started
    assert build.returncode == 0, tail(build, 60)
    print(f"make image: {build_s:.0f} s; {image_size(name) / 1e9:.2f} GB")
    return SimpleNamespace(name=name, compose=compose, build_s=build_s)


def image_size(engine: str) -> int:
    return int(run(engine, "image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())


class Cluster:
    """docker-compose.yml started by the engine, under its own project name, with its run
    folder (DISTTRAIN_RUN_DIR) in `run_dir` and this module's config."""

    def __init__(self, engine: SimpleNamespace, run_dir: Path):
        self.engine, self.run_dir = engine.name, run_dir
        self.project = f"disttrain-test-{os.getpid()}-{run_dir.parent.name}".lower().replace("_", "-")
        self.compose = [*engine.compose, "-p", self.project, "-f", COMPOSE_FILE]
        self.env = {**os.environ, "DISTTRAIN_RUN_DIR": str(run_dir), "DISTTRAIN_CONFIG": CONFIG_IN_CONTAINER}
        uid = run(self.engine, "run", "--rm", "--entrypoint", "id", IMAGE, "-u").stdout.strip()
        prepared = run(REPO_ROOT / "docker" / "cluster_env.sh", self.engine, IMAGE, uid, run_dir)
        assert prepared.returncode == 0, tail(prepared)
        (run_dir / "config" / "digits.yaml").write_text(yaml.safe_dump(RUN_CONFIG))
        self.checkpoints, self.log_dir = run_dir / "checkpoints", run_dir / "logs"

    def up(self) -> None:
        result = run(*self.compose, "up", "-d", "--no-build", env=self.env, timeout=300, cwd=REPO_ROOT)
        assert result.returncode == 0, tail(result)

    def down(self) -> None:
        run(*self.compose, "down", env=self.env, timeout=300, cwd=REPO_ROOT)
        run(self.engine, "network", "rm", "-f", f"{self.project}_training_net", timeout=60)

    def container(self, service: str) -> str:
        ids = run(self.engine, "ps", "-a", "--format", "{{.ID}}",
                  "--filter", f"label=com.docker.compose.project={self.project}",
                  "--filter", f"label=com.docker.compose.service={service}").stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, service: str, template: str) -> str:
        return run(self.engine, "inspect", "--format", template, self.container(service)).stdout.strip()

    def env_of(self, service: str) -> dict[str, str]:
        pairs = json.loads(self.inspect(service, "{{json .Config.Env}}"))
        return dict(pair.split("=", 1) for pair in pairs)

    def address(self, service: str) -> str:
        return self.inspect(service, "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}").split()[0]

    def output(self, service: str) -> str:
        result = run(self.engine, "logs", self.container(service))
        return result.stdout + result.stderr

    def state(self) -> str:
        return "\n".join(f"{service}: {self.inspect(service, '{{.State.Status}} exit {{.State.ExitCode}}')}, "
                         f"last lines:\n{self.output(service)[-1500:]}"
                         for service in ("coordinator", "parameter_server", "worker_0", "worker_1"))

    def finished(self) -> dict:
        """The run's summary, once written and the shard server has stopped (its last
        checkpoint, written as it stops, records the workers done)."""
        path = self.log_dir / "summary.json"
        wait_until(path.is_file, RUN_TIMEOUT_S, f"the run's summary {path}", self.state)
        wait_until(lambda: self.inspect("parameter_server", "{{.State.Status}}") == "exited", RUN_TIMEOUT_S,
                   "the shard server to stop", self.state)
        assert self.inspect("parameter_server", "{{.State.ExitCode}}") == "0", self.state()
        return json.loads(path.read_text())

    def secret(self) -> str:
        return (self.run_dir / "secrets" / "disttrain.env").read_text().strip().split("=", 1)[1]


@pytest.fixture
def cluster(engine, tmp_path):
    made = Cluster(engine, tmp_path / "run")
    try:
        yield made
    finally:
        made.down()


def call(address: str, service: str, method: str, request, reply_type, token: str | None):
    channel = grpc.insecure_channel(address)
    try:
        stub = channel.unary_unary(f"/disttrain.v1.{service}/{method}",
                                   request_serializer=type(request).SerializeToString,
                                   response_deserializer=reply_type.FromString)
        metadata = [("authorization", f"Bearer {token}")] if token is not None else []
        return stub(request, timeout=30, metadata=metadata, wait_for_ready=True)
    finally:
        channel.close()


def refused(address: str, service: str, method: str, request, reply_type, token: str | None) -> bool:
    with pytest.raises(grpc.RpcError) as raised:
        call(address, service, method, request, reply_type, token)
    return raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def assert_nothing_lost(cluster: Cluster, summary: dict) -> None:
    """The summary's counts, and the shard's own record, its newest checkpoint (as
    tests/integration/test_ps_server_restores.py and `disttrain chaos` read it): every
    sample of every epoch applied once, every block of every worker in its ledger, every
    worker done but those whose blocks were taken over."""
    total = EPOCHS * TRAIN
    assert summary["samples_applied"] == total and summary["samples_lost"] == 0, summary
    assert summary["epochs"] == EPOCHS and summary["final_accuracy"] > 0.8, summary
    newest = latest_checkpoint(cluster.checkpoints / "server0")
    rules = load_checkpoint(newest)["rules"]
    assert int(rules["counts"]["samples"]) == total, (newest.name, rules["counts"])
    blocks = rules["ledger"]["blocks"]
    assert len(blocks) == len(set(blocks)) == total // BATCH  # one block per batch of every worker and epoch
    assert sorted(rules["done"]) == sorted(set(range(WORKERS)) - set(summary["reassigned_workers"]))
    model = load_checkpoint(cluster.checkpoints / "parameter_server_final.pt")
    assert model["model"] and all(tensor.isfinite().all() for tensor in model["model"].values())


def test_the_image_is_small_has_no_build_tools_and_runs_as_a_user(engine):
    size = image_size(engine.name)
    assert size < 1.2e9, f"{IMAGE}: {size / 1e9:.2f} GB (docs/deploy.md quotes 1.08 GB)"
    user = run(engine.name, "image", "inspect", "--format", "{{.Config.User}}", IMAGE).stdout.strip()
    assert user == "disttrain"
    as_user = run(engine.name, "run", "--rm", "--network", "none", "--entrypoint", "sh", IMAGE, "-c",
                  "id -u; python3 -m pip --version 2>&1 | tail -1; disttrain configs")
    uid, no_pip, *configs = as_user.stdout.splitlines()
    assert uid != "0" and no_pip.endswith("No module named pip"), as_user.stdout + as_user.stderr
    assert any("ps_sync_mnist" in line for line in configs), as_user.stdout + as_user.stderr
    # No compiler, no pip, no wheels or pip cache left anywhere (looked for as root).
    as_root = run(engine.name, "run", "--rm", "--network", "none", "--user", "0", "--entrypoint", "sh", IMAGE,
                  "-c", "for tool in gcc cc c++ make pip pip3; do command -v $tool; done; "
                  "find / -xdev \\( -name '*.whl' -o -path '*/.cache/pip' \\) -print")
    assert as_root.returncode == 0 and as_root.stdout == "", as_root.stdout + as_root.stderr


def test_the_cluster_trains_to_the_end_with_every_node_authenticated(cluster):
    started = time.monotonic()
    cluster.up()
    summary = cluster.finished()
    print(f"cluster run: {time.monotonic() - started:.0f} s from `up` to the summary")
    assert summary["strategy"] == "ps-sync" and summary["world_size"] == WORKERS
    assert summary["final_model"].endswith("parameter_server_final.pt")
    assert_nothing_lost(cluster, summary)
    # Credentials: the servers hold the run's secret, each worker its own node token only.
    secret = cluster.secret()
    for service in ("coordinator", "parameter_server"):
        assert cluster.env_of(service)["DISTTRAIN_TOKEN"] == secret
        assert "without the run's token are refused" in cluster.output(service)
    for rank in range(WORKERS):
        token = cluster.env_of(f"worker_{rank}")["DISTTRAIN_TOKEN"]
        assert token.startswith(f"node~worker~worker{rank}~") and secret not in token
    assert {p.stat().st_mode & 0o777 for p in (cluster.run_dir / "secrets").iterdir()} == {0o600}
    # The coordinator (it stays up) refuses a call without the token or with a wrong one.
    coordinator = f"{cluster.address('coordinator')}:50050"
    status = ("CoordinatorService", "GetClusterStatus", coordinator_pb2.ClusterStatusRequest(),
              coordinator_pb2.ClusterStatus)
    assert refused(coordinator, *status, token=None) and refused(coordinator, *status, token="wrong")
    assert {n.node_id for n in call(coordinator, *status, token=secret).nodes} >= {"worker0", "worker1"}
    # The compose file's health check, run by the engine in the running container.
    if cluster.engine == "podman":
        check = run("podman", "healthcheck", "run", cluster.container("coordinator"))
        assert check.returncode == 0, tail(check)


def test_a_worker_container_killed_mid_run_loses_nothing(cluster):
    cluster.up()
    wait_until(lambda: list((cluster.checkpoints / "worker1").glob("checkpoint_step*.pt")), RUN_TIMEOUT_S,
               "worker1's first checkpoint", cluster.state)
    killed = run(cluster.engine, "kill", cluster.container("worker_1"))
    assert killed.returncode == 0, tail(killed)
    assert not (cluster.log_dir / "summary.json").exists()  # mid-run
    # The sync step now waits for worker1 until the coordinator declares it failed: the
    # shard server is up meanwhile, and refuses a call without the run's token.
    server = f"{cluster.address('parameter_server')}:50051"
    status = ("ParameterServerService", "GetStatus", parameter_server_pb2.StatusRequest(),
              parameter_server_pb2.ShardStatus)
    assert refused(server, *status, token=None)
    summary = cluster.finished()
    assert cluster.inspect("worker_1", "{{.State.Status}} {{.RestartCount}}") == "exited 0"  # left stopped
    assert summary["reassigned_workers"] == [1] and summary["samples_taken_over"] > 0, summary
    assert_nothing_lost(cluster, summary)


def test_a_worker_process_killed_mid_run_is_restarted_and_resumes(cluster):
    cluster.up()
    wait_until(lambda: list((cluster.checkpoints / "worker1").glob("checkpoint_step*.pt")), RUN_TIMEOUT_S,
               "worker1's first checkpoint", cluster.state)
    pid = int(cluster.inspect("worker_1", "{{.State.Pid}}"))
    os.kill(pid, signal.SIGKILL)
    summary = cluster.finished()
    assert int(cluster.inspect("worker_1", "{{.RestartCount}}")) == 1
    assert "resumed from /app/checkpoints/worker1/checkpoint_step" in cluster.output("worker_1")
    assert summary["reassigned_workers"] == [], summary
    assert_nothing_lost(cluster, summary)
