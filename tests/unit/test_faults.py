"""Fault specs parse strictly, round-trip, load from plan files, and fire
only where and when they are meant to (signals and sleeps replaced by recorders)."""

import argparse
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disttrain.cli.flags import add_fault_flags, options_from_args
from disttrain.core import faults as faults_module
from disttrain.core.fault_spec import ACTIONS, OPTIONAL
from disttrain.core.faults import Fault, FaultInjector, format_fault, load_fault_plan, parse_fault


@pytest.mark.parametrize(("text", "fault"), [
    ("kill:worker=1:step=30", Fault("kill", 30, role="worker", index=1)),
    ("stop:worker=0:step=10:for=5s", Fault("stop", 10, 5.0, role="worker", index=0)),
    ("stop:rank=2:step=1:for=500ms", Fault("stop", 1, 0.5, role="rank", index=2)),
    ("kill:server=0:step=40", Fault("kill", 40, role="server", index=0)),
    ("kill:coordinator:step=20", Fault("kill", 20, role="coordinator")),
    ("drop-rpc:worker=1:step=15", Fault("drop-rpc", 15, role="worker", index=1)),
    ("slow:worker=1:factor=3", Fault("slow", role="worker", index=1, factor=3.0)),
    ("slow:rank=1:factor=3:step=100:until=300",
     Fault("slow", 100, role="rank", index=1, factor=3.0, until=300)),
    ("kill:rank=1:step=5:attempt=1", Fault("kill", 5, role="rank", index=1, attempt=1)),
    ("slow-eval:worker:for=2", Fault("slow-eval", seconds=2.0, role="worker")),
])
def test_parse(text, fault):
    assert parse_fault(text) == fault


@pytest.mark.parametrize(("text", "named"), [
    ("kill", "'kill'"), ("kill@step=3", "unknown action 'kill@step=3'"),
    ("kill:worker=1:step=x", "'step=x'"), ("slow-eval:worker=0:step=3", "needs for="),
    ("slow-eval:worker=0:for=-1", "'for=-1'"), ("kill:worker:step=3,rank=1", "'step=3,rank=1'"),
    ("explode:worker=1:step=3", "unknown action 'explode'"), ("kill:wrker=1:step=3", "'wrker=1'"),
    ("kill:coordinator=0:step=3", "'coordinator=0'"), ("kill:worker=x:step=3", "'worker=x'"),
    ("kill:worker=1", "needs step="), ("stop:worker=1:step=3", "needs for="),
    ("stop:worker=1:step=3:for=0s", "'for=0s'"), ("stop:worker=1:step=3:for=fast", "'for=fast'"),
    ("slow:worker=1:factor=0.5", "'factor=0.5'"), ("slow:worker=1:factor=nan", "'factor=nan'"),
    ("kill:worker=1:step=3:factor=2", "does not take factor="), ("kill:worker=1:step=3:step=4", "twice"),
    ("kill:worker=1:step=-3", "'step=-3'"), ("kill:worker=1:step=3:colour=2", "'colour=2'"),
    ("drop-rpc:server=0:step=3", "applies to worker, not server"),
    ("slow:coordinator:factor=2", "not coordinator"),
    ("kill:worker=1:step=3:until=5", "does not take until="),
])
def test_bad_specs_name_the_bad_part(text, named):
    with pytest.raises(ValueError, match="fault") as raised:
        parse_fault(text)
    assert named in str(raised.value)


def fault_strategy():
    def of_action(action):
        required, roles = ACTIONS[action]
        role = st.sampled_from(roles)
        return role.flatmap(lambda r: st.builds(
            Fault, st.just(action), role=st.just(r),
            index=st.none() if r == "coordinator" else st.none() | st.integers(0, 64),
            attempt=st.integers(0, 5),
            step=st.integers(0, 10**9) if "step" in required or action in OPTIONAL else st.just(0),
            until=st.integers(0, 10**9) if action in OPTIONAL else st.just(0),
            seconds=st.floats(1e-6, 1e6) if "for" in required else st.just(0.0),
            factor=st.floats(1.0, 1e3) if "factor" in required else st.just(1.0)))

    return st.sampled_from(sorted(ACTIONS)).flatmap(of_action)


@given(fault_strategy())
def test_format_round_trips(fault):
    assert parse_fault(format_fault(fault)) == fault


