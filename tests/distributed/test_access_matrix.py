"""The authorization table (`core.access`) proven as a matrix, on real servers (port 0)
called by raw gRPC clients: every RPC of every service the project serves (read from the
proto descriptors: the coordinator's, a parameter-server shard's, the health service
beside them) is called as every kind of caller (the operator, a coordinator, the server
of this shard, another server, the worker itself, another worker, a rank, a node of
another run, no credentials, malformed credentials, the worker itself with an expired
session), once with the caller's own ids and once with the victim's (worker0's id, rank,
key and current session: the strongest an insider can steal short of its credential);
with node tokens of the run's secret, and again with client certificates of the run's CA
(mutual TLS, where an outsider gets no connection at all, and a certificate of the run's
CA naming no role of the run, or another run, is refused UNAUTHENTICATED).

Each cell is expected allowed or refused from the table (its roles and ids), the shard's
session and holder rules: an allowed cell must pass authorization (it answers OK, or a
protocol refusal its probe names: the run's state decides, not the caller), a refused
one must answer PERMISSION_DENIED or UNAUTHENTICATED and leave the server's state as it
was. Beside the table's word, two rules are checked on what the servers answered, on
every cell: nobody outside the run gets anything but health checks, and no node acts in
another's name where the table does not say so. An RPC without a row, or without a probe
here, fails; so does a server of a service with one, before it starts. The link probe of
`advise --serve` is called by every kind of caller the same way.
"""

from __future__ import annotations

import copy
import os
import socket
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from tls_certs import issue, issue_for_run, run_authority

from disttrain.advise.probe import CHALLENGE_BYTES, MAGIC, ProbeServer, prove
from disttrain.config import config_from_dict
from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.service import CoordinatorServer
from disttrain.core import access
from disttrain.core.auth import METADATA_KEY, SCHEME, new_token
from disttrain.core.channels import channel_credentials
from disttrain.core.credentials import Credentials
from disttrain.core.identity import OPERATOR, Caller, NotPermitted, node_token
from disttrain.core.pki import NodeName, write_run_pki
from disttrain.core.rpc_access import check_service
from disttrain.core.rpc_server import RpcServer, ServerLimits
from disttrain.core.tls import TlsFiles
from disttrain.proto import coordinator_pb2 as cpb
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.proto import tensor_pb2
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import codec
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.training.models import init_model

pytestmark = pytest.mark.timeout(120)

SECRET, ANOTHER_RUNS_SECRET = new_token(), new_token()
VICTIM, VICTIM_RANK = "worker0", 0
KEYS = {"worker0": b"0" * 32, "worker1": b"1" * 32}
OK, DENIED, UNAUTHENTICATED = (grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED,
                               grpc.StatusCode.UNAUTHENTICATED)
SERVICES = {descriptor.full_name: descriptor for module in (cpb, pb, health_pb2)
            for descriptor in module.DESCRIPTOR.services_by_name.values()}


# --- who calls ------------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    """A kind of caller: the `authorization` metadata values it sends (each tried; none:
    no metadata), who the servers must take it for (None: nobody of this run), the node
    id and rank it would honestly name (None: it names the victim), and whether it
    presents the victim's expired session."""

    name: str
    credentials: tuple[str | None, ...]
    caller: Caller | None
    own_id: str | None = None
    rank: int = -1
    expired: bool = False
    handshake: bool = False  # an outsider whose certificate the run's CA signed: TLS lets it in

    @property
    def outsider(self) -> bool:
        return self.caller is None


def bearer(token: str) -> str:
    return SCHEME + token


def node(name: str, node_id: str, role: str, rank: int = -1) -> Kind:
    return Kind(name, (bearer(node_token(SECRET, node_id, role)),), Caller(node_id, role), node_id, rank)


