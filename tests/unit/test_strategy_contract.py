"""Every strategy offers the one contract the command line knows it by."""

import inspect

import pytest

from disttrain.strategies import baseline, ddp, ps
from disttrain.training.options import RunOptions
from disttrain.training.strategy import Participant


@pytest.mark.parametrize("module, name", [(baseline, "baseline"), (ps, "ps"), (ddp, "ddp")])
def test_each_strategy_runs_a_config_with_run_options(module, name):
    strategy = module.STRATEGY
    assert strategy.name == name
    assert list(inspect.signature(strategy.run).parameters) == ["config", "options"]


def test_run_options_default_to_a_fresh_quiet_run():
    assert RunOptions() == RunOptions(resume=False, faults=(), verbose=False)


def test_participants_offer_every_piece_the_loop_calls():
    from disttrain.strategies.baseline import BaselineParticipant
    from disttrain.strategies.ddp.rank import RankParticipant
    from disttrain.strategies.ps.worker.participant import WorkerParticipant

    wanted = {name for name, _ in inspect.getmembers(Participant, inspect.isfunction)
              if not name.startswith("_")}
    assert wanted == {"start", "step", "evaluate", "state_dict", "load_state_dict"}
    for participant in (BaselineParticipant, RankParticipant, WorkerParticipant):
        assert wanted <= set(dir(participant)) and "strategy" in dir(participant), participant
