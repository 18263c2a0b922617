"""The schedules of a live elastic DDP scenario (`ddp-elastic`, `disttrain ddp --ddp-recovery
live --world-size 2:4`): the same seed draws the same arrivals, planned leaves and rank
kills, and they survive their JSON; one to four changes at increasing steps inside the run,
within MIN:MAX, never below MIN by leaves alone, never the last of the first launcher's
ranks leaving; arrivals take the slots after the first ones in order; each slot killed
within its restart budget. The sizes a schedule leads to, the runner's check of the sizes
the summary lists, and the scenario run only when named."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.chaos.campaign import summarize
from disttrain.chaos.elastic import (
    JOIN,
    KILL,
    LEAVE,
    LIVE_MARGIN_STEPS,
    MAX_LIVE_CHANGES,
    LiveChange,
    live_sizes,
)
from disttrain.chaos.invariants import check_live_end
from disttrain.chaos.runner import Launch, arrival_violations, live_size_violations
from disttrain.chaos.scenarios import SCENARIOS, scenario
from disttrain.chaos.schedule import Schedule, draw

LIVE = scenario("ddp-elastic")
MIN, MAX = LIVE.workers, LIVE.max_workers
seeds = st.integers(0, 2**31)


@settings(max_examples=300, deadline=None)
@given(seeds)
def test_drawn_changes_fall_inside_the_run_in_order_within_min_and_max(seed):
    schedule = draw(LIVE, seed)
    assert schedule.patterns == ("elastic",)
    assert not (schedule.faults or schedule.timed or schedule.preemptions or schedule.resizes)
    assert 1 <= len(schedule.live_changes) <= MAX_LIVE_CHANGES
    members, arrivals, step, kills = set(range(MIN)), MIN, 0, Counter()
    for change in schedule.live_changes:
        assert step + LIVE_MARGIN_STEPS <= change.step <= LIVE.total_steps - LIVE_MARGIN_STEPS
        assert change.before == len(members)
        if change.action == JOIN:
            assert change.slot == arrivals and len(members) < MAX  # the next slot, never reused
            members.add(change.slot)
            arrivals += 1
        elif change.action == LEAVE:
            assert change.slot in members and len(members) > MIN  # never below MIN by a leave
            members.remove(change.slot)
            assert members & set(range(MIN)), "the first launcher keeps a rank"
            assert not change.to_launcher or change.slot >= MIN  # only an arrival has a launcher of its own
        else:
            assert change.action == KILL and change.slot in members
            kills[change.slot] += 1
            assert kills[change.slot] < LIVE.max_restarts
        assert change.size == len(members) and MIN <= change.size <= MAX
        step = change.step
    assert live_sizes(MIN, schedule.live_changes)[-1] == len(members)


@settings(max_examples=100, deadline=None)
@given(seeds)
def test_the_same_seed_draws_the_same_changes_and_they_survive_json(seed):
    assert draw(LIVE, seed) == draw(LIVE, seed)
    assert Schedule.from_dict(draw(LIVE, seed).to_dict()) == draw(LIVE, seed)


def test_seeds_draw_every_kind_of_change_at_every_size():
    changes = [c for seed in range(300) for c in draw(LIVE, seed).live_changes]
    kinds = Counter((c.action, c.to_launcher) for c in changes)
    assert min(kinds[(JOIN, False)], kinds[(LEAVE, False)], kinds[(LEAVE, True)], kinds[(KILL, False)]) > 20
    assert {c.size for c in changes} == {2, 3, 4}
    assert {c.slot for c in changes if c.action == LEAVE} >= {0, 1, 2, 3}
    assert {c.before for c in changes if c.action == KILL} == {2, 3, 4}  # a dip below MIN too
    assert len({tuple(draw(LIVE, seed).lines()) for seed in range(50)}) > 45


def test_a_change_reads_as_what_it_sends_and_leads_to_its_sizes():
    join, kill = LiveChange(72, JOIN, 2, 3), LiveChange(101, KILL, 2, 3)
    leave = LiveChange(126, LEAVE, 2, 2, to_launcher=True)
    assert join.describe() == \
        "resize at step 72: an arrival started with --join, slot 2 (grow), 2 to 3 ranks (from outside)"
    assert kill.describe() == \
        "resize at step 101: SIGKILL to rank 2 (live recovery), 3 to 2 ranks and back (from outside)"
    assert leave.describe() == "resize at step 126: SIGTERM to the launcher of arrival slot 2 (planned " \
                               "leave), 3 to 2 ranks (from outside)"
    assert LiveChange(50, LEAVE, 0, 2).describe().startswith("resize at step 50: SIGTERM to rank 0 (planned")
    assert live_sizes(2, (join, kill, leave)) == [2, 3, 2, 3, 2]


def test_the_runner_holds_the_group_to_the_sizes_it_was_sent():
    changes = (LiveChange(72, JOIN, 2, 3), LiveChange(101, KILL, 2, 3), LiveChange(126, LEAVE, 2, 2))
    schedule = Schedule("ddp-elastic", 3, ("elastic",), live_changes=changes)
    assert live_size_violations(LIVE, schedule, 3, [2, 3, 2, 3, 2]) == []
    assert live_size_violations(LIVE, schedule, 2, [2, 3, 2, 3]) == []  # the leave never sent: ended first
    assert live_size_violations(LIVE, schedule, 3, [2, 3, 2, 3]) == []  # sent after the last boundary
    assert live_size_violations(LIVE, schedule, 2, [2, 3, 2]) == []  # the run ended before the rejoin
    assert live_size_violations(LIVE, schedule, 3, [2, 3, 2])  # two changes missing
    assert live_size_violations(LIVE, schedule, 3, [2, 3, 2, 3, 2, 3])  # a size nobody asked for
    assert live_size_violations(LIVE, schedule, 1, None)  # no summary


def test_every_arrival_must_end_well():
    assert arrival_violations(Launch(0, 1.0, "", arrival_codes={2: 0, 3: 0})) == []
    assert arrival_violations(Launch(0, 1.0, "", arrival_codes={2: 0, 3: 1, 4: None})) == [
        "the arrival's launcher of slot 3 exited 1, not 0",
        "the arrival's launcher of slot 4 did not end after the run (killed)"]


def test_the_end_of_a_live_group_is_read_from_its_summary():
    samples = LIVE.epochs * LIVE.train_samples  # 1,408 is 44 global batches of 32
    good = {"samples_applied": samples, "samples_lost": 0, "samples_applied_twice": 0,
            "steps": LIVE.total_steps, "rank_pids": {"0": [10], "1": [11, 12]}}
    assert check_live_end(LIVE, good, killed={1}) == []
    assert check_live_end(LIVE, good) == ["rank 1 was started 2 times (pids [11, 12]) though no fault "
                                          "touched it (live recovery keeps the survivors' processes)"]
    assert check_live_end(LIVE, {**good, "samples_applied_twice": 1}, killed={1})
    assert check_live_end(LIVE, {**good, "samples_applied": samples - 32}, killed={1})
    assert check_live_end(LIVE, {**good, "steps": LIVE.total_steps - 1}, killed={1})
    assert check_live_end(LIVE, None)


def test_the_campaign_counts_arrivals_leaves_and_kills():
    lines = [c.describe() for c in (LiveChange(72, JOIN, 2, 3), LiveChange(101, KILL, 2, 3),
                                    LiveChange(126, LEAVE, 2, 2))]
    result = {"scenario": "ddp-elastic", "seed": 3, "patterns": ["elastic"], "schedule": lines,
              "exit_code": 0, "slowdown": 2.0, "outcome": "finished", "violations": [],
              "sizes": [2, 3, 2, 3, 2]}
    faults = summarize([result], {})["faults"]
    assert faults == {"grow": 1, "planned leave": 1, "kill from outside": 1}


def test_the_scenario_runs_only_when_named_on_a_range():
    line = LIVE.command_line("logs", "ckpt", 3)
    assert line[line.index("--world-size") + 1] == f"{MIN}:{MAX}" and "live" in line
    assert LIVE.train_samples % (LIVE.batch_size * MIN) == 0  # whole global batches every epoch
    assert "ddp-elastic" not in SCENARIOS