KINDS = (
    Kind("the operator", (bearer(SECRET),), OPERATOR),
    node("a coordinator", "coordinator0", "coordinator"),
    node("the server of this shard", "server0", "server", 0),
    node("another server", "server1", "server", 1),
    node("the worker itself", VICTIM, "worker", VICTIM_RANK),
    node("another worker", "worker1", "worker", 1),
    node("a rank", "rank0", "rank", 0),
    Kind("a node of another run", (bearer(node_token(ANOTHER_RUNS_SECRET, VICTIM, "worker")),), None, VICTIM,
         VICTIM_RANK),
    Kind("no credentials", (None,), None),
    # an id no node token can name (a space, a separator), a bare secret, another scheme, no token
    Kind("malformed credentials", (bearer("node~worker~worker 0~" + "0" * 64), bearer("node~worker~a~b~00"),
                                   bearer("node~~worker0~00"), SECRET, "Basic " + SECRET, "Bearer"), None),
    Kind("the worker itself, its session expired", (bearer(node_token(SECRET, VICTIM, "worker")),),
         Caller(VICTIM, "worker"), VICTIM, VICTIM_RANK, expired=True),
    # certificates only (no token has such a form): signed by the run's CA, but naming no role
    # of the run (it was the operator's), or naming another run
    Kind("a certificate of the run's CA naming no role", (), None, handshake=True),
    Kind("a node of another run, certified by this run's CA", (), None, VICTIM, VICTIM_RANK, handshake=True),
)


# The same callers with client certificates of `disttrain tls new` (mutual TLS, no token):
# the run's CA's certificate of each node, the operator's (server.pem), another run's CA's
# certificate of worker0, and none at all. A malformed certificate is no certificate.
CERTIFICATES = {"the operator": "server", "a coordinator": "coordinator0",
                "the server of this shard": "server0", "another server": "server1",
                "the worker itself": VICTIM, "another worker": "worker1", "a rank": "rank0",
                "a node of another run": "another run", "no credentials": None,
                "the worker itself, its session expired": VICTIM,
                "a certificate of the run's CA naming no role": "no-role",
                "a node of another run, certified by this run's CA": f"{VICTIM}-another-run"}
HAND_MADE = ("no-role", f"{VICTIM}-another-run")  # by the test, with the run's CA's key


@dataclass(frozen=True)
class Mode:
    """How callers prove who they are: node tokens of the run's secret (`certificates`
    None), or client certificates of the run's CA in `certificates` (a stranger's in
    `strangers`). What an outsider is answered: UNAUTHENTICATED by the token check, or
    no connection at all (UNAVAILABLE: mutual TLS refuses the handshake, health checks
    included)."""

    name: str
    certificates: Path | None = None
    strangers: Path | None = None

    @property
    def outsider_code(self) -> grpc.StatusCode:
        return UNAUTHENTICATED if self.certificates is None else grpc.StatusCode.UNAVAILABLE

    def outsiders_get(self, rule: access.Rule, kind: Kind) -> grpc.StatusCode:
        if kind.handshake and self.certificates is not None:  # connected, then refused
            return UNAUTHENTICATED if rule.authenticated else OK
        return OK if not rule.authenticated and self.certificates is None else self.outsider_code

    def credentials(self, kind: Kind) -> tuple:
        """What `kind` presents, each tried in turn (none: this mode has no such caller)."""
        if self.certificates is None:
            return kind.credentials
        if kind.name not in CERTIFICATES:
            return ()
        name = CERTIFICATES[kind.name]
        if name in HAND_MADE:
            return (TlsFiles(str(self.certificates / f"{name}.crt"), str(self.certificates / f"{name}.key"),
                             str(self.certificates / "ca.pem")),)
        return (self.as_node(name) if name != "another run" else self._files(self.strangers, VICTIM),)

    def as_node(self, node_id: str | None, role: str = "worker"):
        """The credential of node `node_id` in `role` (None: none; "server": the operator's
        certificate)."""
        if self.certificates is None:
            return bearer(node_token(SECRET, node_id, role))
        return TlsFiles(ca=str(self.certificates / "ca.pem")) if node_id is None \
            else self._files(self.certificates, node_id)

    def _files(self, folder: Path, name: str) -> TlsFiles:
        return TlsFiles(str(folder / f"{name}.pem"), str(folder / f"{name}.key"),
                        str(self.certificates / "ca.pem"))

    def server_options(self) -> dict:
        if self.certificates is None:
            return {"token": SECRET}
        return {"tls": self._files(self.certificates, "server")}

    def channel(self, address: str, credential) -> tuple[grpc.Channel, list | None]:
        if self.certificates is None:
            metadata = None if credential is None else [(METADATA_KEY, credential)]
            return grpc.insecure_channel(address), metadata
        return grpc.secure_channel(address, channel_credentials(credential)), None


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> tuple[Path, Path]:
    """The run's CA and a certificate for each node kind; another run's CA and its worker0."""
    run, strangers = tmp_path_factory.mktemp("run"), tmp_path_factory.mktemp("strangers")
    hosts = ["localhost", "127.0.0.1"]
    write_run_pki(run, hosts, [NodeName(name, name.rstrip("0123456789")) for name in
                               ("coordinator0", "server0", "server1", VICTIM, "worker1", "rank0")], days=1)
    write_run_pki(strangers, hosts, [NodeName(VICTIM, "worker")], days=1)
    authority = run_authority(run)
    issue(authority, run, "no-role")
    issue_for_run(authority, run, VICTIM, "worker", "another-run")
    return run, strangers


