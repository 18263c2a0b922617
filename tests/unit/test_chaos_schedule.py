"""The fault-schedule generator: the same seed gives the same schedule; every schedule it
draws is one the run accepts (`check_faults`: every target exists, every step is inside
the run, every attempt is brought about by an earlier fault of the plan); the patterns do
what they say (a second kill between the restore and the next checkpoint, a fault on an
epoch's last step); schedules survive their JSON."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.chaos.scenarios import SCENARIOS, scenario
from disttrain.chaos.schedule import PATTERNS, Schedule, draw
from disttrain.core.fault_spec import RunShape, check_faults

names = st.sampled_from(sorted(SCENARIOS))
seeds = st.integers(0, 2**31)


def shape(s) -> RunShape:
    """The run of scenario `s` as the CLI describes it to `check_faults`."""
    steps = s.total_steps
    if s.command == "ps":
        return RunShape(s.name, s.processes(), {"worker": steps, "server": s.workers * steps,
                                                "coordinator": s.workers * steps})
    return RunShape(s.name, s.processes(), {"rank": steps}, restarted=("rank",),
                    group_restart=s.group_restart)


@settings(max_examples=300, deadline=None)
@given(names, seeds)
def test_every_schedule_drawn_is_one_the_run_accepts(name, seed):
    s = scenario(name)
    schedule = draw(s, seed)
    check_faults(schedule.faults, shape(s))  # raises on a fault that could never fire
    assert 1 <= len(schedule.patterns) <= 2 and set(schedule.patterns) <= set(PATTERNS)
    for timed in schedule.timed:
        assert timed.role in s.processes() and timed.index < s.processes()[timed.role]


@settings(max_examples=100, deadline=None)
@given(names, seeds)
def test_the_same_seed_draws_the_same_schedule_and_it_survives_json(name, seed):
    s = scenario(name)
    assert draw(s, seed) == draw(s, seed)
    assert Schedule.from_dict(draw(s, seed).to_dict()) == draw(s, seed)


def test_seeds_draw_different_schedules():
    s = scenario("ps-sync")
    assert len({tuple(draw(s, seed).lines()) for seed in range(50)}) > 40


def drawn(pattern: str, name: str, count: int = 400):
    s = scenario(name)
    schedules = (draw(s, seed, max_patterns=1) for seed in range(count))
    return s, [d for d in schedules if d.patterns == (pattern,)]


def test_twice_before_checkpoint_kills_a_process_again_before_its_next_checkpoint():
    s, schedules = drawn("twice-before-checkpoint", "ps-async")
    seen = 0
    for schedule in schedules:
        kills = [f for f in schedule.faults if f.action == "kill"]
        if len(kills) == 2:
            first, second = kills
            assert (first.role, first.index) == (second.role, second.index)
            assert (first.attempt, second.attempt) == (0, 1)
            restored = first.step - first.step % s.checkpoint_interval
            assert restored < second.step < restored + s.checkpoint_interval
            seen += 1
    assert seen > 5


def test_epoch_boundary_faults_fire_on_an_epochs_last_step():
    s, schedules = drawn("epoch-boundary", "ps-sync")
    assert schedules
    for schedule in schedules:
        (fault,) = schedule.faults
        boundary = fault.step // s.workers if fault.role in ("server", "coordinator") and s.mode == "async" \
            else fault.step
        assert boundary % s.steps_per_epoch == 0 and 0 < boundary < s.total_steps


def test_a_restart_of_the_group_moves_every_rank_to_its_next_start():
    s, schedules = drawn("during-recovery", "ddp-restart")
    follow_ups = [f for schedule in schedules for f in schedule.faults if f.attempt == 1]
    assert follow_ups and all(f.role == "rank" for f in follow_ups)
    check_faults([f for schedule in schedules for f in schedule.faults], shape(s))


def test_hostile_schedules_kill_from_outside_more_often_than_one_budget_allows():
    s, schedules = drawn("hostile", "ps-sync")
    assert schedules and all(4 <= len(d.timed) <= 8 for d in schedules)
    gaps = [b.at_s - a.at_s for d in schedules for a, b in zip(d.timed, d.timed[1:], strict=False)]
    assert all(0 < gap <= 6.0 for gap in gaps)
    assert any(max(sum(1 for t in d.timed if (t.role, t.index) == (u.role, u.index)) for u in d.timed)
               > s.max_restarts for d in schedules)
