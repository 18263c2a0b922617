"""The coordinator's door: the bounds of every field it accepts (each refusal names the
field and its limit), the escaping of control characters for terminals, and the
rate-limited log of refused calls, on a fake clock."""

from __future__ import annotations

import pytest

from disttrain.config import config_from_dict
from disttrain.coordinator import limits
from disttrain.core.errors import ConfigError
from disttrain.core.refusal_log import RefusalLog, printable
from disttrain.proto import coordinator_pb2 as pb


def registration(**fields) -> pb.RegisterNodeRequest:
    return pb.RegisterNodeRequest(**{"node_id": "worker-0", "role": "worker", "rank": 0, "pid": 42, **fields})


def test_an_honest_registration_and_heartbeat_pass():
    limits.check_registration(registration(address="127.0.0.1:5000", hostname="node0.example.com",
                                           capabilities=pb.Capabilities(cpus=8, memory_bytes=2**36,
                                                                        gpu="NVIDIA H200", gpu_count=1)))
    limits.check_heartbeat(pb.HeartbeatMessage(node_id="rank-3", role="rank", pid=42, step=10,
                                               throughput=812.5, step_time_s=0.1, batch_size=64))


@pytest.mark.parametrize(("fields", "message"), [
    ({"node_id": "w" * 129}, "node_id has 129 characters, at most 128"),
    ({"node_id": ""}, "node_id is empty"),
    ({"node_id": "worker\x1b[2J"}, r"node_id 'worker\\x1b\[2J' has characters other than"),
    ({"node_id": "worker 0"}, "node_id 'worker 0' has characters other than"),
    ({"address": "h" * 257}, "address has 257 characters, at most 256"),
    ({"hostname": "node\n0"}, "hostname 'node\\\\n0' holds control characters"),
    ({"rank": 1 << 20}, "rank is 1048576"),
    ({"pid": 0}, "pid is 0"),
    ({"capabilities": pb.Capabilities(gpu="g" * 300)}, "capabilities.gpu has 300 characters"),
    ({"capabilities": pb.Capabilities(cpus=-1)}, r"capabilities.cpus is -1"),
])
def test_a_registration_field_out_of_bounds_is_refused_naming_it(fields, message):
    with pytest.raises(ValueError, match=message):
        limits.check_registration(registration(**fields))


@pytest.mark.parametrize("field", ["throughput", "step_time_s", "warmup_speed"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_a_heartbeat_figure_not_finite_or_negative_is_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} is"):
        limits.check_heartbeat(pb.HeartbeatMessage(node_id="worker-0", pid=42, **{field: value}))


def test_exit_reasons_and_metric_keys_are_bounded():
    with pytest.raises(ValueError, match="reason has 2000 characters, at most 1024"):
        limits.check_exit(pb.ExitReport(node_id="worker-0", reason="x" * 2000))
    with pytest.raises(ValueError, match="control characters"):
        limits.check_exit(pb.ExitReport(node_id="worker-0", reason="killed\r\x1b[1A"))
    with pytest.raises(ValueError, match="scalars key has 200 characters"):
        limits.check_metrics(pb.MetricsReport(node_id="worker-0", scalars={"k" * 200: 1.0}))


def test_printable_escapes_control_characters_only():
    assert printable("w\x1b[31mred\x07 é") == "w\\x1b[31mred\\x07 é"


def test_refusals_are_logged_once_per_caller_per_period_with_the_count():
    log = RefusalLog(period_s=10.0, max_callers=2)
    assert log.refused("a", now=0.0) == 1
    assert [log.refused("a", now=t) for t in (1.0, 2.0, 9.9)] == [0, 0, 0]
    assert log.refused("b", now=5.0) == 1  # another caller has its own allowance
    assert log.refused("a", now=10.0) == 4  # this one and the three kept quiet
    assert log.refused("c", now=11.0) == 1  # a third caller: the one logged longest ago is forgotten
    assert len(log._callers) == 2  # noqa: SLF001 - the table stays bounded


def test_the_node_table_limit_is_bounded_so_membership_answers_fit_a_client():
    with pytest.raises(ConfigError, match=r"coordinator.max_nodes: 100000 must be in \[1, 4096\]"):
        config_from_dict({"coordinator": {"max_nodes": 100000}})
    assert config_from_dict({"coordinator": {"max_nodes": 16}}).coordinator.max_nodes == 16
