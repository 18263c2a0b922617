"""The rule that reads the authorization table (`core.access`), without a server: who may
make a call at all, in whose name, in which role; a server without credentials trusts
everyone; a row open to anyone needs no credentials. The docs page shows the table as
the code has it (`tools/access_table.py`)."""

from __future__ import annotations

import pytest

from disttrain.core import access
from disttrain.core.identity import OPERATOR, Caller, NotPermitted
from disttrain.proto import coordinator_pb2 as cpb
from disttrain.proto import parameter_server_pb2 as pb
from tests.conftest import REPO_ROOT
from tools import access_table

WORKER0, WORKER1 = Caller("worker0", "worker"), Caller("worker1", "worker")
RANK0, SERVER0 = Caller("rank0", "rank"), Caller("server0", "server")
COORDINATOR0 = Caller("coordinator0", "coordinator")


def rule(path: str) -> access.Rule:
    found = access.rule_of(path)
    assert found is not None, path
    return found


def test_a_node_acts_in_its_own_name_and_role_only():
    register = rule("/disttrain.v1.CoordinatorService/RegisterNode")
    register.check(WORKER0, cpb.RegisterNodeRequest(node_id="worker0", role="worker"))
    with pytest.raises(NotPermitted, match=r"worker0 \(worker\) and may not act for node 'worker1'"):
        register.check(WORKER0, cpb.RegisterNodeRequest(node_id="worker1", role="worker"))
    with pytest.raises(NotPermitted, match="not a server"):
        register.check(WORKER0, cpb.RegisterNodeRequest(node_id="worker0", role="server"))
    # the operator acts for any node; a server without credentials knows no caller
    for caller in (OPERATOR, None):
        register.check(caller, cpb.RegisterNodeRequest(node_id="worker1", role="server"))


def test_only_the_roles_of_a_row_may_make_its_call():
    push = rule("/disttrain.v1.ParameterServerService/PushGradients")
    push.check(WORKER0, None)  # the role alone, before the request is read
    for caller in (RANK0, SERVER0, COORDINATOR0):
        with pytest.raises(NotPermitted, match="only worker nodes or the operator may make it"):
            push.check(caller, None)
        with pytest.raises(NotPermitted):
            push.check(caller, pb.GradientMessage(worker_id=caller.node_id))
    with pytest.raises(NotPermitted, match="'worker0'"):
        push.check(WORKER1, pb.GradientMessage(worker_id="worker0"))


def test_a_coordinator_may_tell_of_any_nodes_end_and_other_nodes_of_their_own():
    report = rule("/disttrain.v1.CoordinatorService/ReportExit")
    report.check(COORDINATOR0, cpb.ExitReport(node_id="worker0"))
    report.check(SERVER0, cpb.ExitReport(node_id="server0"))
    with pytest.raises(NotPermitted, match="'worker0'"):
        report.check(SERVER0, cpb.ExitReport(node_id="worker0"))


def test_an_observer_names_nobody_and_a_worker_only_itself():
    status = rule("/disttrain.v1.ParameterServerService/GetStatus")
    for caller in (RANK0, SERVER0, WORKER1):
        status.check(caller, pb.StatusRequest(wait_all_done=True))
    status.check(WORKER1, pb.StatusRequest(worker_id="worker1"))
    with pytest.raises(NotPermitted, match="'worker0'"):
        status.check(WORKER1, pb.StatusRequest(worker_id="worker0"))
    with pytest.raises(NotPermitted, match="not a worker"):
        status.check(RANK0, pb.StatusRequest(worker_id="rank0"))


def test_health_checks_are_open_and_nothing_else_is():
    assert access.open_paths() == ("/grpc.health.v1.Health/Check",)
    rule("/grpc.health.v1.Health/Check").check(Caller("anyone", "rank"))
    assert access.rule_of("/disttrain.v1.ParameterServerService/StealModel") is None
    assert access.missing_rows(access.SHARD_SERVICE, ["GetStatus", "StealModel"]) == ["StealModel"]


def test_every_request_that_names_a_node_is_checked_for_it():
    """A request with a node's id in it (node_id, worker_id) has a row that checks that
    field, and a row's `acts_for` and `role_field` are fields of its request (a typo would
    make the check fail for everyone, or name nothing)."""
    requests = {access.COORDINATOR_SERVICE: cpb.DESCRIPTOR.services_by_name["CoordinatorService"],
                access.SHARD_SERVICE: pb.DESCRIPTOR.services_by_name["ParameterServerService"]}
    for service, descriptor in requests.items():
        for row in access.rules_of(service):
            fields = descriptor.methods_by_name[row.method].input_type.fields_by_name
            named = [name for name in ("node_id", "worker_id") if name in fields]
            assert [row.acts_for] == named if named else not row.acts_for, row.method
            assert not row.role_field or row.role_field in fields, row.method
            assert OPERATOR.role in row.callers and OPERATOR.role in row.any_node, row.method


def test_the_docs_page_shows_the_table_as_the_code_has_it():
    page = (REPO_ROOT / "docs" / "security.md").read_text()
    assert access.markdown() in page, "run: python tools/access_table.py"
    assert access_table.render(page) == page
    with pytest.raises(ValueError, match="markers"):
        access_table.render("no markers here")
