"""One shard cut off from the workers mid-step, in a whole parameter-server run: no worker
ever computes a gradient on parameters of different steps, and the run ends exact.

Real processes on one machine, no root: 2 `ps-server` shards and 2 `ps-worker`s in sync
mode on the bundled digits data set, each worker reaching shard 1 through its own TCP
proxy. A few steps in, worker 1's proxy holds the rest of its push to shard 1 from the
middle of it; once shard 0, reached directly, has applied that step (worker 0 has all it
needs), both proxies cut shard 1 off: every connection through them closes and new ones
are refused. Shard 1 stays a step behind while the workers retry. The test checks that
state on the servers themselves, then lets the link come back.

Every worker logs, for each step, the run's step of the parameters its gradient was
computed on and how far apart its shards' were (`ps/sync_step`, `ps/step_spread`, one
record per step): the test asserts that every gradient was computed on one step of both
shards, the step before it, and that the servers' ledgers account for every sample once.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from disttrain.core import forking
from disttrain.core.processes import PARENT_ENV
from disttrain.metrics.logger import read_metrics
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.worker.client import RetryPolicy
from disttrain.strategies.ps.worker.shard_client import ShardClient
from tests.multihost.netns import read_event

DISTTRAIN = [sys.executable, "-m", "disttrain"]
TRAIN, BATCH, EPOCHS, WORKERS = 512, 32, 2, 2
STEPS = EPOCHS * TRAIN // WORKERS // BATCH  # each worker's
RUN_ARGS = ["--dataset", "digits", "--model", "mlp", "--num-epochs", str(EPOCHS), "--batch-size", str(BATCH),
            "--max-train-samples", str(TRAIN), "--max-test-samples", "100", "--num-threads", "1",
            "--seed", "7", "--rpc-timeout", "20", "--checkpoint-interval", "2",
            "--set", "training.log_interval=1", "--set", "ps.payload_transport=grpc"]
HOLD_AFTER_BYTES = 935_000  # from worker 1 to shard 1: 5 pushes of 170 kB, and half one
REFUSALS = 5  # connections refused by each proxy before the link comes back (the workers
# reconnect with a backoff up to 1s)


class PartitionProxy:
    """Forwards 127.0.0.1:`port` to the server at `target_port`. With `hold_after`, once that
    many bytes went from the client to the server, it forwards part of the next read only and
    holds back everything else the client sends (the server still answers). `cut()` closes
    every connection and refuses new ones (accepts and closes them) until `heal()`; no byte
    held back ever reaches the server. A healed proxy forwards everything.

    Attributes:
        port: where the client connects.
        holding: set once the proxy holds back the client's bytes.
        refused_enough: set once `refusals` connections were refused during the cut.
    """

    def __init__(self, target_port: int, refusals: int, hold_after: int | None = None):
        self.target_port, self.hold_after, self.refusals = target_port, hold_after, refusals
        self.holding, self.refused_enough = threading.Event(), threading.Event()
        self.num_refused = 0
        self._forwarded = 0
        self._down = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self._down = True
            dropped, self._sockets = self._sockets, []
        self._shut(dropped)

    def heal(self) -> None:
        """Let the client reach the server again, and hold nothing more."""
        with self._lock:
            self._down, self.hold_after = False, None
            self.holding.clear()

    def close(self) -> None:
        self._listener.close()
        self.cut()

    @staticmethod
    def _shut(sockets: list[socket.socket]) -> None:
        for end in sockets:
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = None if self._down else socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:  # one accepted as the cut came is refused too
                refused = self._down
                if not refused:
                    self._sockets += [client, server]
            if refused:
                self._shut([end for end in (client, server) if end is not None])
                self.num_refused += 1
                if self.num_refused >= self.refusals:
                    self.refused_enough.set()
                continue
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if not upstream:
                    sink.sendall(data)
                    continue
                # Counting, holding and forwarding in one step under the lock: no byte read
                # once the proxy holds gets through on any of its connections.
                with self._lock:
                    if source not in self._sockets:  # closed by the cut
                        break
                    if self.holding.is_set():
                        continue
                    self._forwarded += len(data)
                    if self.hold_after is not None and self._forwarded >= self.hold_after:
                        sink.sendall(data[:len(data) // 2])  # the part of this message before the hold
                        self.holding.set()
                    else:
                        sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.close()
                except OSError:
                    pass


def start(command: list[str], log: Path) -> subprocess.Popen | forking.ForkedProcess:
    # this test as its launcher: servers print the address they bound, and die with the test
    # (forked from the test's fork server, as a launcher starts them)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        return forking.start(command, env, out.fileno(), out.fileno(), parent_env=PARENT_ENV)


def finished(process: subprocess.Popen, log: Path, timeout_s: float) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{log.name} still running after {timeout_s:g}s:\n"
                             f"{log.read_text()[-3000:]}") from e


def shard_version(address: str, shard: int) -> int:
    client = ShardClient(address, shard, RetryPolicy(timeout_s=10.0, max_attempts=3))
    try:
        return client.unary("GetStatus", pb.StatusRequest()).version
    finally:
        client.close()


def worker_command(rank: int, servers: str, folder: Path, *extra: str) -> list[str]:
    return [*DISTTRAIN, "ps-worker", "--servers", servers, "--rank", str(rank),
            "--worker-id", f"worker{rank}", *RUN_ARGS, "--log-dir", str(folder / "logs"),
            "--checkpoint-dir", str(folder / "ckpt"), *extra]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("restart", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["cut", "cut-and-worker-restarted"])
@pytest.mark.slow  # a cluster cut off mid-step: make test runs it
def test_a_shard_cut_off_mid_step_never_leaves_a_worker_training_on_two_steps(tmp_path, restart):
    """restart: worker 1 is also killed while cut off, and restarted with --resume once the
    link is back (as a supervisor would): shard 0 holds its push of the step it was in,
    shard 1 never got it, and no coordinator drops it from the step."""
    processes, proxies = [], []
    try:
        servers = []
        for shard in range(2):
            log = tmp_path / f"server{shard}.out"
            process = start([*DISTTRAIN, "ps-server", "--bind", "127.0.0.1:0", "--shard", f"{shard}/2",
                             "--workers", str(WORKERS), *RUN_ARGS, "--log-dir", str(tmp_path / "logs"),
                             "--checkpoint-dir", str(tmp_path / "ckpt")], log)
            processes.append((process, log))
            servers.append(read_event(log, "listening", process)["address"])
        shard1_port = int(servers[1].rsplit(":", 1)[1])
        proxies = [PartitionProxy(shard1_port, REFUSALS),  # worker 0's, worker 1's
                   PartitionProxy(shard1_port, REFUSALS, HOLD_AFTER_BYTES)]
        workers = []
        for rank in range(WORKERS):
            log = tmp_path / f"worker{rank}.out"
            through_proxy = f"{servers[0]},127.0.0.1:{proxies[rank].port}"
            workers.append((start(worker_command(rank, through_proxy, tmp_path), log), log))
        processes += workers

        assert proxies[1].holding.wait(120), "the run ended before worker 1's proxy held its push"
        # Mid-step: shard 0 applies the step (worker 0 gets shard 1's answer to the step
        # before and pushes); shard 1 cannot, and is then cut off from both workers.
        deadline = time.monotonic() + 60
        while shard_version(servers[0], 0) != shard_version(servers[1], 1) + 1:
            assert time.monotonic() < deadline, "shard 0 never applied the step worker 1 is held in"
            time.sleep(0.05)  # polling the shards' state: no event tells the test
        for proxy in proxies:
            proxy.cut()
        cut_at = time.monotonic()
        for proxy in proxies:
            assert proxy.refused_enough.wait(60), "the workers never came back to shard 1"
        behind = shard_version(servers[1], 1)
        assert shard_version(servers[0], 0) == behind + 1
        assert 0 < behind < STEPS
        assert all(process.poll() is None for process, _ in workers)
        if restart:
            workers[1][0].kill()
            workers[1][0].wait()
        for proxy in proxies:
            proxy.heal()
        cut_for_s = time.monotonic() - cut_at
        if restart:
            log = tmp_path / "worker1-resumed.out"
            through_proxy = f"{servers[0]},127.0.0.1:{proxies[1].port}"
            processes.append((start(worker_command(1, through_proxy, tmp_path, "--resume"), log), log))

        for process, log in processes:  # worker 0 stops the servers once every worker is done
            if not (restart and process is workers[1][0]):
                assert finished(process, log, 180) == 0, log.read_text()[-3000:]
    finally:
        for process, _ in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for proxy in proxies:
            proxy.close()

    for rank in range(WORKERS):
        records = [r for r in read_metrics(tmp_path / "logs" / f"worker{rank}" / "metrics.jsonl")
                   if "ps/sync_step" in r]
        assert {r["step"] for r in records} == set(range(1, STEPS + 1))
        for record in records:  # each gradient computed on one step of both shards
            assert record["ps/step_spread"] == 0, record
        if not restart:  # (a resumed worker's steps recomputed count among the run's steps)
            assert [r["step"] for r in records] == list(range(1, STEPS + 1))
            assert all(r["ps/sync_step"] == r["step"] - 1 for r in records), records  # the step before
    assert "retry" in (tmp_path / "worker0.out").read_text() + (tmp_path / "worker1.out").read_text()
    if restart:
        # Shard 1 never got worker 1's push of the step it waits in: its proxy let half of
        # it through and nothing after, and the killed worker pushes nothing more. So a
        # restarted worker that resumed from a checkpoint older than shard 1's version finds
        # shard 1 a step behind at its first pull and stands in (`SyncExchange.catch_up`
        # compares its shards' steps). From a checkpoint at that version its next push is
        # that very step (a duplicate on shard 0), which nobody waits for in its stead.
        resumed = (tmp_path / "worker1-resumed.out").read_text()
        found = re.search(r"resumed from \S+ \(epoch \d+, step (\d+)\)", resumed)
        assert found, resumed[-3000:]
        assert "standing in for the step" in resumed or int(found.group(1)) >= behind, \
            (behind, resumed[-3000:])
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["strategy"] == "ps-sync"
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == EPOCHS * TRAIN
    print(f"one-version figures: cut at shard 1's version {behind} (shard 0 at {behind + 1}) for "
          f"{cut_for_s:.1f}s, {sum(p.num_refused for p in proxies)} connections refused, samples_applied "
          f"{summary['samples_applied']}, samples_lost {summary['samples_lost']}, samples_redone "
          f"{summary.get('samples_redone')}, max_round_wait_s {summary['max_round_wait_s']:.2f}")