@pytest.fixture(params=["node tokens", "client certificates"])
def mode(request, certificates) -> Mode:
    return Mode(request.param) if request.param == "node tokens" else Mode(request.param, *certificates)


@dataclass(frozen=True)
class Ids:
    """What a cell's request names: a node, its role and rank, and a worker's key and session."""

    node_id: str
    role: str
    rank: int
    key: bytes = b""
    session: bytes = b""
    generation: int = 0


@dataclass
class Cell:
    rpc: str
    kind: Kind
    variant: str  # "own ids" or "the victim's ids"
    ids: Ids
    expected: grpc.StatusCode
    named: str = ""  # the node its request names, read off the request
    got: grpc.StatusCode | None = None
    detail: str = ""


# --- what each RPC is called with --------------------------------------------------------

@dataclass
class Target:
    """A server under test: its address, what its state is (`snapshot`), and what the
    matrix needs of it (sessions, keys, steps, generations, the finisher)."""

    address: str
    snapshot: Callable[[], object]
    mode: Mode
    sessions: dict[str, bytes] = field(default_factory=dict)
    expired: dict[str, bytes] = field(default_factory=dict)
    generations: dict[str, int] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    plan: object = None


@dataclass(frozen=True)
class Probe:
    """How to call one RPC for a cell: `build(ids, target)` makes the request (a message;
    bytes or a list of bytes for a framed one), `allowed` the codes an allowed call may
    answer (the state, not the caller, deciding), `holder` who alone may make the call
    beyond the table's roles (None: whoever the table lets), `prepare(target)` what the
    server needs first (the call answers at once, not after a long-poll)."""

    build: Callable[[Ids, Target], object]
    allowed: frozenset = frozenset({OK})
    holder: Callable[[Ids], bool] | None = None
    prepare: Callable[[Target], None] | None = None


def gradient(ids: Ids, target: Target) -> list[bytes]:
    """A push of `ids`' worker: its next step, of a block of its own rank, with its session."""
    plan = target.plan
    step = target.steps.get(ids.node_id, 0) + 1
    block = step * 2 + max(ids.rank, 0)  # (epoch 0 * workers + rank) + workers * index: its own
    header = pb.GradientMessage(worker_id=ids.node_id, step=step, base_version=0, shard=0, num_samples=8,
                                block_id=block, session=ids.session)
    header.layout.extend(wire.slice_specs(plan))
    meta = tensor_pb2.TensorProto(shape=[plan.numel], dtype="float32")
    return list(codec.encode_frames(header, wire.GRADIENT_PAYLOAD_FIELD, meta,
                                    codec.tensor_bytes(torch.full((plan.numel,), 0.01))))


def all_done(target: Target) -> None:
    """Every worker tells the shard it is done (so waits for that answer at once)."""
    for worker_id in (VICTIM, "worker1"):
        raw(target, worker_id, access.SHARD_SERVICE, "WorkerDone",
            pb.WorkerDoneRequest(worker_id=worker_id, session=target.sessions[worker_id]))


