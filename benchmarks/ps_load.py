"""Load on one parameter server: 32 clients push (and in sync mode pull) at once over
gRPC on loopback; pushes per second, p50 and p99 push latency, every error by status
code, and sync exactness at the end.

Two phases against a fresh `disttrain ps-server` each: async (every push applied at
once) and sync (each step waits for all 32). One client in eight also sends a push with a
NaN in it now and then: those must come back INVALID_ARGUMENT (the expected rejections)
and change nothing; any other error counts as an error. In the sync phase every client
pushes known gradients, so the server's final parameters must equal plain SGD on the
mean of them, step by step. Bounded: a set number of steps per client, and a deadline.
The clients are threads of this process (gRPC releases the GIL while a call is on the
wire); the server runs in its own process with one torch thread.

The server requires the run's credentials: each client calls with its own node token,
registers with a coordinator (its own id and rank), keeps a membership watch open there
and sends a heartbeat every step (its heartbeat latencies and errors are counted beside
its pushes'). Each phase runs three times, on a fresh server and coordinator each time:
alone; beside an outsider (its own process, no credentials) that holds 64 `Step` streams
which never send and 64 long-polls (`GetStatus` waiting for every worker to be done); and
beside an insider (its own process, holding the valid node token of one more worker of
the run, `intruder`, registered on the shard with a session of its own, and done at once
in sync mode so that no step waits for it) that hammers every shared resource it can
reach: silent `Step` streams, pushes it never finishes, observing waits, waits for all
done, pulls of a version that never comes, barriers of made-up names, membership watches
and registrations at the coordinator under the honest clients' ranks. Each attacker call
is opened again a second after the server ends or refuses it. Beside each attacker the
honest clients must get 0 errors and a p99 push latency within 2x of the run without it.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch
from common import parse_args, report

from disttrain.config import Config, CoordinatorConfig, config_from_dict
from disttrain.coordinator import CoordinatorServer
from disttrain.core import Cluster, Credentials, DistributedError, new_token, node_token, with_token
from disttrain.proto import coordinator_pb2 as cpb
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.proto import tensor_pb2
from disttrain.strategies.ps import (
    PSClient,
    RetryPolicy,
    block_id,
    flat_parameters,
    plan_shards,
    run_layout,
    start_servers,
)
from disttrain.strategies.ps.wire import codec
from disttrain.strategies.ps.wire import service as wire
from disttrain.training import init_model

NUM_CLIENTS = 32
LEARNING_RATE = 0.01
BATCH = 64
BAD_EVERY = 5  # a client that sends bad pushes sends one before every 5th step
DEADLINE_S = 300.0
IDLE_STREAMS = 64
LONG_POLLS = 64
REOPEN_S = 1.0  # the attacker opens a call again this long after the server ended it
SETTLE_S = 3.0  # the honest clients start this long after the attacker's calls are out
P99_RATIO_TARGET = 2.0
INSIDER = "intruder"  # the worker of the run whose valid node token the insider holds
ATTACKERS = (None, "outsider", "insider")
COORDINATOR = "/disttrain.v1.CoordinatorService/"
WATCH_S = 5.0  # an honest client's membership watch, opened again as it ends (as a node's watcher)
# How many of each kind of call the insider keeps open at once (each reopened as it ends).
INSIDER_CALLS = {"Step (silent)": 64, "SendGradients (never finished)": 8, "GetStatus (observing)": 32,
                 "GetStatus (all done)": 16, "FetchParameters (never)": 16, "Barrier (made up)": 16,
                 "WatchMembership": 64, "RegisterNode (others' ranks)": 4}


TOKEN_ENV = "DISTTRAIN_TOKEN"  # where a server started by a launcher finds the run's secret


def channel_as(address: str, token: str, **options) -> grpc.Channel:
    """A channel to `address` whose every call carries `token`."""
    return with_token(grpc.insecure_channel(address, **options), token)


def make_config(folder: Path, mode: str) -> Config:
    return config_from_dict({
        "training": {"dataset": "mnist", "model_architecture": "mlp", "mlp_hidden_size": 64,
                     "optimizer": "sgd", "momentum": 0.0, "learning_rate": LEARNING_RATE,
                     "batch_size": BATCH, "checkpoint_interval": 10**9, "num_epochs": 8},
        "system": {"num_workers": NUM_CLIENTS + 1, "num_threads": 1, "checkpoint_dir": str(folder / "ckpt"),
                   "log_dir": str(folder / "logs")},
        "ps": {"aggregation_mode": mode, "payload_transport": "grpc"}})


def gradient(client: int, step: int, numel: int) -> torch.Tensor:
    """The known gradient of `client` at `step` (varied, finite, small)."""
    return torch.linspace(-1.0, 1.0, numel) * (0.01 * (client + 1)) + 0.001 * step


class Client(threading.Thread):
    """One honest worker: its own node token, registered with the coordinator under its
    own id and rank (a watch kept open there, a heartbeat every step) and with the shard."""

    def __init__(self, index: int, address: str, plan, steps: int, mode: str, start: threading.Barrier,
                 batches_per_epoch: int, secret: str, coordinator: str):
        super().__init__(daemon=True)
        self.batches_per_epoch = batches_per_epoch  # the shard takes only a client's own blocks
        self.index, self.address, self.plan, self.steps, self.mode = index, address, plan, steps, mode
        self.start_barrier = start
        self.worker = f"load{index}"
        self.token = node_token(secret, self.worker, "worker")
        self.coordinator = coordinator
        self.latencies: list[float] = []
        self.heartbeat_latencies: list[float] = []
        self.errors: dict[str, int] = {}
        self.expected_rejections = 0
        self.bad = index % 8 == 0
        self.watching = threading.Event()
        self.finished = 0.0  # when its last step ended (perf_counter)
        self._watch_call = None

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # recorded and reported, not raised in a thread
            self.errors[type(e).__name__ + ": " + str(e)[:120]] = 1

    def _run(self) -> None:
        client = PSClient([self.address], [self.plan], RetryPolicy(timeout_s=60.0, max_attempts=1),
                          credentials=Credentials(self.token))
        worker = self.worker
        channel = channel_as(self.coordinator, self.token)
        register = channel.unary_unary(COORDINATOR + "RegisterNode",
                                       request_serializer=cpb.RegisterNodeRequest.SerializeToString,
                                       response_deserializer=cpb.RegisterNodeReply.FromString)
        beat = channel.unary_unary(COORDINATOR + "SendHeartbeat",
                                   request_serializer=cpb.HeartbeatMessage.SerializeToString,
                                   response_deserializer=cpb.HeartbeatReply.FromString)
        register(cpb.RegisterNodeRequest(node_id=worker, role="worker", rank=self.index, pid=os.getpid()),
                 timeout=60)
        watcher = threading.Thread(target=self._watch, args=(channel,), daemon=True)
        watcher.start()
        client.register(worker, requested_rank=self.index)
        flat = self.flat = torch.zeros(self.plan.numel)
        self.start_barrier.wait()
        version = 0
        for step in range(1, self.steps + 1):
            self._heartbeat(beat, step)
            epoch, index = divmod(step - 1, self.batches_per_epoch)  # its batch of the step
            header = pb.GradientMessage(worker_id=worker, step=step, base_version=version, shard=0,
                                        num_samples=BATCH, epoch=epoch,
                                        block_id=block_id(epoch, self.index, index, NUM_CLIENTS + 1,
                                                          self.batches_per_epoch))
            if self.bad and step % BAD_EVERY == 0:
                self._push_bad(client, header)
            started = time.perf_counter()
            try:
                reply = client.push([header], gradient(self.index, step, self.plan.numel), [0])[0]
            except DistributedError as e:
                self._count(status_of(e))
                continue
            self.latencies.append(time.perf_counter() - started)
            version = reply.version
            if self.mode == "sync":  # the next step starts from the round this one completes
                version = client.pull(worker, flat, [step])[0]
        self.finished = time.perf_counter()
        client.close()
        self.watching.set()
        if self._watch_call is not None:
            self._watch_call.cancel()
        watcher.join(timeout=WATCH_S + 5)
        channel.close()

    def _heartbeat(self, beat, step: int) -> None:
        started = time.perf_counter()
        try:
            beat(cpb.HeartbeatMessage(node_id=self.worker, role="worker", pid=os.getpid(), step=step),
                 timeout=30)
            self.heartbeat_latencies.append(time.perf_counter() - started)
        except grpc.RpcError as e:
            self._count(f"SendHeartbeat {e.code().name}")

    def _watch(self, channel: grpc.Channel) -> None:
        """Keep one membership watch open until the client is done, as a node's watcher
        does; a watch that ends at its deadline is a watch served, any other end an error."""
        watch = channel.unary_unary(COORDINATOR + "WatchMembership",
                                    request_serializer=cpb.MembershipRequest.SerializeToString,
                                    response_deserializer=cpb.Membership.FromString)
        generation = 0
        while not self.watching.is_set():
            request = cpb.MembershipRequest(after_generation=generation)
            self._watch_call = watch.future(request, timeout=WATCH_S)
            try:
                generation = self._watch_call.result().generation
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    self._count(f"WatchMembership {e.code().name}")
                    self.watching.wait(REOPEN_S)

    def _push_bad(self, client: PSClient, header: pb.GradientMessage) -> None:
        bad = gradient(self.index, 0, self.plan.numel)
        bad[self.index % self.plan.numel] = float("nan")
        try:
            client.push([header], bad, [0])
            self._count("a NaN push was accepted")
        except DistributedError as e:
            if status_of(e) == grpc.StatusCode.INVALID_ARGUMENT.name:
                self.expected_rejections += 1
            else:
                self._count(status_of(e))

    def _count(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def status_of(error: DistributedError) -> str:
    """The gRPC status a client call failed with (the client wraps the RpcError)."""
    cause = error.__cause__
    return cause.code().name if isinstance(cause, grpc.RpcError) else f"{type(error).__name__}: {error}"


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def attack(address: str, coordinator: str, secret: str, stop, ready, results) -> None:
    """The outsider: hold IDLE_STREAMS silent `Step` streams and LONG_POLLS `GetStatus`
    waits on the server at `address`, without credentials, until `stop` is set, each
    opened again REOPEN_S after it ends; put on `results` how each kind of call ended.
    `ready` is set once every call has been sent and the server has had SETTLE_S to take
    them in."""
    del coordinator, secret  # it reaches the shard alone, and holds no credentials
    torch.set_num_threads(1)
    channel = grpc.insecure_channel(address, options=wire.CHANNEL_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=60)
    step = channel.stream_stream(wire.method_path("Step"), request_serializer=wire.identity,
                                 response_deserializer=wire.identity)
    status = channel.unary_unary(wire.method_path("GetStatus"),
                                 request_serializer=pb.StatusRequest.SerializeToString,
                                 response_deserializer=pb.ShardStatus.FromString)

    def silent():
        stop.wait()
        yield from ()

    results.put(hold_all({
        "Step": (lambda: step(silent(), timeout=DEADLINE_S), IDLE_STREAMS),
        "GetStatus": (lambda: status.future(pb.StatusRequest(wait_all_done=True), timeout=DEADLINE_S),
                      LONG_POLLS)}, stop, ready))
    channel.close()


def insider(address: str, coordinator: str, secret: str, mode: str, stop, ready, results) -> None:
    """Hold `INSIDER_CALLS` calls of each kind as worker `INSIDER`, with its own valid node
    token and (registered on the shard at rank NUM_CLIENTS, with its own rank at the
    coordinator) its own session, until `stop` is set; each reopened REOPEN_S after it
    ends. Puts on `results` how each kind of call ended; sets `ready` as `attack` does."""
    torch.set_num_threads(1)
    token = node_token(secret, INSIDER, "worker")
    shard = channel_as(address, token, options=wire.CHANNEL_OPTIONS)
    coord = channel_as(coordinator, token)
    grpc.channel_ready_future(shard).result(timeout=60)

    def unary(channel, path, request_type, reply_type=None):
        return channel.unary_unary(path, request_serializer=request_type.SerializeToString,
                                   response_deserializer=(reply_type or request_type).FromString)

    shard_call = {name: unary(shard, wire.method_path(name), request, reply) for name, request, reply in (
        ("GetStatus", pb.StatusRequest, pb.ShardStatus), ("Barrier", pb.BarrierRequest, pb.BarrierReply))}
    fetch = shard.unary_unary(wire.method_path("FetchParameters"),
                              request_serializer=pb.ParameterRequest.SerializeToString,
                              response_deserializer=wire.identity)
    step = shard.stream_stream(wire.method_path("Step"), request_serializer=wire.identity,
                               response_deserializer=wire.identity)
    send = shard.stream_unary(wire.method_path("SendGradients"), request_serializer=wire.identity,
                              response_deserializer=pb.PushReply.FromString)
    register_node = unary(coord, COORDINATOR + "RegisterNode", cpb.RegisterNodeRequest, cpb.RegisterNodeReply)
    watch = unary(coord, COORDINATOR + "WatchMembership", cpb.MembershipRequest, cpb.Membership)
    status = unary(coord, COORDINATOR + "GetClusterStatus", cpb.ClusterStatusRequest, cpb.ClusterStatus)
    session = join_as_insider(address, coordinator, secret, mode)  # a worker of the run, to anyone's eyes
    header = pb.GradientMessage(worker_id=INSIDER, step=1, shard=0, num_samples=BATCH, session=session)
    first_frame = next(codec.encode_frames(header, wire.GRADIENT_PAYLOAD_FIELD,
                                           tensor_pb2.TensorProto(shape=[1 << 20], dtype="float32"),
                                           memoryview(bytes(1 << 16))))
    names = iter(range(10**9))

    def latest() -> int:
        """The membership's generation now, so that the next watch waits."""
        try:
            return status(cpb.ClusterStatusRequest(), timeout=60).generation
        except grpc.RpcError:
            return 0

    def silent():
        stop.wait()
        yield from ()

    def unfinished():
        yield first_frame
        stop.wait()

    opens = {
        "Step (silent)": lambda: step(silent(), timeout=DEADLINE_S),
        "SendGradients (never finished)": lambda: send.future(unfinished(), timeout=DEADLINE_S),
        "GetStatus (observing)": lambda: shard_call["GetStatus"].future(
            pb.StatusRequest(wait_all_done=True), timeout=DEADLINE_S),
        "GetStatus (all done)": lambda: shard_call["GetStatus"].future(
            pb.StatusRequest(wait_all_done=True, worker_id=INSIDER, session=session), timeout=DEADLINE_S),
        "FetchParameters (never)": lambda: fetch.future(
            pb.ParameterRequest(worker_id=INSIDER, session=session, shard=0, min_version=10**9),
            timeout=DEADLINE_S),
        "Barrier (made up)": lambda: shard_call["Barrier"].future(
            pb.BarrierRequest(worker_id=INSIDER, session=session, name=f"made-up{next(names)}", values=[1.0]),
            timeout=2.0),
        "WatchMembership": lambda: watch.future(cpb.MembershipRequest(after_generation=latest()),
                                                timeout=DEADLINE_S),
        "RegisterNode (others' ranks)": lambda: register_node.future(
            cpb.RegisterNodeRequest(node_id=INSIDER, role="worker", rank=next(names) % NUM_CLIENTS,
                                    pid=os.getpid()), timeout=60),
    }
    ended = hold_all({kind: (opens[kind], count) for kind, count in INSIDER_CALLS.items()}, stop, ready)
    results.put(ended)
    shard.close()
    coord.close()


