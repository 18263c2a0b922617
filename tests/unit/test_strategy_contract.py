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
    from disttrain.strategies.ddp.participant import DDPParticipant
    from disttrain.strategies.ps.worker.participant import WorkerParticipant

    wanted = {name for name, _ in inspect.getmembers(Participant, inspect.isfunction)
              if not name.startswith("_")}
    assert wanted == {"start", "step", "evaluate", "state_dict", "load_state_dict"}
    for participant in (BaselineParticipant, DDPParticipant, WorkerParticipant):
        assert wanted <= set(dir(participant)) and "strategy" in dir(participant), participant


def test_ddp_has_one_participant_whatever_its_recovery():
    """Restart and live recovery are two policies of one DDP participant, not two
    strategies: no class of the DDP strategy but `DDPParticipant` offers the loop's step
    and evaluation, and each policy offers every piece the participant calls on it."""
    import importlib
    import pkgutil

    import disttrain.strategies.ddp as ddp
    from disttrain.strategies.ddp.live.participant import LiveRecovery
    from disttrain.strategies.ddp.participant import Recovery
    from disttrain.strategies.ddp.rank import RestartRecovery

    stepping = set()
    for found in pkgutil.walk_packages(ddp.__path__, f"{ddp.__name__}."):
        module = importlib.import_module(found.name)
        stepping |= {f"{module.__name__}.{name}" for name, cls in inspect.getmembers(module, inspect.isclass)
                     if cls.__module__ == module.__name__ and {"step", "evaluate"} <= set(vars(cls))}
    assert stepping == {"disttrain.strategies.ddp.participant.DDPParticipant"}
    wanted = {name for name, _ in inspect.getmembers(Recovery, inspect.isfunction)
              if not name.startswith("_")}
    assert wanted == {"start", "place", "begin_step", "end_step", "evaluated", "state_dict",
                      "load_state_dict"}
    for policy in (RestartRecovery, LiveRecovery):
        assert wanted <= set(dir(policy)) and "strategy" in dir(policy), policy