def coordinator_probes() -> dict[str, Probe]:
    def registration(ids, target):
        return cpb.RegisterNodeRequest(node_id=ids.node_id, role=ids.role, rank=ids.rank, pid=os.getpid(),
                                       hostname="matrix")

    def heartbeat(ids, target):
        return cpb.HeartbeatMessage(node_id=ids.node_id, role=ids.role, pid=os.getpid(), step=1,
                                    generation=target.generations.get(ids.node_id, 0))

    def exit_report(ids, target):
        return cpb.ExitReport(node_id=ids.node_id, exit_code=0, reason="finished", pid=os.getpid(),
                              generation=target.generations.get(ids.node_id, 0))

    return {
        "RegisterNode": Probe(registration),
        "SendHeartbeat": Probe(heartbeat),
        "ReportMetrics": Probe(lambda ids, target: cpb.MetricsReport(node_id=ids.node_id, step=1,
                                                                     scalars={"loss/train": 0.5})),
        # a second report of an ended node's exit names a process the coordinator no longer runs
        "ReportExit": Probe(exit_report, frozenset({OK, grpc.StatusCode.FAILED_PRECONDITION})),
        "WatchMembership": Probe(lambda ids, target: cpb.MembershipRequest(after_generation=0)),
        "GetClusterStatus": Probe(lambda ids, target: cpb.ClusterStatusRequest()),
    }


def shard_probes() -> dict[str, Probe]:
    def pull(ids, target):
        return pb.ParameterRequest(worker_id=ids.node_id, session=ids.session, shard=0)

    return {
        "RegisterWorker": Probe(lambda ids, target: pb.RegisterRequest(
            worker_id=ids.node_id, requested_rank=-1, key=ids.key or b"k" * 32)),
        "SendGradients": Probe(gradient),
        "PushGradients": Probe(lambda ids, target: b"".join(gradient(ids, target))),
        "Step": Probe(lambda ids, target: [b"".join(gradient(ids, target))]),
        "GetParameters": Probe(pull),
        "FetchParameters": Probe(pull),
        "WorkerDone": Probe(lambda ids, target: pb.WorkerDoneRequest(worker_id=ids.node_id,
                                                                     session=ids.session)),
        # a worker waits with its id and session; anyone else observes, naming nobody
        "GetStatus": Probe(lambda ids, target: pb.StatusRequest(
            wait_all_done=True, worker_id=ids.node_id if ids.session else "", session=ids.session),
            prepare=all_done),
        # the finisher (rank 0) gets past every check but the last: the workers are not done
        "Shutdown": Probe(lambda ids, target: pb.ShutdownRequest(worker_id=ids.node_id, session=ids.session),
                          frozenset({grpc.StatusCode.FAILED_PRECONDITION}),
                          holder=lambda ids: ids.node_id == VICTIM),
        "Barrier": Probe(lambda ids, target: pb.BarrierRequest(worker_id=ids.node_id, session=ids.session,
                                                               name="matrix", values=[1.0])),
        "GetLedger": Probe(lambda ids, target: pb.LedgerRequest(worker_id=ids.node_id, session=ids.session)),
    }


def health_probes() -> dict[str, Probe]:
    return {"Check": Probe(lambda ids, target: health_pb2.HealthCheckRequest(service="")),
            "Watch": Probe(lambda ids, target: health_pb2.HealthCheckRequest(service="")),
            # grpcio-health-checking's servicer does not implement it (yet)
            "List": Probe(lambda ids, target: health_pb2.HealthListRequest(),
                          frozenset({grpc.StatusCode.UNIMPLEMENTED}))}


PROBES = {access.COORDINATOR_SERVICE: coordinator_probes(), access.SHARD_SERVICE: shard_probes(),
          access.HEALTH_SERVICE: health_probes()}


# --- the cells ---------------------------------------------------------------------------

def ids_of(kind: Kind, victim: bool, target: Target) -> Ids:
    node_id, rank = (VICTIM, VICTIM_RANK) if victim or kind.own_id is None else (kind.own_id, kind.rank)
    role = "worker" if node_id == VICTIM else (kind.caller.role if kind.caller else "worker")
    session = target.expired[VICTIM] if kind.expired else target.sessions.get(node_id, b"")
    return Ids(node_id, role, rank, KEYS.get(node_id, b""), session, target.generations.get(node_id, 0))


