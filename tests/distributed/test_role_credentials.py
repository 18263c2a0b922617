"""Credentials bound to roles, on real servers (port 0) and real TLS: certificates of
`disttrain tls new` name their run and role, and

- a client of the run takes a server's certificate only for the service it names: a
  worker's certificate (or another shard's, or the coordinator's) serving as the
  coordinator's or shard 0's is refused by the worker's own client, before any call;
- a server takes a client certificate of its CA only when it names a role of its run:
  one naming no role, or another run, is refused UNAUTHENTICATED and changes nothing,
  unless the operator names it (`--tls-operator`);
- a node registers with the coordinator only in its credential's role.
"""

from __future__ import annotations

import grpc
import pytest
from tls_certs import issue, issue_for_run, run_authority

from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.coordinator.service import CoordinatorServer
from disttrain.core.channels import channel_credentials
from disttrain.core.credentials import Credentials
from disttrain.core.errors import DistributedError
from disttrain.core.pki import NodeName, write_run_pki
from disttrain.core.tls import TlsFiles
from disttrain.proto import coordinator_pb2 as cpb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model
from tests.distributed.test_ps_server import make_config

pytestmark = pytest.mark.timeout(60)

NODES = ("coordinator", "server0", "server1", "worker0", "worker1")
COORDINATOR_PATH = "/disttrain.v1.CoordinatorService/"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run's certificates (`tls new`), a certificate of its CA naming no role, and
    certificates of its CA naming another run: {name: TlsFiles}."""
    folder = tmp_path_factory.mktemp("certs")
    write_run_pki(folder, ["localhost", "127.0.0.1"], [NodeName(n, n.rstrip("0123456789")) for n in NODES],
                  days=1, run_id="this-run")
    ca = str(folder / "ca.pem")
    files = {name: TlsFiles(str(folder / f"{name}.pem"), str(folder / f"{name}.key"), ca)
             for name in (*NODES, "server")}
    authority = run_authority(folder)
    cert, key = issue(authority, folder, "node7")  # CN only: no role, no run
    files["no role"] = TlsFiles(str(cert), str(key), ca)
    for node_id, role in (("worker0", "worker"), ("server", "operator")):
        cert, key = issue_for_run(authority, folder, node_id, role, "another-run")
        files[f"{role} of another run"] = TlsFiles(str(cert), str(key), ca)
    return files


def members(server: CoordinatorServer) -> list:
    return server.state.membership.members()


def coordinator_server(tmp_path, tls: TlsFiles) -> CoordinatorServer:
    return CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0", tmp_path / f"{id(tls)}.db",
                             credentials=Credentials(tls=tls))


@pytest.mark.parametrize("served_by", ["worker1", "server0", "coordinator", "server"])
def test_only_a_coordinators_certificate_serves_as_the_coordinator(tmp_path, run, served_by):
    """A worker's certificate (or a shard's) presented by a server posing as the
    coordinator is refused by the worker's client, which checks only its CA today: the
    worker neither registers nor sends anything there. The coordinator's certificate, and
    the operator's, serve."""
    server = coordinator_server(tmp_path, run[served_by])
    client = CoordinatorClient(server.address, timeout_s=5.0, tls=run["worker0"])
    try:
        if served_by in ("coordinator", "server"):
            assert client.register("worker0", "worker", retry_s=0).generation >= 1
            assert [n.node_id for n in members(server)] == ["worker0"]
        else:
            with pytest.raises(CoordinatorError) as raised:
                client.register("worker0", "worker", retry_s=0)
            assert raised.value.code == grpc.StatusCode.UNAVAILABLE  # no TLS session: nothing sent
            assert "is not this run's coordinator" in str(raised.value)
            assert members(server) == []
    finally:
        client.close()
        server.stop(0)


# A refused certificate costs the client its whole 5 s deadline: those cases are slow.
REFUSED_AFTER_THE_DEADLINE = [pytest.param(name, marks=pytest.mark.slow)
                              for name in ("worker1", "server1", "coordinator")]


@pytest.mark.parametrize("served_by", [*REFUSED_AFTER_THE_DEADLINE, "server0", "server"])
def test_only_shard_zeros_certificate_serves_as_shard_zero(tmp_path, run, served_by):
    """A worker's client of shard 0 takes the certificate of node server0 (or the
    operator's), not a worker's, another shard's or the coordinator's."""
    config = make_config(tmp_path)
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0",
                         credentials=Credentials(tls=run[served_by]))
    plan = plan_shards(init_model(config.training), 1)[0]
    client = PSClient([server.address], [plan], RetryPolicy(timeout_s=5.0, max_attempts=1), transport="grpc",
                      credentials=Credentials(tls=run["worker0"]))
    try:
        if served_by in ("server0", "server"):
            assert client.register("worker0").world_size == 1
        else:
            # no TLS session: the client waits for a server it can take, then gives up
            with pytest.raises(DistributedError, match="UNAVAILABLE|DEADLINE_EXCEEDED"):
                client.register("worker0")
            assert server.state.version == 0
    finally:
        client.close()
        server.stop(0)