def test_format_writes_the_one_grammar():
    assert format_fault(parse_fault("kill:rank=1:step=7")) == "kill:rank=1:step=7"
    assert format_fault(parse_fault("kill:rank=1:step=7:attempt=2")) == "kill:rank=1:step=7:attempt=2"
    assert format_fault(parse_fault("slow-eval:worker:for=500ms")) == "slow-eval:worker:for=0.5s"
    assert format_fault(parse_fault("partition:server=1:step=4:for=2")) == "partition:server=1:step=4:for=2s"


def test_fault_plan_mixes_strings_and_mappings(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n"
                    "  - kill:worker=1:step=30\n"
                    "  - {action: stop, target: worker, index: 0, step: 10, for: 5s}\n"
                    "  - {action: kill, target: coordinator, step: 20, attempt: 1}\n"
                    "  - {action: slow, target: worker, index: 1, factor: 3}\n")
    assert load_fault_plan(plan) == [parse_fault("kill:worker=1:step=30"),
                                     parse_fault("stop:worker=0:step=10:for=5s"),
                                     parse_fault("kill:coordinator:step=20:attempt=1"),
                                     parse_fault("slow:worker=1:factor=3")]


@pytest.mark.parametrize(("text", "named"), [
    ("faults:\n  - kill:worker=1:step=3\n  - kill:worker=1\n", "entry 2"),
    ("faults:\n  - {action: kill, target: worker, step: 3, when: later}\n", "unknown key 'when'"),
    ("faults:\n  - {action: kill, step: 3}\n", "needs action and target"),
    ("faults:\n  - 3\n", "entry 1"),
    ("- kill:worker=1:step=3\n", "`faults:`"),
    ("faults: [kill:worker=1:step=3]\nextra: 1\n", "`faults:`"),
    ("faults: [unclosed\n", "cannot read"),
])
def test_bad_fault_plans_name_file_and_entry(tmp_path, text, named):
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    with pytest.raises(ValueError, match=str(plan)) as raised:
        load_fault_plan(plan)
    assert named in str(raised.value)