def variants(kind: Kind, service: str) -> list[tuple[str, bool]]:
    if kind.expired and service != access.SHARD_SERVICE:
        return []  # only a shard has sessions
    if kind.own_id is None or kind.own_id == VICTIM:
        return [("the victim's ids", True)]  # it names the victim whichever way it goes
    return [("own ids", False), ("the victim's ids", True)]


def expected(rule: access.Rule, probe: Probe, kind: Kind, ids: Ids, request: object, target: Target
             ) -> grpc.StatusCode:
    """What the table (and the shard's session and holder rules) says of a cell."""
    if kind.outsider:
        return target.mode.outsiders_get(rule, kind)
    if not rule.authenticated:
        return OK
    header = pb.GradientMessage.FromString(request[0] if isinstance(request, list) else request) \
        if rule.framed else request
    try:
        rule.check(kind.caller, header)
    except NotPermitted:
        return DENIED
    session_checked = rule.session == access.REQUIRED or (rule.session == access.IF_GIVEN and ids.session)
    if session_checked and ids.session != target.sessions.get(ids.node_id):
        return DENIED
    if probe.holder is not None and not probe.holder(ids):
        return DENIED
    return OK


def call(target: Target, service: str, method, request, credential) -> tuple[grpc.StatusCode, object]:
    """One raw call of `method` (a descriptor) on a channel of its own, presenting
    `credential`; its code and reply (a streamed reply's first message: a watch never ends)."""
    path = f"/{service}/{method.name}"
    kind = (("stream_" if method.client_streaming else "unary_")
            + ("stream" if method.server_streaming else "unary"))
    serialize = wire.identity if isinstance(request, (bytes, list)) else type(request).SerializeToString
    channel, metadata = target.mode.channel(target.address, credential)
    with channel:
        stub = getattr(channel, kind)(path, request_serializer=serialize, response_deserializer=wire.identity)
        argument = iter(request) if method.client_streaming else request
        try:
            if not method.server_streaming:
                return OK, stub(argument, timeout=10, metadata=metadata)
            replies = stub(argument, timeout=10, metadata=metadata)
            if method.client_streaming:  # it ends once the server has answered every message sent
                return OK, list(replies)[0]
            first = next(replies)
            replies.cancel()  # a watch never ends
            return OK, first
        except grpc.RpcError as e:
            return e.code(), e.details()


def run_matrix(service: str, method_name: str, target: Target) -> list[Cell]:
    """Every cell of one RPC against `target`: refused ones first (each against a snapshot
    of the state), then the allowed ones (which may change it)."""
    rule = access.rule_of(f"/{service}/{method_name}")
    assert rule is not None, f"{service}/{method_name} has no row in core.access.RULES"
    probe = PROBES[service].get(method_name)
    assert probe is not None, f"{service}/{method_name} has a row but no probe here: add one to PROBES"
    method = SERVICES[service].methods_by_name[method_name]
    planned = []
    for kind in KINDS:
        for variant, victim in variants(kind, service) if target.mode.credentials(kind) else ():
            ids = ids_of(kind, victim, target)
            planned.append((kind, variant, ids))
    cells = []
    # The expected outcome is read just before each call: an allowed call may change what
    # the next names (a registration renews a session, a push takes a step).
    order = sorted(planned, key=lambda p: _preview(rule, probe, p, target) == OK)
    for kind, variant, ids in order:
        session = target.expired[VICTIM] if kind.expired else target.sessions.get(ids.node_id, b"")
        ids = replace(ids, session=session)
        request = probe.build(ids, target)
        cell = Cell(method_name, kind, variant, ids, expected(rule, probe, kind, ids, request, target),
                    named_in_request(request))
        for credential in target.mode.credentials(kind):  # every one must answer as the cell expects
            before = target.snapshot()
            code, reply = call(target, service, method, request, credential)
            cell.got, cell.detail = code, reply if isinstance(reply, str) else ""
            if code in (DENIED, UNAUTHENTICATED):
                assert_same(before, target.snapshot(), cell)
            elif code == OK:
                _note(method_name, ids, reply, target)
            if verdict([cell], rule, probe, target.mode):
                break
        cells.append(cell)
    return cells


