"""Generated schedules with preemptions, end to end: `disttrain chaos` SIGTERMs a real run
from outside at a drawn step (the launcher, or one worker or rank), resumes it with
`--resume` on the number of workers (ranks) the schedule drew, and checks the invariants
over the whole chain of launches. Each seed below draws a schedule of preemptions alone:

- ps-sync 19: the launcher preempted at step 61, resumed on 2 workers; worker 1 preempted
  at step 79, resumed on 1 (a planned leave): every sample of every epoch applied once
  across the three launches (the shards' ledgers), every shard at the run's last step.
- ps-sync 33: the launcher preempted at step 34, resumed on its own 2 workers: the final
  parameters bit-identical to the fault-free run's.
- ddp-restart 16: rank 0 preempted at step 15, resumed on 4 ranks (a join): the run ends
  at its last step and epoch, every sample counted once.
"""

from __future__ import annotations

import json

import pytest

# scenario, seed -> the workers (ranks) of each launch
CASES = {("ps-sync", 19): [2, 2, 1], ("ps-sync", 33): [2, 2], ("ddp-restart", 16): [2, 4]}
# make test-extended: seed 33 draws one preemption at the same size, as seed 19 does before its resize
EXTENDED = {("ps-sync", 33)}


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("chaos")  # the fault-free references are run once per scenario


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("scenario", "seed"), [
    pytest.param(*case, id=f"{case[0]}-{case[1]}", marks=pytest.mark.extended if case in EXTENDED else ())
    for case in CASES])
def test_a_drawn_schedule_of_preemptions_and_resizes_keeps_every_invariant(
        work_dir, tmp_path, cli, scenario, seed):
    output = tmp_path / "chaos.json"
    result = cli("chaos", "--scenarios", scenario, "--seed", seed, "--schedules", 1, "--work-dir", work_dir,
                 "--output", output, timeout=580)
    campaign = json.loads(output.read_text())
    assert result.returncode == 0, (result.stdout[-3000:], campaign.get("violations"))
    (run,) = campaign["results"]
    assert run["patterns"] == ["preemption"] and run["violations"] == [] and run["outcome"] == "finished"
    sizes = CASES[(scenario, seed)]
    assert [launch["workers"] for launch in run["launches"]] == sizes
    # every launch but the last was preempted and exited 143, with the line naming --resume
    assert [launch["exit_code"] for launch in run["launches"]] == [143] * (len(sizes) - 1) + [0]
    for launch, line in zip(run["launches"], run["schedule"], strict=False):
        assert launch["preempted"].startswith(line.split(",")[0])
        assert "--resume" in launch["last_line"]
    assert len(run["preemptions_sent"]) == len(sizes) - 1
    assert campaign["preemptions"]["launches_stopped"] == len(sizes) - 1
    assert campaign["preemptions"]["runs_resized"] == (len(set(sizes)) > 1)
    for line in run["schedule"]:
        assert line in result.stdout  # printed, so the schedule reproduces from its seed
