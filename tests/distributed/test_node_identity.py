"""An identity per node, on real servers (port 0) called by raw gRPC clients: a client
holding worker A's node token (made from the run's secret, as `disttrain ps` hands it to
worker A) or worker A's certificate (mutual TLS, `disttrain tls new`) cannot register,
heartbeat or report an exit as worker B on the coordinator, cannot register, push, pull
or meet a barrier as B on a shard, and cannot stop a shard in another role: each such
call is refused PERMISSION_DENIED naming the mismatch, and changes nothing. A holder of
the secret (the operator) may still act for any node."""

from __future__ import annotations

import grpc
import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.coordinator.node_info import heartbeat_message
from disttrain.coordinator.reports import NodeIdentity, NodeProgress, NodeReports
from disttrain.coordinator.service import CoordinatorServer
from disttrain.core.auth import new_token
from disttrain.core.channels import open_channel
from disttrain.core.credentials import Credentials
from disttrain.core.identity import node_token
from disttrain.core.pki import NodeName, write_run_pki
from disttrain.core.tls import TlsFiles
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.link import join
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model
from tests.distributed.test_ps_server import frames

pytestmark = pytest.mark.timeout(60)

SECRET = new_token()


def denied(attempt, *words: str) -> None:
    """`attempt` is refused PERMISSION_DENIED, its message naming `words`."""
    with pytest.raises((grpc.RpcError, CoordinatorError)) as raised:
        attempt()
    error = raised.value
    code = error.code() if isinstance(error, grpc.RpcError) else error.code
    message = error.details() if isinstance(error, grpc.RpcError) else str(error)
    assert code == grpc.StatusCode.PERMISSION_DENIED, message
    assert all(word in message for word in words), message


# --- coordinator ----------------------------------------------------------------------

def coordinator_nodes(client: CoordinatorClient) -> dict[str, tuple[str, int, int]]:
    return {node.node_id: (node.state, node.pid, node.restarts) for node in client.status().nodes}


@pytest.fixture(params=["node token", "client certificate"])
def coordinator(request, tmp_path):
    """A coordinator requiring the run's token or mutual TLS; worker A's and worker B's
    clients (each with its own identity), and the operator's."""
    if request.param == "node token":
        server = CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0", tmp_path / "cluster.db",
                                   credentials=Credentials(SECRET))
        clients = {name: CoordinatorClient(server.address, token=node_token(SECRET, name, "worker"))
                   for name in ("worker0", "worker1")}
        clients["operator"] = CoordinatorClient(server.address, token=SECRET)
    else:
        certs = tmp_path / "certs"
        write_run_pki(certs, ["localhost", "127.0.0.1"], [NodeName("worker0", "worker"),
                                                         NodeName("worker1", "worker")], days=1)

        def files(name: str) -> TlsFiles:
            return TlsFiles(str(certs / f"{name}.pem"), str(certs / f"{name}.key"), str(certs / "ca.pem"))
        server = CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0", tmp_path / "cluster.db",
                                   credentials=Credentials(tls=files("server")))
        clients = {name: CoordinatorClient(server.address, tls=files(name))
                   for name in ("worker0", "worker1")}
        clients["operator"] = CoordinatorClient(server.address, tls=files("server"))
    for name in ("worker0", "worker1"):
        clients[name].register(name, "worker", retry_s=0)
    yield clients
    for client in clients.values():
        client.close()
    server.stop(0)


def test_a_node_cannot_register_heartbeat_report_or_end_another(coordinator):
    a, operator = coordinator["worker0"], coordinator["operator"]
    before = coordinator_nodes(operator)
    victim = operator.status()
    (b_node,) = [node for node in victim.nodes if node.node_id == "worker1"]
    denied(lambda: a.register("worker1", "worker", retry_s=0), "worker0 (worker)", "'worker1'")
    denied(lambda: a.heartbeat(heartbeat_message("worker1", "worker", NodeProgress(0, 5, 1),
                                                 b_node.joined_generation)), "'worker1'")
    # with the pid and generation anyone may read from the status: still not B's to end
    denied(lambda: a.report_exit("worker1", 1, "forged", pid=b_node.pid, generation=b_node.joined_generation),
           "'worker1'")
    denied(lambda: a.register("worker0", "server", retry_s=0), "not a server")
    assert coordinator_nodes(operator) == before  # B alive, its pid and restarts as they were
    a.heartbeat(heartbeat_message("worker0", "worker", NodeProgress(0, 1, 1), b_node.joined_generation))
    # the operator (a launcher) tells the coordinator of any node's end
    assert operator.report_exit("worker1", 0, "finished", pid=b_node.pid,
                                generation=b_node.joined_generation).known
    assert coordinator_nodes(operator)["worker1"][0] == "done"