def raw_call(address: str, tls: TlsFiles, method: str, request, reply_type):
    with grpc.secure_channel(address, channel_credentials(tls)) as channel:
        call = channel.unary_unary(COORDINATOR_PATH + method, request_serializer=request.SerializeToString,
                                   response_deserializer=reply_type.FromString)
        return call(request, timeout=10)


def code_of(attempt) -> grpc.StatusCode:
    try:
        attempt()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def register_as(address: str, tls: TlsFiles, node_id: str, role: str) -> grpc.StatusCode:
    return code_of(lambda: raw_call(address, tls, "RegisterNode", cpb.RegisterNodeRequest(
        node_id=node_id, role=role, rank=0, pid=1), cpb.RegisterNodeReply))


@pytest.mark.parametrize("holder", ["no role", "worker of another run", "operator of another run"])
def test_a_certificate_of_the_ca_naming_no_role_of_the_run_is_refused(tmp_path, run, holder):
    """A certificate the run's CA signed that names no role (it was the operator's: it
    could register any node in any role), or that names another run, is refused
    UNAUTHENTICATED on every call, and the coordinator's membership stays as it was."""
    server = coordinator_server(tmp_path, run["coordinator"])
    try:
        assert register_as(server.address, run["worker1"], "worker1", "worker") == grpc.StatusCode.OK
        before = [(n.node_id, n.role, n.state) for n in members(server)]
        for node_id, role in (("coordinator", "coordinator"), ("worker1", "worker"), ("worker0", "worker")):
            assert register_as(server.address, run[holder], node_id, role) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: raw_call(server.address, run[holder], "GetClusterStatus",
                                        cpb.ClusterStatusRequest(), cpb.ClusterStatus)) \
            == grpc.StatusCode.UNAUTHENTICATED
        assert [(n.node_id, n.role, n.state) for n in members(server)] == before
    finally:
        server.stop(0)


def test_a_certificate_the_operator_names_is_the_operators(tmp_path, run):
    """`--tls-operator node7`: the certificate naming no role is then the operator's."""
    own = run["coordinator"]
    named = TlsFiles(own.cert, own.key, own.ca, operators=("node7",))
    server = coordinator_server(tmp_path, named)
    try:
        assert register_as(server.address, run["no role"], "server0", "server") == grpc.StatusCode.OK
        assert register_as(server.address, run["worker of another run"], "worker0", "worker") == \
            grpc.StatusCode.UNAUTHENTICATED  # naming one does not open the door to another run
    finally:
        server.stop(0)


def test_a_node_registers_only_in_its_credentials_role(tmp_path, run):
    """The coordinator checks the role a node registers as against its certificate's:
    a worker's certificate registers as a worker only, and a certificate naming no role
    registers as nothing (it registered as the coordinator before)."""
    server = coordinator_server(tmp_path, run["coordinator"])
    try:
        for role in ("server", "coordinator", "rank"):
            assert register_as(server.address, run["worker0"], "worker0", role) == \
                grpc.StatusCode.PERMISSION_DENIED
        assert register_as(server.address, run["server0"], "server0", "worker") == \
            grpc.StatusCode.PERMISSION_DENIED
        assert register_as(server.address, run["no role"], "node7", "coordinator") != grpc.StatusCode.OK
        assert members(server) == []
        assert register_as(server.address, run["worker0"], "worker0", "worker") == grpc.StatusCode.OK
        assert register_as(server.address, run["server0"], "server0", "server") == grpc.StatusCode.OK
        assert sorted((n.node_id, n.role) for n in members(server)) == \
            [("server0", "server"), ("worker0", "worker")]
    finally:
        server.stop(0)


def test_tls_new_names_the_run_in_every_certificate_and_the_service_of_each_role(run):
    from cryptography import x509

    from disttrain.core.tls import certificate_names

    def names(name: str) -> tuple[str | None, set[str]]:
        pem = open(run[name].cert, "rb").read()
        dns = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        return certificate_names(pem).run_id, set(dns)
    assert run["worker0"].run_id == "this-run"  # its CA's
    run_id, dns = names("worker0")
    assert run_id == "this-run" and "coordinator.this-run.disttrain" not in dns
    assert {"worker.this-run.disttrain", "worker0.worker.this-run.disttrain", "localhost"} <= dns
    assert {"server0.server.this-run.disttrain"} <= names("server0")[1]
    assert {"coordinator.this-run.disttrain"} <= names("coordinator")[1]
    assert {"coordinator.this-run.disttrain", "*.server.this-run.disttrain"} <= names("server")[1]
