"""The pure rules of node identity: a node token names its node and only the run's secret
makes it; the secret itself is the operator's; a malformed token names nobody; a
launcher hands each worker its own token and the servers the secret; `tls new` names
parse as NAME[:ROLE]. (What each identity may call: tests/unit/test_access_rules.py.)"""

from __future__ import annotations

import pytest

from disttrain.coordinator.launch import token_env
from disttrain.core.auth import TOKEN_ENV, new_token
from disttrain.core.errors import ConfigError
from disttrain.core.identity import (
    OPERATOR,
    Caller,
    CertificatePolicy,
    certificate_caller,
    named_in,
    node_token,
    own_token,
    verify_token,
)
from disttrain.core.pki import NodeName, parse_node
from disttrain.core.process_spec import ProcessSpec

SECRET = new_token()


def test_a_node_token_names_its_node_and_only_the_secret_makes_it():
    token = node_token(SECRET, "worker1", "worker")
    assert verify_token(SECRET, token) == Caller("worker1", "worker")
    assert SECRET not in token and token != node_token(SECRET, "worker2", "worker")
    assert node_token(SECRET, "worker1", "server") != token  # the role is part of what is signed
    assert verify_token(new_token(), token) is None  # another run's secret
    prefix, mac = token.rsplit("~", 1)
    for forged in (f"{prefix}~{mac[::-1]}", token.replace("worker1", "worker2"),
                   token.replace("~worker~", "~server~"), f"{prefix}~", "node~worker~~" + mac):
        assert verify_token(SECRET, forged) is None, forged


def test_a_process_handed_the_secret_calls_with_its_own_node_token():
    mine = own_token(SECRET, "rank1", "rank")
    assert mine == node_token(SECRET, "rank1", "rank")
    assert verify_token(SECRET, mine) == Caller("rank1", "rank")
    assert own_token(mine, "rank1", "rank") == mine  # a node token is kept as it is


def test_the_secret_is_the_operator_and_nothing_else_is():
    assert verify_token(SECRET, SECRET) == OPERATOR and OPERATOR.is_operator
    assert verify_token(SECRET, SECRET + "x") is None and verify_token(SECRET, "") is None


@pytest.mark.parametrize(("node_id", "role"), [("", "worker"), ("a~b", "worker"), ("w 1", "worker"),
                                               ("worker0", "operator"), ("worker0", "admin")])
def test_a_node_token_needs_a_plain_id_and_a_role_of_the_run(node_id, role):
    with pytest.raises(ValueError):
        node_token(SECRET, node_id, role)


@pytest.mark.parametrize("token", ["node~worker~worker 0~" + "0" * 64, "node~worker~a~b~00",
                                   "node~~worker0~00", "node~worker~~00", "node~admin~worker0~00"])
def test_a_malformed_node_token_names_nobody(token):
    """Not even an id no node token can name (a space, a separator): checking it raised
    once, and the call was answered UNKNOWN with a traceback instead of UNAUTHENTICATED."""
    assert named_in(token) is None and verify_token(SECRET, token) is None


def test_a_certificate_names_a_node_only_with_a_role_of_the_run():
    assert certificate_caller("worker3", "worker") == Caller("worker3", "worker")
    assert certificate_caller("server", "operator") == OPERATOR
    # a certificate of the CA without a role was the operator's: it names nobody, unless the
    # operator names it
    assert certificate_caller("node", "") is None
    assert certificate_caller("node", "", policy=CertificatePolicy(operators=("node",))) == OPERATOR
    assert certificate_caller("worker3", "worker", policy=CertificatePolicy(operators=("worker3",))) == \
        Caller("worker3", "worker")  # a node's certificate stays the node's
    # under a CA of run r1, only certificates naming r1 name anyone
    run = CertificatePolicy(run_id="r1")
    assert certificate_caller("worker3", "worker", "r1", run) == Caller("worker3", "worker")
    assert certificate_caller("server", "operator", "r1", run) == OPERATOR
    for run_id in ("r2", None):
        assert certificate_caller("worker3", "worker", run_id, run) is None
        assert certificate_caller("server", "operator", run_id, run) is None


def test_a_launcher_hands_each_worker_its_own_token_and_the_servers_the_secret():
    env = token_env(SECRET)
    worker = env(ProcessSpec("ps-worker", worker_id="worker3"))
    assert worker == {TOKEN_ENV: node_token(SECRET, "worker3", "worker")}
    assert env(ProcessSpec("ps-server", shard=(0, 1))) == {TOKEN_ENV: SECRET}
    assert env(ProcessSpec("coordinator")) == {TOKEN_ENV: SECRET}


def test_tls_node_names_take_their_role_from_the_name_or_after_a_colon():
    assert parse_node("worker12") == NodeName("worker12", "worker")
    assert parse_node("host-a:worker") == NodeName("host-a", "worker")
    assert parse_node("ops:operator") == NodeName("ops", "operator")
    for bad in ("host-a", "worker0:admin", "", "a b:worker"):
        with pytest.raises(ConfigError):
            parse_node(bad)


def test_a_worker_holding_a_node_token_is_named_by_it(tmp_path, capsys):
    from disttrain.cli import main
    token = tmp_path / "worker5.token"
    token.write_text(node_token(SECRET, "worker5", "worker"))
    token.chmod(0o600)
    assert main(["ps-worker", "--servers", "127.0.0.1:1", "--token-file", str(token), "--check-config"]) == 0
    assert "worker worker5" in capsys.readouterr().out