def join_as_insider(address: str, coordinator: str, secret: str, mode: str) -> bytes:
    """Register worker `INSIDER` with the coordinator (its own rank, NUM_CLIENTS) and the
    shard, as itself, and (sync mode) tell the shard it is done, so that no synchronous
    step waits for it; its session. Every phase does, the insider's or not: the run is the
    same, whoever holds that worker's token."""
    token = node_token(secret, INSIDER, "worker")

    def unary(channel, path, request_type, reply_type):
        return channel.unary_unary(path, request_serializer=request_type.SerializeToString,
                                   response_deserializer=reply_type.FromString)

    with channel_as(coordinator, token) as coord, channel_as(address, token) as shard:
        unary(coord, COORDINATOR + "RegisterNode", cpb.RegisterNodeRequest, cpb.RegisterNodeReply)(
            cpb.RegisterNodeRequest(node_id=INSIDER, role="worker", rank=NUM_CLIENTS, pid=os.getpid()),
            timeout=60)
        session = unary(shard, wire.method_path("RegisterWorker"), pb.RegisterRequest, pb.WorkerAssignment)(
            pb.RegisterRequest(worker_id=INSIDER, requested_rank=NUM_CLIENTS, key=os.urandom(32)),
            timeout=60).session
        if mode == "sync":
            unary(shard, wire.method_path("WorkerDone"), pb.WorkerDoneRequest, pb.ShardStatus)(
                pb.WorkerDoneRequest(worker_id=INSIDER, session=session), timeout=60)
    return session