def _preview(rule, probe, planned, target) -> grpc.StatusCode:
    kind, _, ids = planned
    return expected(rule, probe, kind, ids, probe.build(ids, target), target)


def _note(method_name: str, ids: Ids, reply: bytes, target: Target) -> None:
    """What an allowed call changed that later cells name: a worker's new session, its step."""
    if method_name == "RegisterWorker":
        assignment = pb.WorkerAssignment.FromString(reply)
        target.sessions[assignment.worker_id] = assignment.session
    elif method_name in ("SendGradients", "PushGradients", "Step"):
        target.steps[ids.node_id] = target.steps.get(ids.node_id, 0) + 1


def assert_same(before: object, after: object, cell: Cell) -> None:
    assert _equal(before, after), (f"{cell.rpc} by {cell.kind.name} with {cell.variant} was refused "
                                   f"({cell.got.name}) but changed the server's state")


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def verdict(cells: list[Cell], rule: access.Rule, probe: Probe, mode: Mode) -> list[str]:
    """The cells whose answer is not what the table says, and the cells that break the two
    rules that hold whatever the table says; empty when all is well."""
    wrong = []
    for cell in cells:
        allowed = cell.got == OK or cell.got in probe.allowed
        if (cell.expected == OK) != allowed or (cell.expected != OK and cell.got != cell.expected):
            wrong.append(f"{cell.rpc} by {cell.kind.name} with {cell.variant}: expected "
                         f"{cell.expected.name}, got {cell.got.name} {cell.detail}")
        if cell.kind.outsider and allowed and (rule.authenticated or (mode.certificates is not None
                                                                      and not cell.kind.handshake)):
            wrong.append(f"{cell.rpc} by {cell.kind.name}: an outsider got {cell.got.name}")
        caller = cell.kind.caller
        if caller is not None and not caller.is_operator and cell.named not in ("", caller.node_id) \
                and caller.role not in ACTING_FOR_OTHERS.get(cell.rpc, ()) and allowed:
            wrong.append(f"{cell.rpc} by {cell.kind.name}: acted in {cell.named}'s name")
    return wrong


# The one call a node may make in another node's name, whatever the table says: a coordinator
# tells of a node's end. Any other node naming another is refused.
ACTING_FOR_OTHERS = {"ReportExit": ("coordinator",)}


def named_in_request(request: object) -> str:
    """The node a request names (its node_id or worker_id; a framed push's header's)."""
    if isinstance(request, (bytes, list)):
        request = pb.GradientMessage.FromString(request[0] if isinstance(request, list) else request)
    return getattr(request, "node_id", "") or getattr(request, "worker_id", "")


# --- the servers -------------------------------------------------------------------------

def raw(target: Target, node_id: str, service: str, method_name: str, request, role: str = "worker"):
    """A call made as node `node_id` in `role` that must pass: its reply."""
    code, reply = call(target, service, SERVICES[service].methods_by_name[method_name], request,
                       target.mode.as_node(node_id, role))
    assert code == OK, (method_name, code, reply)
    return reply


@pytest.fixture
def coordinator(tmp_path, mode) -> Iterator[Target]:
    """A coordinator requiring the run's credentials (`mode`), with every node kind
    registered by itself."""
    config = CoordinatorConfig(heartbeat_interval=60.0, heartbeat_timeout=3600.0, reassign_after=None)
    server = CoordinatorServer(config, "127.0.0.1:0", tmp_path / "cluster.db",
                               credentials=Credentials(**mode.server_options()))

    def snapshot():
        status = copy.deepcopy(server.state.status())
        for node_status in status.nodes:
            node_status.heartbeat_age_s = 0.0
        return status.SerializeToString(deterministic=True)

    target = Target(server.address, snapshot, mode)
    for kind in KINDS:
        if kind.caller is not None and not kind.caller.is_operator and not kind.expired:
            role = kind.caller.role
            reply = cpb.RegisterNodeReply.FromString(raw(
                target, kind.own_id, access.COORDINATOR_SERVICE, "RegisterNode",
                cpb.RegisterNodeRequest(node_id=kind.own_id, role=role, rank=kind.rank, pid=os.getpid()),
                role))
            target.generations[kind.own_id] = reply.generation
    yield target
    server.stop(0)