def test_missing_fault_plan(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_fault_plan(tmp_path / "absent.yaml")


def test_flags_feed_one_list(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults: [kill:server=0:step=40]\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    add_fault_flags(parser)
    args = parser.parse_args(["--inject", "kill:worker=1:step=30", "--fault-plan", str(plan),
                              "--inject=slow:rank=0:factor=2"])
    assert options_from_args(args).faults == (
        parse_fault("kill:worker=1:step=30"), parse_fault("slow:rank=0:factor=2"),
        parse_fault("kill:server=0:step=40"))
    assert options_from_args(parser.parse_args([])).faults == ()


@pytest.mark.parametrize("argv", [["--inject-fault", "kill:worker=1:step=3"],
                                  ["--inject", "kill@step=3,rank=1"]])
def test_only_the_one_flag_and_grammar_are_read(argv, capsys):
    parser = argparse.ArgumentParser()
    add_fault_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_selection_by_role_index_and_attempt():
    worker1, rank1, server0, coordinator = (
        parse_fault("kill:worker=1:step=3"), parse_fault("kill:rank=1:step=3"),
        parse_fault("kill:server=0:step=3"), parse_fault("kill:coordinator:step=3:attempt=1"))
    everything = [worker1, rank1, server0, coordinator]
    assert FaultInjector(everything, "worker", 1).faults == [worker1]
    assert FaultInjector(everything, "rank", 1).faults == [rank1]
    assert FaultInjector(everything, "rank", 1, attempt=1).faults == []
    assert FaultInjector(everything, "server", 0).faults == [server0]
    assert FaultInjector(everything, "worker", 1, attempt=1).faults == []
    assert FaultInjector(everything, "coordinator").faults == []
    assert FaultInjector(everything, "coordinator", attempt=1).faults == [coordinator]
    assert FaultInjector([parse_fault("kill:worker:step=3")], "worker", 7).faults
    with pytest.raises(ValueError, match="unknown role 'ranks'"):
        FaultInjector(everything, "ranks", 1)
    with pytest.raises(ValueError, match="no such fault"):
        Fault("slow", role="coordinator", factor=2.0)


@pytest.fixture
def signals(monkeypatch):
    """Signals the injector sends, recorded instead of delivered."""
    sent = []
    monkeypatch.setattr(faults_module.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    return sent


def test_kill_fires_once_when_the_step_is_reached(signals):
    injector = FaultInjector([parse_fault("kill:coordinator:step=20")], "coordinator")
    for step in (5, 19):
        injector.at_step(step)
    assert signals == []
    injector.at_step(23)  # a coordinator sees steps jump: reaching past 20 counts
    injector.at_step(24)
    assert [sig for _, sig in signals] == [signal.SIGKILL]


def test_stop_starts_a_detached_waker_then_stops_itself(signals, monkeypatch):
    started = []

    class FakeHelper:
        pid = 1

        def __init__(self, argv, **kwargs):
            started.append((argv, kwargs))

        def wait(self, timeout):
            return 0

    monkeypatch.setattr(faults_module.subprocess, "Popen", FakeHelper)
    FaultInjector([parse_fault("stop:worker=0:step=10:for=500ms")], "worker", 0).at_step(10)
    (argv, kwargs), = started
    assert kwargs["start_new_session"] and argv[-1] == "0.5" and argv[1] == "-c"
    assert signals == [(int(argv[-2]), signal.SIGSTOP)]


class FakeTime:
    """A clock that only moves when a step runs or the injector sleeps."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_slow_stretches_each_step_by_its_factor(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(faults_module.time, "sleep", fake.sleep)
    injector = FaultInjector([parse_fault("slow:worker=1:factor=3")], "worker", 1, clock=lambda: fake.now)
    for step, step_s in enumerate((1.0, 1.0, 0.5), start=1):
        fake.now += step_s
        injector.at_step(step)
    assert fake.slept == [2.0, 1.0]  # the first step is only measured
    FaultInjector([parse_fault("slow:worker=1:factor=3")], "worker", 0).at_step(1, train_time_s=9.0)
    assert fake.slept == [2.0, 1.0]


def test_a_slow_fault_with_steps_slows_only_from_its_step_until_its_end(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(faults_module.time, "sleep", fake.sleep)
    fault = parse_fault("slow:worker=0:factor=2:step=3:until=5")
    injector = FaultInjector([fault], "worker", 0, clock=lambda: fake.now)
    for step in range(1, 7):
        fake.now += 1.0
        injector.at_step(step)
    assert fake.slept == [1.0, 1.0]  # steps 3 and 4
    assert injector.straggle_for(1.0) == 0.0  # a warm-up before training is not slowed


def test_slow_stretches_a_steps_own_work_not_its_waits_for_peers(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(faults_module.time, "sleep", fake.sleep)
    injector = FaultInjector([parse_fault("slow:worker=1:factor=3")], "worker", 1, clock=lambda: fake.now)
    for step in (1, 2):
        fake.now += 1.0  # a step of 1 s, 0.75 s of it waiting for the other workers
        injector.at_step(step, waited_s=0.75)
    assert fake.slept == [0.5]  # (3 - 1) x the 0.25 s of work


def test_slow_measures_on_the_training_clock_when_given(monkeypatch):
    slept = []
    monkeypatch.setattr(faults_module.time, "sleep", slept.append)
    injector = FaultInjector([parse_fault("slow:rank=0:factor=2")], "rank", 0, clock=lambda: 0.0)
    injector.at_step(1, train_time_s=10.0)
    injector.at_step(2, train_time_s=10.25)
    assert slept == [0.25]


def test_drops_reply_once_for_its_worker_and_step():
    injector = FaultInjector([parse_fault("drop-rpc:worker=1:step=15")], "worker", 1)
    assert [injector.drops_reply(step) for step in (14, 15, 15, 16)] == [False, True, False, False]
    assert not FaultInjector([parse_fault("drop-rpc:worker=1:step=15")], "worker", 0).drops_reply(15)


def test_slow_evaluation_waits_where_it_is_meant_to(monkeypatch):
    slept = []
    monkeypatch.setattr("disttrain.core.faults.time.sleep", slept.append)
    slow_worker1 = parse_fault("slow-eval:worker=1:for=2s")
    FaultInjector([slow_worker1], "worker", 0).at_evaluation()
    FaultInjector([slow_worker1], "rank", 1).at_evaluation()
    FaultInjector([slow_worker1], "worker", 1).at_evaluation()
    FaultInjector([parse_fault("kill:worker=1:step=3")], "worker", 1).at_evaluation()
    FaultInjector([parse_fault("slow-eval:rank=0:for=1.5s")], "rank", 0).at_evaluation()
    assert slept == [2.0, 1.5]