def hold_all(calls: dict, stop, ready) -> list[dict]:
    """Keep `count` calls of each kind open (each `open()`ed again REOPEN_S after it ends)
    until `stop`; `ready` set SETTLE_S after the first are out. How each kind ended."""
    ended: dict[tuple[str, str], int] = {}
    lock = threading.Lock()

    def hold(kind: str, open_call) -> None:
        while not stop.is_set():
            call = open_call()
            try:
                call.result() if hasattr(call, "result") else list(call)
                outcome = "OK"
            except grpc.RpcError as e:  # refused, cancelled or timed out: open it again
                outcome = e.code().name
            finally:
                call.cancel()
            with lock:
                ended[kind, outcome] = ended.get((kind, outcome), 0) + 1
            stop.wait(REOPEN_S)

    holders = [threading.Thread(target=hold, args=(kind, open_call), daemon=True)
               for kind, (open_call, count) in calls.items() for _ in range(count)]
    for holder in holders:
        holder.start()
    stop.wait(SETTLE_S)  # the calls reach the servers and are held or refused
    ready.set()
    stop.wait()
    with lock:
        return [{"call": kind, "outcome": outcome, "count": count}
                for (kind, outcome), count in sorted(ended.items())]


def phase(mode: str, steps: int, attacker: str | None) -> dict:
    secret = new_token()
    with tempfile.TemporaryDirectory() as tmp, \
            Cluster(Path(tmp) / "logs", env={TOKEN_ENV: secret}) as cluster:  # the server's, as a launcher's
        config = make_config(Path(tmp), mode)
        path = Path(tmp) / "config.yaml"
        config.save(path)
        address = start_servers(cluster, path, 1)[0]
        context = multiprocessing.get_context("spawn")
        stop, started = context.Event(), context.Queue()
        coordinator = context.Process(target=serve_coordinator, daemon=True,  # its own process, as in a run
                                      args=(Path(tmp) / "cluster.db", secret, stop, started))
        coordinator.start()
        try:
            return run_phase(mode, steps, attacker, config, address, started.get(timeout=120), secret)
        finally:
            stop.set()
            coordinator.join(timeout=30)


