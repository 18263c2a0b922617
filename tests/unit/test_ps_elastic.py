"""The decisions of a parameter-server run that grows and shrinks (`strategies.ps.run.elastic`):
which events change its size and to what, within MIN:MAX; the range as configured and as
`--workers MIN:MAX` spells it, refused when MIN > MAX or with state a resize cannot carry;
the faults of steps passed dropped at a change."""

import argparse

import pytest

from disttrain.cli.flags import CONFIG_PREFIX, size_arg, split_size_range
from disttrain.config import Config
from disttrain.config.loading import load_config
from disttrain.core.errors import ConfigError
from disttrain.core.fault_spec import parse_fault
from disttrain.core.processes import Event
from disttrain.strategies.ps.run.elastic import GROW_EVENT, Range, check_elastic, faults_after
from disttrain.strategies.ps.run.preemption import LAUNCHER, PREEMPT_EVENT
from disttrain.strategies.ps.worker.preemption import PREEMPTING_EVENT


def elastic_config(low: int, high: int, **ps) -> Config:
    return Config().replace(system={"num_workers": low}, ps={"max_workers": high, **ps})


def test_a_grow_adds_one_worker_up_to_max_and_a_worker_s_sigterm_leaves_down_to_min():
    sizes = Range.of(elastic_config(2, 4))
    assert sizes == Range(2, 4)
    grow = Event(LAUNCHER, GROW_EVENT, {})
    assert sizes.change(grow, 2) == (3, "SIGUSR1: growing from 2 to 3 workers")
    assert sizes.change(grow, 4) is None  # at MAX: ignored
    leave = Event("worker1", PREEMPTING_EVENT, {"step": 7})
    assert sizes.change(leave, 3) == (2, "worker1 was sent SIGTERM: a planned leave, 3 to 2 workers")
    assert sizes.change(Event("worker0", "exit", {"code": 143}), 3)[0] == 2
    assert sizes.change(leave, 2) is None  # below MIN: a preemption of the whole run
    assert sizes.change(Event(LAUNCHER, PREEMPT_EVENT, {}), 3) is None  # the launcher's SIGTERM
    assert sizes.change(Event("server0", "exit", {"code": 143}), 3) is None
    assert sizes.change(Event("worker0", "exit", {"code": 1}), 3) is None  # a failure, not a leave


def test_a_fixed_run_has_no_range_and_a_range_below_its_minimum_is_refused():
    assert Range.of(Config()) is None
    with pytest.raises(ConfigError, match=r"ps.max_workers: 2 is less than system.num_workers \(3\)"):
        load_config(None, {"system.num_workers": 3, "ps.max_workers": 2})
    assert load_config(None, {"system.num_workers": 2, "ps.max_workers": 3}).ps.max_workers == 3


def test_an_elastic_run_with_state_of_its_workers_numbering_is_refused():
    check_elastic(elastic_config(2, 3, aggregation_mode="ssp"))
    with pytest.raises(ConfigError, match=r"^ps.max_workers: .*ps.backup_workers > 0; give --workers N$"):
        check_elastic(elastic_config(2, 3, backup_workers=1))


WORKERS_KEY = CONFIG_PREFIX + "system.num_workers"


@pytest.mark.parametrize("text, keys", [("3", (3, None)), ("2:4", (2, 4))])
def test_workers_min_max_is_split_into_its_keys(text, keys):
    args = argparse.Namespace(**{WORKERS_KEY: size_arg(text)})
    split_size_range(args, "--workers", "ps.max_workers")
    assert (getattr(args, WORKERS_KEY), getattr(args, CONFIG_PREFIX + "ps.max_workers", None)) == keys


def test_workers_min_max_out_of_order_or_not_numbers_are_refused():
    with pytest.raises(ConfigError, match=r"^--workers 3:2: MIN must be at least 1 and at most MAX"):
        split_size_range(argparse.Namespace(**{WORKERS_KEY: (3, 2)}), "--workers", "ps.max_workers")
    with pytest.raises(argparse.ArgumentTypeError, match="is not N or MIN:MAX"):
        size_arg("2:x")


def test_faults_of_worker_steps_passed_are_dropped_at_a_change():
    faults = [parse_fault("term:worker=2:step=70"), parse_fault("term:worker=1:step=30"),
              parse_fault("kill:server=0:step=10")]
    assert faults_after(faults, 40) == [faults[0], faults[2]]
