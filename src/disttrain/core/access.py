"""Who may call what: the authorization table of every RPC of every service the project
serves, and of every other socket it listens on, and the one rule that reads it. Pure:
no gRPC (`core.rpc_access` applies it to every call of every server; the docs page
`docs/security.md` shows it, written by `tools/access_table.py`).

A row of an RPC names the roles that may call it (`core.identity`: the operator, a
coordinator, a server, a worker, a rank), the request field naming the node the call is
made for (a node names only itself there; the roles of `any_node` may name any node),
the field that must name the caller's own role, what the server checks beyond that (the
worker's session, a holder that only the server's state knows), and the limits that
bound what one call may cost. A call whose method has no row is refused; a server of a
service of the proto descriptors refuses to start while one of its methods has none.

A server started without credentials (no token, no client certificates: loopback, or
`--insecure`) knows no caller: every caller is then trusted as the operator.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from disttrain.core.identity import OPERATOR_ROLE, Caller, NotPermitted

OPERATOR = OPERATOR_ROLE
COORDINATOR, SERVER, WORKER, RANK = "coordinator", "server", "worker", "rank"
NODES = (COORDINATOR, SERVER, WORKER, RANK)
EVERYONE = (OPERATOR, *NODES)

COORDINATOR_SERVICE = "disttrain.v1.CoordinatorService"
SHARD_SERVICE = "disttrain.v1.ParameterServerService"
HEALTH_SERVICE = "grpc.health.v1.Health"

# What a shard checks, beyond the row's roles and ids, of a worker's session (the secret its
# registration returned, bound to its id, its generation and the server's incarnation).
REQUIRED = "required"
IF_GIVEN = "if given"


@dataclass(frozen=True)
class Rule:
    """Who may make one RPC.

    Args:
        service, method: the RPC, as the proto names them.
        callers: the roles that may make the call at all.
        acts_for: the request field naming the node the call is made for ("": none); a
            caller not in `any_node` must name itself there.
        any_node: the roles that may name any node in `acts_for` (the operator's launchers
            act for the nodes they start).
        optional_subject: `acts_for` is checked only when the request fills it (a call
            that may also be made for no node, e.g. an observer's).
        subject_role: when the request names a node in `acts_for`, a caller not in
            `any_node` must also be of this role ("": any role of `callers`).
        role_field: a request field that must name the caller's own role ("": none).
        session: the worker's session the shard requires (`REQUIRED`, `IF_GIVEN`, ""):
            checked by the shard against its registrations, after the checks here.
        holder: a further condition on the caller that only the server's state decides.
        authenticated: False: anyone may call, without credentials.
        framed: the request is framed by hand (raw bytes): the servicer decodes each
            message and has it checked (`core.rpc_access.authorize_message`) before it
            reads the rest.
        limits: what bounds the cost of one call (sizes, slots, waits).
        purpose: what the call is for, in a few words.
    """

    service: str
    method: str
    callers: tuple[str, ...]
    acts_for: str = ""
    any_node: tuple[str, ...] = (OPERATOR,)
    optional_subject: bool = False
    subject_role: str = ""
    role_field: str = ""
    session: str = ""
    holder: str = ""
    authenticated: bool = True
    framed: bool = False
    limits: str = ""
    purpose: str = ""

    @property
    def path(self) -> str:
        """The method's path as gRPC names it: /package.Service/Method."""
        return f"/{self.service}/{self.method}"

    def check(self, caller: Caller | None, message: object | None = None) -> None:
        """Let `caller` make this call with `message` (its fields read by name; None: check
        the caller's role alone, before any request is read). None as caller: a server
        without credentials, where every caller is trusted.

        Raises:
            NotPermitted: naming the caller and what it may not do; the call changes nothing.
        """
        if caller is None or not self.authenticated:
            return
        if caller.role not in self.callers:
            nodes = [role for role in self.callers if role != OPERATOR]
            allowed = " or ".join(nodes) + " nodes" if nodes else "nobody"
            also = " or the operator" if OPERATOR in self.callers else ""
            raise NotPermitted(f"{self.method}: the caller is {caller}; only {allowed}{also} may make it")
        if message is None or caller.role in self.any_node:
            return
        if self.acts_for:
            named = getattr(message, self.acts_for)
            if named or not self.optional_subject:
                if named != caller.node_id:
                    raise NotPermitted(f"{self.method}: the caller is {caller} and may not act for node "
                                       f"{named!r}; each node makes calls in its own name only")
                if self.subject_role and caller.role != self.subject_role:
                    raise NotPermitted(f"{self.method}: the caller is {caller}, not a {self.subject_role}")
        if self.role_field and getattr(message, self.role_field) != caller.role:
            raise NotPermitted(f"{self.method}: the caller is {caller}, not a "
                               f"{getattr(message, self.role_field)}")


@dataclass(frozen=True)
class SocketRule:
    """Who may connect to a socket the project listens on that is not one of its gRPC
    services: what it is, who opens it, where it listens, who may use it (`roles`: the
    roles whose credentials it takes; (): it takes none, anyone who reaches it gets in),
    how a caller is told apart, and what bounds one caller."""

    socket: str
    opened_by: str
    binds: str
    callers: str
    authentication: str
    limits: str
    roles: tuple[str, ...] = ()


_SHARD_PUSH_LIMITS = ("bytes, frames and fields per frame bounded by the shard's largest legal push "
                      "(`push_limits`); refused pushes change nothing")
_SHARD_STREAM_LIMITS = ("first message within FIRST_MESSAGE_S on one of the caller's own OPENINGS_PER_CALLER "
                        "opening slots (among a few all callers' share); then on the worker's own slots "
                        "(POLLS_PER_WORKER); at most POLLS_PER_CALLER slots per caller")
_LONG_POLL = ("waits at most LONG_POLL_CAP_S, on one of the worker's POLLS_PER_WORKER slots; at most "
              "POLLS_PER_CALLER slots per caller")

RULES: tuple[Rule, ...] = (
    # -- the coordinator: who is in the run, who is alive --------------------------------
    Rule(COORDINATOR_SERVICE, "RegisterNode", EVERYONE, acts_for="node_id", role_field="role",
         limits="ids of at most 128 letters, digits and ._:@+/-; a live node's id held by another live "
                "process, or a rank of its role held by another node (a rank stays its first node's, alive "
                "or not; a node keeps its own): ALREADY_EXISTS; coordinator.max_nodes live nodes",
         purpose="join or rejoin the run"),
    Rule(COORDINATOR_SERVICE, "SendHeartbeat", EVERYONE, acts_for="node_id",
         limits="the pid the node registered with; figures finite and not negative",
         purpose="say the node is alive, and its progress"),
    Rule(COORDINATOR_SERVICE, "ReportMetrics", EVERYONE, acts_for="node_id",
         limits="finite values, a bounded number of keys of bounded length",
         purpose="the node's latest training metrics"),
    Rule(COORDINATOR_SERVICE, "ReportExit", EVERYONE, acts_for="node_id", any_node=(OPERATOR, COORDINATOR),
         limits="names the pid and generation the node registered with; a reason of at most 1024 "
                "printable characters",
         purpose="a node's process ended (the node itself, or its launcher)"),
    Rule(COORDINATOR_SERVICE, "WatchMembership", EVERYONE,
         limits="a long-poll of at most 60 s; at most WATCHES_PER_CALLER at once per caller, a quarter "
                "of the coordinator's threads left free",
         purpose="follow who is alive"),
    Rule(COORDINATOR_SERVICE, "GetClusterStatus", EVERYONE,
         limits="an answer of at most 1 MB (live nodes first)",
         purpose="every node at a glance (`disttrain status`)"),
    # -- a parameter-server shard ----------------------------------------------------------
    Rule(SHARD_SERVICE, "RegisterWorker", (OPERATOR, WORKER), acts_for="worker_id",
         limits="16 KB; the id is bound to the key it first registered with (another key: "
                "ALREADY_EXISTS, unless the coordinator confirms a restart)",
         purpose="join the shard; returns the worker's session"),
    Rule(SHARD_SERVICE, "SendGradients", (OPERATOR, WORKER), acts_for="worker_id", session=REQUIRED,
         framed=True, limits=f"{_SHARD_PUSH_LIMITS}; {_SHARD_STREAM_LIMITS}; read whole within max_read_s",
         purpose="push a gradient, streamed"),
    Rule(SHARD_SERVICE, "PushGradients", (OPERATOR, WORKER), acts_for="worker_id", session=REQUIRED,
         framed=True, limits=_SHARD_PUSH_LIMITS, purpose="push a gradient in one message"),
    Rule(SHARD_SERVICE, "Step", (OPERATOR, WORKER), acts_for="worker_id", session=REQUIRED, framed=True,
         limits=f"every message checked as a push; {_SHARD_STREAM_LIMITS}; MAX_UNVERIFIED_PUSHES "
                "pushes of an earlier server incarnation before one passes the session check",
         purpose="push, and get the parameters it leads to"),
    Rule(SHARD_SERVICE, "GetParameters", (OPERATOR, WORKER), acts_for="worker_id", session=REQUIRED,
         limits=f"4 KB; {_LONG_POLL}", purpose="pull the shard's parameters, streamed"),
    Rule(SHARD_SERVICE, "FetchParameters", (OPERATOR, WORKER), acts_for="worker_id", session=REQUIRED,
         limits=f"4 KB; {_LONG_POLL}", purpose="pull the shard's parameters in one message"),
    Rule(SHARD_SERVICE, "WorkerDone", (OPERATOR, WORKER), acts_for="worker_id", session=REQUIRED,
         limits="4 KB", purpose="the worker finished its epochs"),
    Rule(SHARD_SERVICE, "GetStatus", EVERYONE, acts_for="worker_id", optional_subject=True,
         subject_role=WORKER, session=IF_GIVEN,
         limits="4 KB; a wait for every worker to be done on the worker's own slots (with its "
                "session), else on the caller's own observing slots; at most POLLS_PER_CALLER per caller",
         purpose="the shard's counters; for a worker, wait until all are done"),
    Rule(SHARD_SERVICE, "Shutdown", (OPERATOR, WORKER), acts_for="worker_id", session=REQUIRED,
         holder="the worker that writes the final model (the lowest rank not reassigned), once every "
                "worker is done",
         limits="1 KB", purpose="stop the shard at the run's end"),
    Rule(SHARD_SERVICE, "Barrier", (OPERATOR, WORKER), acts_for="worker_id", session=REQUIRED,
         limits=f"16 KB; {_LONG_POLL}; a worker waits at most at PENDING_PER_WORKER pending barriers "
                "(RESOURCE_EXHAUSTED); a barrier nobody waited at for EXPIRY_S is forgotten",
         purpose="meet every worker of the run (an all-gather)"),
    Rule(SHARD_SERVICE, "GetLedger", (OPERATOR, WORKER), acts_for="worker_id", session=REQUIRED,
         limits="4 KB", purpose="read the blocks the shard applied"),
    # -- the standard health service, beside each of the above ---------------------------
    Rule(HEALTH_SERVICE, "Check", EVERYONE, authenticated=False,
         limits="answers SERVING or NOT_SERVING, nothing else",
         purpose="orchestrators' probes (they carry no token)"),
    Rule(HEALTH_SERVICE, "Watch", EVERYONE,
         limits="a stream held open: counts among the server's calls in progress",
         purpose="follow the serving status"),
    Rule(HEALTH_SERVICE, "List", EVERYONE, limits="not served here (UNIMPLEMENTED)",
         purpose="every service's status"),
)

SOCKETS: tuple[SocketRule, ...] = (
    SocketRule("live DDP store (torch TCPStore)",
               "`disttrain ddp --ddp-recovery live`: the launcher of node 0",
               "127.0.0.1 on one node; across nodes, the address of ddp.rdzv_endpoint only",
               "this run's launchers and ranks",
               "none: torch's TCPStore has no credentials (keep ddp.rdzv_endpoint on a private network)",
               "torch's own"),
    SocketRule("DDP rendezvous store (torch elastic c10d)", "`disttrain ddp --ddp-recovery restart`: "
               "torch's elastic agent", "--rdzv-endpoint", "this run's agents and ranks",
               "none: torch's store has no credentials (keep it on a private network)", "torch's own"),
    SocketRule("DDP collectives (gloo, NCCL)", "every DDP rank", "the interface GLOO_SOCKET_IFNAME / "
               "NCCL_SOCKET_IFNAME name, ephemeral ports", "this run's ranks",
               "none (keep them on a private network)", "torch's own"),
    SocketRule("link probe (`disttrain advise --serve`)", "`disttrain advise --serve`",
               "127.0.0.1 unless --bind; an address other machines reach needs a token",
               "the operator: whoever holds the token it was started with",
               "a proof of that token (HMAC-SHA256 over a fresh challenge of the server's; the "
               "token itself never crosses the network), compared in constant time, before any command",
               "one connection at a time; a silent one dropped after 30 s; transfers of at most 1 GiB",
               roles=(OPERATOR,)),
)


def rule_of(path: str) -> Rule | None:
    """The row of the RPC at gRPC path `path` (/package.Service/Method); None: it has none."""
    return _BY_PATH.get(path)


def rules_of(service: str) -> list[Rule]:
    """The rows of `service`'s RPCs, in table order."""
    return [rule for rule in RULES if rule.service == service]


def open_paths() -> tuple[str, ...]:
    """The paths of the RPCs anyone may call without credentials."""
    return tuple(rule.path for rule in RULES if not rule.authenticated)


def missing_rows(service: str, methods: Iterable[str]) -> list[str]:
    """The methods of `service` among `methods` that have no row."""
    return [method for method in methods if rule_of(f"/{service}/{method}") is None]


_BY_PATH = {rule.path: rule for rule in RULES}
assert len(_BY_PATH) == len(RULES), "one row per RPC"


def _who(rule: Rule) -> str:
    if not rule.authenticated:
        return "anyone, without credentials"
    return "any node of the run, or the operator" if set(rule.callers) == set(EVERYONE) \
        else ", ".join(rule.callers)


def _on_what(rule: Rule) -> str:
    if not rule.acts_for:
        return "the service as a whole"
    others = " or ".join(rule.any_node)
    own = f"its own `{rule.acts_for}` ({others}: any)"
    if rule.optional_subject:
        own = f"nothing, or {own}" + (f", as a {rule.subject_role}" if rule.subject_role else "")
    if rule.role_field:
        own += f", in its own `{rule.role_field}`"
    if rule.session:
        own += f", with that worker's session ({rule.session})"
    if rule.holder:
        own += f"; only {rule.holder}"
    return own


def markdown() -> str:
    """The table as Markdown: one table of RPCs, one of the other sockets."""
    lines = ["| service | RPC | who may call | on what | limits |", "|---|---|---|---|---|"]
    lines += [f"| {rule.service.rsplit('.', 1)[-1]} | `{rule.method}` | {_who(rule)} | {_on_what(rule)} | "
              f"{rule.limits} |" for rule in RULES]
    lines += ["", "| socket | opened by | listens on | who may connect | authentication | limits |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {s.socket} | {s.opened_by} | {s.binds} | {s.callers} | {s.authentication} | {s.limits} |"
              for s in SOCKETS]
    return "\n".join(lines) + "\n"