def serve_coordinator(registry: Path, secret: str, stop, started) -> None:
    """A coordinator requiring the run's credentials, until `stop`; its address on `started`."""
    torch.set_num_threads(1)
    server = CoordinatorServer(CoordinatorConfig(heartbeat_interval=60.0, heartbeat_timeout=3600.0,
                                                 reassign_after=None), "127.0.0.1:0", registry,
                               credentials=Credentials(secret))
    started.put(server.address)
    stop.wait()
    server.stop(0)


def run_phase(mode: str, steps: int, attacker: str | None, config: Config, address: str, coordinator: str,
              secret: str) -> dict:
    model = init_model(config.training)
    initial, _ = flat_parameters(model)
    initial = initial.clone()
    plan = plan_shards(model, 1)[0]
    start = threading.Barrier(NUM_CLIENTS + 1)
    batches = run_layout(config).batches_per_epoch
    clients = [Client(i, address, plan, steps, mode, start, batches, secret, coordinator)
               for i in range(NUM_CLIENTS)]
    context = multiprocessing.get_context("spawn")
    stop, ready, attack_results = context.Event(), context.Event(), context.Queue()
    intruder = None
    if attacker != "insider":  # the same worker joins, honest this time
        join_as_insider(address, coordinator, secret, mode)
    if attacker == "outsider":
        intruder = context.Process(target=attack, daemon=True,
                                   args=(address, coordinator, secret, stop, ready, attack_results))
    elif attacker == "insider":
        intruder = context.Process(target=insider, daemon=True,
                                   args=(address, coordinator, secret, mode, stop, ready, attack_results))
    if intruder:
        intruder.start()
        if not ready.wait(timeout=120):
            raise RuntimeError("the attacker process did not start its calls within 120 s")
    for client in clients:
        client.start()
    start.wait(timeout=120)
    began = time.perf_counter()
    for client in clients:
        client.join(timeout=max(1.0, DEADLINE_S - (time.perf_counter() - began)))
    elapsed = max(client.finished for client in clients) - began
    attack_calls = None
    if intruder:
        stop.set()
        attack_calls = attack_results.get(timeout=60)  # how the attacker's calls ended, by kind
        intruder.join(timeout=30)
    hung = sum(client.is_alive() for client in clients)
    latencies = [s for client in clients for s in client.latencies]
    beats = [s for client in clients for s in client.heartbeat_latencies]
    errors: dict[str, int] = {}
    for client in clients:
        for key, count in client.errors.items():
            errors[key] = errors.get(key, 0) + count
    result = {
        "mode": mode, "attacker": attacker, "clients": NUM_CLIENTS, "steps_per_client": steps,
        "seconds": elapsed,
        "pushes": len(latencies), "pushes_per_s": len(latencies) / elapsed,
        "push_latency_p50_ms": 1e3 * statistics.median(latencies) if latencies else None,
        "push_latency_p99_ms": 1e3 * percentile(latencies, 0.99) if latencies else None,
        "heartbeats": len(beats),
        "heartbeat_latency_p99_ms": 1e3 * percentile(beats, 0.99) if beats else None,
        "expected_rejections": sum(client.expected_rejections for client in clients),
        "errors": errors, "clients_still_running": hung, "attacker_calls_ended": attack_calls,
    }
    if mode == "sync" and not hung:
        result["exact"] = sync_exact([client.flat for client in clients], plan, initial, steps)
    return result