@pytest.fixture
def shard(tmp_path, mode) -> Iterator[tuple[ShardServer, Target]]:
    """A shard (async mode, two workers) requiring the run's credentials (`mode`):
    worker0 and worker1 registered by themselves (worker0 twice: its first session is
    expired), worker0 has pushed once, and both have met at barrier "matrix"."""
    config = config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd", "momentum": 0.9,
                     "learning_rate": 0.1, "checkpoint_interval": 1000},
        "system": {"num_workers": 2, "checkpoint_dir": str(tmp_path / "ckpt")},
        "ps": {"aggregation_mode": "async"}})
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0", long_poll_cap_s=5.0,
                         credentials=Credentials(**mode.server_options()))
    state = server.state
    target = Target(server.address, lambda: (state.state_dict(), state.status(),
                                             dict(state.identities._sessions), server.stopped.is_set()),
                    mode, plan=plan_shards(init_model(config.training), 1)[0])
    register = PROBES[access.SHARD_SERVICE]["RegisterWorker"]
    for worker_id in (VICTIM, "worker1", VICTIM):
        ids = Ids(worker_id, "worker", -1, KEYS[worker_id])
        reply = raw(target, worker_id, access.SHARD_SERVICE, "RegisterWorker", register.build(ids, target))
        if worker_id in target.sessions:
            target.expired[worker_id] = target.sessions[worker_id]
        target.sessions[worker_id] = pb.WorkerAssignment.FromString(reply).session
    victim = Ids(VICTIM, "worker", VICTIM_RANK, KEYS[VICTIM], target.sessions[VICTIM])
    raw(target, VICTIM, access.SHARD_SERVICE, "PushGradients", b"".join(gradient(victim, target)))
    target.steps[VICTIM] = 1
    barrier = PROBES[access.SHARD_SERVICE]["Barrier"]
    with ThreadPoolExecutor(2) as pool:  # both at the barrier: it completes, and answers at once since
        meetings = [pool.submit(raw, target, worker_id, access.SHARD_SERVICE, "Barrier",
                                barrier.build(Ids(worker_id, "worker", rank, KEYS[worker_id],
                                                  target.sessions[worker_id]), target))
                    for worker_id, rank in ((VICTIM, 0), ("worker1", 1))]
        for meeting in meetings:
            meeting.result(timeout=30)
    assert server.state.version == 1
    yield server, target
    server.stop(0)


def service_methods(service: str) -> list[str]:
    return [method.name for method in SERVICES[service].methods]


@pytest.mark.parametrize("method_name", service_methods(access.COORDINATOR_SERVICE))
def test_every_coordinator_rpc_as_every_caller(coordinator, method_name):
    check(access.COORDINATOR_SERVICE, method_name, coordinator)


@pytest.mark.parametrize("method_name", service_methods(access.SHARD_SERVICE))
def test_every_shard_rpc_as_every_caller(shard, method_name):
    check(access.SHARD_SERVICE, method_name, shard[1])


@pytest.mark.parametrize("method_name", service_methods(access.HEALTH_SERVICE))
def test_the_health_service_as_every_caller(shard, method_name):
    check(access.HEALTH_SERVICE, method_name, shard[1])


def check(service: str, method_name: str, target: Target) -> None:
    probe = PROBES[service].get(method_name)
    assert probe is not None, f"{service}/{method_name}: no probe here; add one to PROBES"
    if probe.prepare is not None:
        probe.prepare(target)
    cells = run_matrix(service, method_name, target)
    rule = access.rule_of(f"/{service}/{method_name}")
    wrong = verdict(cells, rule, PROBES[service][method_name], target.mode)
    assert not wrong, "\n".join(wrong)
    # each kind of caller is tried, and the matrix holds refusals and (but for Shutdown,
    # whose holder's call waits for the others) calls that get through
    assert {cell.kind.name for cell in cells} >= {kind.name for kind in KINDS
                                                  if not kind.expired and target.mode.credentials(kind)}
    assert any(cell.expected != OK for cell in cells) or not rule.authenticated
    assert any(cell.got == OK for cell in cells) or PROBES[service][method_name].allowed != {OK}


