"""Who calls a server of the run: an identity per node. Pure: no gRPC (`core.auth` reads
the identity off a call; `core.access` says what each identity may call, on what).

The run's secret (`disttrain token new`) makes every identity: node `worker1` of role
`worker` holds the token `node~worker~worker1~<HMAC-SHA256(secret, "worker:worker1")>`,
which names it and which only a holder of the secret can make. Launchers hand each
process they start only its own node token; servers and the coordinator hold the secret
and check the HMAC (a server still calls the coordinator with its own node token). A
caller presenting the secret itself is the operator (a launcher, `disttrain status`),
trusted to act for any node.

With mutual TLS, a certificate from `disttrain tls new` names its node the same way
(CN = node id, OU = role) and its run (a URI `disttrain://<run id>/<role>/<node id>` among
its subject alternative names, which the run's CA carries too); a certificate of another
run, or naming no role of the run, names nobody (the server refuses it) unless the
operator named it (`certificate_caller`). As a server's, a certificate is valid only for
the service it names: DNS name `<role>.<run id>.disttrain` (and `<node id>.<role>.<run
id>.disttrain`), which a client of the run checks in place of the host name
(`service_name`).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

OPERATOR_ROLE = "operator"
NODE_ROLES = ("worker", "server", "rank", "coordinator")  # the coordinator's roles
PREFIX = "node~"
SEPARATOR = "~"  # in no node id (the coordinator allows letters, digits and ._:@+/-) nor role


@dataclass(frozen=True)
class Caller:
    """Who a call comes from: node `node_id` in `role`, or the operator."""

    node_id: str
    role: str

    @property
    def is_operator(self) -> bool:
        return self.role == OPERATOR_ROLE

    def __str__(self) -> str:
        return "the operator" if self.is_operator else f"{self.node_id} ({self.role})"


OPERATOR = Caller("", OPERATOR_ROLE)


class NotPermitted(PermissionError):
    """The caller may not make this call (another node's, or not its role's: the
    authorization table, `core.access`). Not recoverable for that caller: the call
    changes nothing."""


def node_token(secret: str, node_id: str, role: str) -> str:
    """The token of node `node_id` in `role`, made from the run's `secret`.

    Raises:
        ValueError: an empty node id, a role not of the run, or a separator in either.
    """
    if not _plain(node_id):
        raise ValueError(f"node id {node_id!r}: printable, without spaces or {SEPARATOR!r}, e.g. worker0")
    if role not in NODE_ROLES:
        raise ValueError(f"role {role!r}: one of {', '.join(NODE_ROLES)}")
    return f"{PREFIX}{role}{SEPARATOR}{node_id}{SEPARATOR}{_mac(secret, node_id, role)}"


def own_token(token: str, node_id: str, role: str) -> str:
    """The token node `node_id` calls with, given `token`: its own node token when `token`
    is the run's secret (a process handed the secret, as torch's elastic agent hands every
    rank the same environment, then calls in its own name only); a node token unchanged."""
    return token if named_in(token) is not None else node_token(token, node_id, role)


def _plain(node_id: str) -> bool:
    """Whether `node_id` may be named by a node token: printable, without spaces or separator."""
    return bool(node_id) and SEPARATOR not in node_id and all("!" <= c <= "~" for c in node_id)


def _mac(secret: str, node_id: str, role: str) -> str:
    return hmac.new(secret.encode(), f"{role}:{node_id}".encode(), hashlib.sha256).hexdigest()


def verify_token(secret: str, presented: str) -> Caller | None:
    """Who `presented` says the caller is: the operator for the secret itself, the node it
    names for a node token made from the secret; None for anything else. Compared in
    constant time."""
    if hmac.compare_digest(presented.encode(), secret.encode()):
        return OPERATOR
    if not presented.startswith(PREFIX):
        return None
    named = named_in(presented)
    if named is None:
        return None
    expected = node_token(secret, named.node_id, named.role)
    return named if hmac.compare_digest(presented.encode(), expected.encode()) else None


def named_in(token: str) -> Caller | None:
    """The node a node token names, read without checking it (a client cannot: it lacks
    the secret; the servers check it); None for any other token, a malformed one included
    (an id no node token can name: empty, with spaces or a separator)."""
    if not token.startswith(PREFIX):
        return None
    role, _, rest = token[len(PREFIX):].partition(SEPARATOR)
    node_id, _, _ = rest.rpartition(SEPARATOR)
    return Caller(node_id, role) if role in NODE_ROLES and _plain(node_id) else None


RUN_SCHEME = "disttrain"
SERVICE_DOMAIN = "disttrain"
SERVICE_ROLES = ("coordinator", "server")  # the roles that serve something to clients of the run


def run_uri(run_id: str, role: str, node_id: str = "") -> str:
    """The URI naming a certificate's run, role and node (the run's CA: role "ca")."""
    return f"{RUN_SCHEME}://{run_id}/{role}/{node_id}"


def parse_run_uri(uri: str) -> tuple[str, str, str] | None:
    """(run id, role, node id) of a `run_uri`; None for any other URI."""
    prefix = f"{RUN_SCHEME}://"
    if not uri.startswith(prefix):
        return None
    parts = uri[len(prefix):].split("/")
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 and parts[0] and parts[1] else None


def plain_label(text: str) -> bool:
    """Whether `text` can be one label of a DNS name (letters, digits, '-')."""
    return 0 < len(text) <= 63 and all(c.isascii() and (c.isalnum() or c == "-") for c in text) \
        and not text.startswith("-") and not text.endswith("-")


def service_name(run_id: str, role: str, node_id: str = "") -> str:
    """The DNS name a server certificate of run `run_id` carries for serving as `role`
    (as node `node_id` when given): what a client of the run checks in place of the host
    name, so that only a certificate of that role (and node) serves that service."""
    name = f"{role}.{run_id}.{SERVICE_DOMAIN}"
    return f"{node_id}.{name}" if node_id else name


@dataclass(frozen=True)
class CertificatePolicy:
    """Which client certificates a server of a run takes, and as whom.

    Args:
        run_id: the run its CA was made for (None: a CA of the user's own, whose
            certificates name no run).
        operators: common names of certificates the operator names as its own (`--tls-operator`).
    """

    run_id: str | None = None
    operators: tuple[str, ...] = ()


# A server's policy under a CA that names no run, with no certificate named the operator's.
ROLES_ONLY = CertificatePolicy()


def certificate_caller(common_name: str, unit: str, run_id: str | None = None,
                       policy: CertificatePolicy = ROLES_ONLY) -> Caller | None:
    """The caller a client certificate names, for a server under `policy`: node
    `common_name` when its organizational unit `unit` is a role of the run, the operator
    when it is the operator's, for a certificate of the server's run (`run_id`: what its
    URI names; when the server's CA names a run, a certificate must name the same); or the
    operator when `policy` names `common_name` as the operator's; else None (nobody: a
    certificate of another run, or naming no role of the run, is refused)."""
    if common_name and common_name in policy.operators and unit not in NODE_ROLES:
        return OPERATOR
    if policy.run_id is not None and run_id != policy.run_id:
        return None
    if unit in NODE_ROLES and common_name:
        return Caller(common_name, unit)
    return OPERATOR if unit == OPERATOR_ROLE else None