def sync_exact(pulled: list[torch.Tensor], plan, initial: torch.Tensor, steps: int) -> dict:
    """The parameters every client pulled after its last step against SGD on the mean of
    every step's known gradients."""
    expected = initial.clone()
    for step in range(1, steps + 1):
        mean = torch.stack([gradient(c, step, plan.numel) for c in range(NUM_CLIENTS)]).mean(dim=0)
        expected -= LEARNING_RATE * mean
    difference = max((flat - expected).abs().max().item() for flat in pulled)
    return {"max_abs_difference": difference, "holds": difference < 1e-5}


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    torch.set_num_threads(1)
    steps = 5 if args.quick else 40
    # The phases of a mode alternate, repeat after repeat, so that the machine's drift hits
    # each alike; a ratio compares the medians of each one's p99 over the repeats.
    phases = [dict(phase(mode, steps, attacker), repeat=repeat) for mode in ("async", "sync")
              for repeat in range(args.repeats) for attacker in ATTACKERS]
    medians = {f"{mode} {attacker}": median_p99(phases, mode, attacker)
               for mode in ("async", "sync") for attacker in ATTACKERS}
    ratios = {f"{mode} {attacker}": medians[f"{mode} {attacker}"] / medians[f"{mode} None"]
              for mode in ("async", "sync") for attacker in ATTACKERS if attacker}
    ok = all(not p["errors"] and not p["clients_still_running"] for p in phases) and \
        all(p.get("exact", {}).get("holds", False) for p in phases if p["mode"] == "sync")
    within = all(ratio <= P99_RATIO_TARGET for ratio in ratios.values())
    report("ps_load", {"repeats": args.repeats, "phases": phases, "median_p99_ms": medians,
                       "p99_ratio_with_attacker": ratios, "p99_target_met": within, "passed": ok},
           args.output,
           target="zero errors beside the expected INVALID_ARGUMENT rejections; sync exact at the end; "
                  f"the median over the repeats of the p99 push latency beside each attacker (outsider, "
                  f"insider) within {P99_RATIO_TARGET:g}x of the run without one")


def median_p99(phases: list[dict], mode: str, attacker: str | None) -> float:
    """The median over the repeats of the honest clients' p99 push latency (ms) in `mode`
    beside `attacker` (None: alone)."""
    return statistics.median(p["push_latency_p99_ms"] for p in phases
                             if p["mode"] == mode and p["attacker"] == attacker)


if __name__ == "__main__":
    main()