def test_a_shard_holding_the_secret_calls_the_coordinator_in_its_own_name(tmp_path):
    """A shard is handed the run's secret (it checks the workers' node tokens with it), but
    its tie to the coordinator calls as node server0 (role server), not as the operator:
    it cannot end a worker."""
    server = CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0", tmp_path / "cluster.db",
                               credentials=Credentials(SECRET))
    operator = CoordinatorClient(server.address, token=SECRET)
    worker = CoordinatorClient(server.address, token=node_token(SECRET, "worker0", "worker"))
    link = join(CoordinatorConfig(address=server.address, heartbeat_interval=60.0),
                NodeIdentity("server0", "server", 0, "127.0.0.1:1"),
                NodeReports(lambda: NodeProgress(0, 0, 0)), credentials=Credentials(SECRET))
    try:
        worker.register("worker0", "worker", retry_s=0)
        denied(lambda: link.client.report_exit("worker0", 1, "forged"), "server0 (server)", "'worker0'")
        assert coordinator_nodes(operator)["worker0"][0] == "alive"
        link.leave()  # its own end it may tell
        assert coordinator_nodes(operator)["server0"][0] == "done"
    finally:
        for client in (operator, worker):
            client.close()
        server.stop(0)


# --- a parameter-server shard ---------------------------------------------------------

@pytest.fixture
def shard(tmp_path):
    """A shard requiring the run's token; worker0 and worker1 registered, each with its
    node token; worker0 has pushed step 1."""
    config = config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd", "momentum": 0.9,
                     "learning_rate": 0.1, "checkpoint_interval": 1},
        "system": {"num_workers": 2, "checkpoint_dir": str(tmp_path / "ckpt")},
        "ps": {"aggregation_mode": "async"}})
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0", credentials=Credentials(SECRET))
    plan = plan_shards(init_model(config.training), 1)[0]
    clients = {}
    for name in ("worker0", "worker1"):
        clients[name] = PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0, max_attempts=1),
                                 transport="grpc",
                                 credentials=Credentials(node_token(SECRET, name, "worker")))
        clients[name].register(name)
    send(clients["worker0"], frames(plan, torch.ones(plan.numel), worker_id="worker0",
                                    session=clients["worker0"].shards[0].session))
    yield server, clients, plan
    for client in clients.values():
        client.close()
    server.stop(0)


def unary(channel, name, request_type, reply_type):
    return channel.unary_unary(wire.method_path(name), request_serializer=request_type.SerializeToString,
                               response_deserializer=reply_type.FromString)


def send(client, pieces):
    push = client.shards[0].channel.stream_unary(wire.method_path("SendGradients"),
                                                request_serializer=wire.identity,
                                                response_deserializer=pb.PushReply.FromString)
    return push(pieces, timeout=10)


def state_of(server):
    state = server.state
    return (state.parameters().clone(), state.version, state.ledger(0, 0),
            {k: v.clone() for k, v in state.optimizer.state.get(state.param, {}).items()})


def assert_same(server, before):
    after = state_of(server)
    assert torch.equal(after[0], before[0]) and after[1:3] == before[1:3]
    assert after[3].keys() == before[3].keys()
    assert all(torch.equal(after[3][k], before[3][k]) for k in after[3])


