"""The fault-schedule generator: the same seed gives the same schedule; every schedule it
draws is one the run accepts (`check_faults`: every target exists, every step is inside
the run, every attempt is brought about by an earlier fault of the plan); the patterns do
what they say (a second kill between the restore and the next checkpoint, a fault on an
epoch's last step); schedules survive their JSON. Preemptions: drawn only for preemptible
scenarios, at increasing steps inside the run and after every other fault, to the
launcher or a member of the launch they stop, resumed on a size that keeps the global
batch (another size only where the scenario is resizable)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.chaos.runner import slowed_flags
from disttrain.chaos.scenarios import SCENARIOS, scenario
from disttrain.chaos.schedule import (
    LAUNCHER,
    PATTERNS,
    PREEMPTION_MARGIN_STEPS,
    Preemption,
    Schedule,
    draw,
    last_preemption_step,
    worker_step,
)
from disttrain.core.fault_spec import RunShape, check_faults, parse_fault

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
    others = [p for p in schedule.patterns if p != "preemption"]
    assert len(others) <= 2 and set(others) <= set(PATTERNS)
    assert others or schedule.patterns == ("preemption",)
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


@settings(max_examples=300, deadline=None)
@given(names, seeds)
def test_drawn_preemptions_fall_inside_the_run_after_every_fault_on_sizes_that_keep_the_batch(name, seed):
    s = scenario(name)
    schedule = draw(s, seed)
    assert bool(schedule.preemptions) == ("preemption" in schedule.patterns)
    if not s.preemptible:
        assert not schedule.preemptions
        return
    if schedule.patterns == ("preemption",):
        assert not schedule.faults and not schedule.timed
    size, step = s.workers, max((worker_step(s, f) for f in schedule.faults), default=0)
    for preemption in schedule.preemptions:
        assert step + PREEMPTION_MARGIN_STEPS <= preemption.step <= last_preemption_step(s)
        assert last_preemption_step(s) <= s.total_steps - PREEMPTION_MARGIN_STEPS
        assert preemption.target in (LAUNCHER, s.member_role)
        assert 0 <= preemption.index < size  # a member of the launch it stops
        assert preemption.size in s.sizes()
        assert (s.batch_size * s.workers) % preemption.size == 0 and s.train_samples % preemption.size == 0
        step, size = preemption.step, preemption.size
    if not s.resizable:
        assert {p.size for p in schedule.preemptions} <= {s.workers}


def test_sizes_keep_the_global_batch_only_where_the_scenario_resizes():
    assert scenario("ps-sync").sizes() == (1, 2, 4) and scenario("ddp-restart").sizes() == (1, 2, 4)
    assert scenario("ps-async").sizes() == (1, 2, 4) and scenario("ps-ssp").sizes() == (1, 2, 4)
    assert scenario("ps-local").sizes() == (2,) and scenario("ddp-live").sizes() == (2,)


def test_preemptions_are_drawn_in_proportion_alone_and_after_other_faults_with_joins_and_leaves():
    for name in ("ps-sync", "ddp-restart"):
        s = scenario(name)
        schedules = [draw(s, seed) for seed in range(400)]
        preempted = [d for d in schedules if d.preemptions]
        assert 0.2 * len(schedules) < len(preempted) < 0.4 * len(schedules)
        assert any(d.patterns == ("preemption",) for d in preempted)
        assert any(len(d.patterns) > 1 and d.faults for d in preempted)
        preemptions = [p for d in preempted for p in d.preemptions]
        assert {p.target for p in preemptions} == {LAUNCHER, s.member_role}
        assert {p.size for p in preemptions} == set(s.sizes())
        assert any(len(d.preemptions) == 2 for d in preempted)
    assert not any(draw(scenario("ddp-live"), seed).preemptions for seed in range(200))


def test_a_preemption_reads_as_what_it_sends_and_survives_json():
    schedule = Schedule("ddp-restart", 7, ("preemption",),
                        preemptions=(Preemption(30, "rank", 1, 4), Preemption(90, LAUNCHER, 0, 1)))
    assert schedule.lines() == [
        "preempt at step 30: SIGTERM to rank 1, resumed on 4 ranks (from outside)",
        "preempt at step 90: SIGTERM to the launcher, resumed on 1 rank (from outside)"]
    assert Schedule.from_dict(schedule.to_dict()) == schedule
    old = {k: v for k, v in schedule.to_dict().items() if k != "preemptions"}  # a result saved before them
    assert Schedule.from_dict(old).preemptions == ()


@settings(max_examples=200, deadline=None)
@given(seeds)
def test_a_preempted_ddp_run_isslowed_flags_on_every_start_its_faults_bring_about_and_accepts_it(seed):
    s = scenario("ddp-restart")
    schedule = draw(s, seed)
    slowed = [parse_fault(flag.removeprefix("--inject=")) for flag in slowed_flags(s, schedule.faults)]
    assert {f.attempt for f in slowed} >= {0} and all(f.action == "slow" and f.index is None for f in slowed)
    restarting = [f for f in schedule.faults if f.action in ("kill", "crash-checkpoint")
                  or (f.action == "stop" and f.seconds > s.heartbeat_timeout_s)]
    assert {f.attempt for f in slowed} == {0} | {f.attempt + 1 for f in restarting}
    check_faults([*schedule.faults, *slowed], shape(s))  # the run accepts them all
    assert slowed_flags(scenario("ps-sync"), schedule.faults) == []
