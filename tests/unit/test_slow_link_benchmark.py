"""benchmarks/slow_link.py's reading of a run's metrics: the shards a configuration needs,
the largest exchange inside an epoch and an epoch's last step (a PS push overlapped with
the next steps summed over them, DDP's largest collective of a step), and the share of the
step blocked in exchanges."""

import importlib.util
import sys

import pytest
from conftest import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def slow_link(monkeypatch):
    """The script as a module (its imports of `common` and the multi-host helpers come from
    the paths it puts first, as when run; the fixture takes them off again)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("slow_link_benchmark", BENCHMARKS / "slow_link.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def step(number, epoch=0, **scalars):
    return {"step": number, "epoch": epoch, "loss/train": 0.1, "time/step_s": 0.1, **scalars}


def test_a_streaming_configuration_on_the_parameter_server_takes_a_shard_per_fragment(slow_link):
    _, flags = slow_link.CONFIGS["ps-sync+local32+stream4"]
    assert slow_link.num_shards(flags) == 4
    assert slow_link.num_shards(slow_link.CONFIGS["ps-sync+local32"][1]) == 1
    kind, ddp = slow_link.CONFIGS["ddp+local32+stream4"]
    assert kind == "ddp" and ddp[:len(slow_link.local(32))] == slow_link.local(32)
    assert {"training.outer_fragments=4", "training.outer_delay=2", "training.outer_mixing=0.5"} <= set(ddp)


def test_a_delayed_push_counts_the_steps_it_ran_through_and_the_epoch_end_apart(slow_link):
    sent = {2: 300, 3: 100, 6: 250, 8: 1000}  # pushes at 2 (over 2 steps) and 6; step 8 ends the epoch
    records = [step(s, **{"comm/bytes_sent": sent.get(s, 0), "local/rounds": 0}) for s in range(1, 9)]
    records.append(step(9, epoch=1, **{"comm/bytes_sent": 0, "local/rounds": 0}))
    assert slow_link.exchange_bytes(records) == {"peak": 400, "epoch_end": 1000}


def test_ddp_takes_its_largest_collective_and_plain_steps_are_each_an_exchange(slow_link):
    ddp = [step(1, **{"comm/bytes_allreduced": 0, "local/exchange_bytes": 0}),
           step(2, **{"comm/bytes_allreduced": 50, "local/exchange_bytes": 50}),
           step(3, **{"comm/bytes_allreduced": 60, "local/exchange_bytes": 60}),
           step(4, **{"comm/bytes_allreduced": 200, "local/exchange_bytes": 50})]
    assert slow_link.exchange_bytes(ddp) == {"peak": 60, "epoch_end": 200}
    plain = [step(s, **{"comm/bytes_allreduced": 70}) for s in (1, 2, 3)]
    assert slow_link.exchange_bytes(plain) == {"peak": 70, "epoch_end": 70}


def test_a_window_of_several_steps_is_refused(slow_link):
    with pytest.raises(ValueError, match="log_interval=1"):
        slow_link.exchange_bytes([step(10, **{"comm/bytes_sent": 5})])


def test_the_blocked_share_weighs_each_window_by_its_steps(slow_link):
    records = [{**step(1), "time/comm_blocked_s": 0.05, "time/step_s": 0.1},
               {**step(4), "time/comm_blocked_s": 0.0, "time/step_s": 0.2}]
    assert slow_link.blocked_share(records) == pytest.approx(0.05 / 0.7, abs=1e-4)
    assert slow_link.blocked_share([]) == 0.0