def test_a_worker_cannot_register_push_pull_or_meet_a_barrier_as_another(shard):
    server, clients, plan = shard
    a, b_session = clients["worker0"], clients["worker1"].shards[0].session
    before = state_of(server)
    channel = a.shards[0].channel
    denied(lambda: unary(channel, "RegisterWorker", pb.RegisterRequest, pb.WorkerAssignment)(
        pb.RegisterRequest(worker_id="worker1", requested_rank=-1, key=b"k" * 32), timeout=10),
        "worker0 (worker)", "'worker1'")
    # even with B's session in hand (it would pass the session check), B's push is not A's to make
    forged = frames(plan, torch.full((plan.numel,), 5.0), worker_id="worker1", step=1, session=b_session)
    denied(lambda: send(a, forged), "'worker1'")
    denied(lambda: unary(channel, "FetchParameters", pb.ParameterRequest, pb.ParameterMessage)(
        pb.ParameterRequest(worker_id="worker1", session=b_session), timeout=10), "'worker1'")
    denied(lambda: unary(channel, "Barrier", pb.BarrierRequest, pb.BarrierReply)(
        pb.BarrierRequest(worker_id="worker1", session=b_session, name="x"), timeout=10), "'worker1'")
    denied(lambda: unary(channel, "WorkerDone", pb.WorkerDoneRequest, pb.ShardStatus)(
        pb.WorkerDoneRequest(worker_id="worker1", session=b_session), timeout=10), "'worker1'")
    assert_same(server, before)
    # B goes on with its own session; A's own calls still pass
    reply = send(clients["worker1"], frames(plan, torch.ones(plan.numel), worker_id="worker1", step=2,
                                            session=b_session))
    assert reply.outcome == pb.PushReply.APPLIED and server.state.version == before[1] + 1


def test_only_the_worker_that_ends_the_run_may_stop_a_shard(shard):
    """Shutdown comes from the worker that writes the final model (rank 0 here), with its
    session, once every worker is done: another worker, a node of another role and a
    stolen id are refused before and after, so no one stops the shard before that
    worker's final pull."""
    server, clients, _ = shard
    rank = open_channel(server.address, token=node_token(SECRET, "rank0", "rank"))
    coordinator = open_channel(server.address, token=node_token(SECRET, "rank0", "coordinator"))
    worker0, worker1 = (clients[name].shards[0] for name in ("worker0", "worker1"))

    def stop(channel, **fields):
        return unary(channel, "Shutdown", pb.ShutdownRequest, pb.ShardStatus)(pb.ShutdownRequest(**fields),
                                                                             timeout=10)

    def refused(channel, code, worker_id, session):
        with pytest.raises(grpc.RpcError) as raised:
            stop(channel, worker_id=worker_id, session=session)
        assert raised.value.code() == code, raised.value.details()

    denial, early = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION

    try:
        denied(lambda: stop(rank), "rank0 (rank)", "only worker nodes or the operator")
        denied(lambda: stop(coordinator), "rank0 (coordinator)", "only worker nodes or the operator")
        refused(worker0.channel, early, "worker0", worker0.session)
        for name in ("worker0", "worker1"):
            clients[name].worker_done(name)
        assert server.state.rules.all_done()
        # every worker is done: still only worker0, as itself, with its session
        refused(worker1.channel, denial, "worker1", worker1.session)
        refused(worker1.channel, denial, "worker0", worker0.session)
        refused(worker0.channel, denial, "worker0", b"forged" * 3)
        assert not server.stopped.is_set()
        assert stop(worker0.channel, worker_id="worker0", session=worker0.session).num_done == 2
        assert server.stopped.is_set()
    finally:
        rank.close()
        coordinator.close()


def test_a_token_of_another_secret_or_tampered_is_refused_before_any_handler(shard):
    server, _, _ = shard
    genuine = node_token(SECRET, "worker1", "worker")
    forged = genuine[:-1] + ("1" if genuine.endswith("0") else "0")
    for token in (node_token(new_token(), "worker1", "worker"), forged, forged.replace("worker1", "worker0")):
        channel = open_channel(server.address, token=token)
        try:
            with pytest.raises(grpc.RpcError) as raised:
                unary(channel, "GetStatus", pb.StatusRequest, pb.ShardStatus)(pb.StatusRequest(), timeout=10)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            channel.close()