# --- a row for every RPC -------------------------------------------------------------------

def test_every_rpc_of_every_service_has_one_row_and_every_row_an_rpc():
    for service, descriptor in SERVICES.items():
        assert access.missing_rows(service, (m.name for m in descriptor.methods)) == [], service
        assert {rule.method for rule in access.rules_of(service)} == set(service_methods(service))
        assert set(PROBES[service]) == set(service_methods(service)), f"{service}: a probe per RPC"
        for rule in access.rules_of(service):  # a holder only the state knows is tried here too
            assert bool(rule.holder) == (PROBES[service][rule.method].holder is not None), rule.method
    assert {rule.service for rule in access.RULES} == set(SERVICES)


def pool_with_an_rpc_without_a_row() -> descriptor_pool.DescriptorPool:
    """The project's protos, with a `StealModel` RPC added to the shard's service."""
    pool = descriptor_pool.DescriptorPool()
    for module in (tensor_pb2, pb):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        if module is pb:
            (service,) = proto.service
            service.method.add(name="StealModel", input_type=".disttrain.v1.ParameterRequest",
                               output_type=".disttrain.v1.ParameterMessage")
        pool.Add(proto)
    return pool


def test_an_rpc_added_without_a_row_is_named_and_its_server_does_not_start():
    with pytest.raises(ValueError, match="StealModel"):
        check_service(access.SHARD_SERVICE, pool_with_an_rpc_without_a_row())
    check_service(access.SHARD_SERVICE)  # the project's own protos: a row for each


def test_a_method_without_a_row_is_refused_whoever_calls():
    """A server of a service outside the project's protos starts, but refuses every call of
    a method that has no row, with credentials (the operator's) or without (an open server)."""
    anything = grpc.unary_unary_rpc_method_handler(lambda request, context: b"ran",
                                                   request_deserializer=wire.identity,
                                                   response_serializer=wire.identity)
    handler = grpc.method_handlers_generic_handler("test.Unlisted", {"Anything": anything})
    for token, credential in ((SECRET, bearer(SECRET)), (None, None)):
        server = RpcServer(handler, "test.Unlisted", "127.0.0.1:0", ServerLimits(2), Credentials(token))
        try:
            metadata = None if credential is None else [(METADATA_KEY, credential)]
            with grpc.insecure_channel(server.address) as channel:
                with pytest.raises(grpc.RpcError) as raised:
                    channel.unary_unary("/test.Unlisted/Anything")(b"", timeout=10, metadata=metadata)
            assert raised.value.code() == DENIED and "no row" in raised.value.details()
        finally:
            server.stop(0)


# --- the link probe of `advise --serve` --------------------------------------------------

def probe_answer(address: str, token: str | None) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(MAGIC)
        challenge = b""
        while len(challenge) < CHALLENGE_BYTES:
            challenge += conn.recv(CHALLENGE_BYTES - len(challenge))
        proof = prove(token, challenge)  # the probe's protocol proves the token, never sends it
        conn.sendall(struct.pack("<H", len(proof)) + proof)
        return conn.recv(1)


def test_the_link_probe_as_every_caller():
    (rule,) = [s for s in access.SOCKETS if "advise --serve" in s.socket]
    assert rule.roles == (access.OPERATOR,)
    server = ProbeServer(token=SECRET).start()
    try:
        for kind in KINDS:
            for credential in kind.credentials:
                if credential is not None and not credential.startswith(SCHEME):
                    continue  # the probe's own protocol carries the bare token
                token = None if credential is None else credential.removeprefix(SCHEME)
                allowed = kind.caller is not None and kind.caller.role in rule.roles
                answer = probe_answer(server.address, token)
                assert answer == (b"Y" if allowed else b"N"), (kind.name, credential)
    finally:
        server.stop()
