"""`disttrain ddp --ddp-recovery live` as a user runs it: three ranks on the shipped digits,
one SIGKILLed mid-epoch; the survivors train on in their own processes, the rank is
started again and rejoins, and the ledger shows every global batch applied exactly once;
the accuracy matches an undisturbed run of the same seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain.config import TrainingConfig
from disttrain.data import load_datasets

WORLD_SIZE, BATCH, EPOCHS = 3, 16, 8
# An MLP (no dropout, no BatchNorm): a step's gradient is the same whatever the split of
# its global batch over the ranks, up to float rounding.
ARGS = ["--world-size", WORLD_SIZE, "--ddp-recovery", "live", "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 1, "--timeout-s", 60,
        "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.003",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=1"]


def samples_per_epoch() -> int:
    """The samples of an epoch's whole global batches (the tail is left out)."""
    train_set, _ = load_datasets(TrainingConfig(dataset="digits"))
    global_batch = BATCH * WORLD_SIZE
    return len(train_set) // global_batch * global_batch


def dirs(folder: Path) -> list:
    return ["--log-dir", folder / "logs", "--checkpoint-dir", folder / "ckpt"]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> dict:
    from tests.conftest import run_cli
    folder = tmp_path_factory.mktemp("undisturbed")
    result = run_cli("ddp", *ARGS, *dirs(folder), timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "logs" / "summary.json").read_text())


@pytest.mark.timeout(240)
@pytest.mark.slow  # the shared undisturbed live run: a launcher and three ranks
def test_undisturbed_live_run_applies_every_global_batch_once(undisturbed):
    summary = undisturbed
    assert summary["ddp_recovery"] == "live" and summary["world_size"] == WORLD_SIZE
    assert summary["samples_applied"] == EPOCHS * samples_per_epoch()
    assert (summary["samples_lost"], summary["samples_applied_twice"], summary["samples_redone"]) == (0, 0, 0)
    assert summary["steps"] * BATCH * WORLD_SIZE == summary["samples_applied"]
    assert summary["live_recoveries"] == [] and summary["num_rejoins"] == 0
    assert all(len(pids) == 1 for pids in summary["rank_pids"].values())
    assert summary["final_pids"] == {slot: pids[0] for slot, pids in summary["rank_pids"].items()}
    assert summary["final_accuracy"] > 0.9


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("killed, straggler", [pytest.param(1, 0, marks=pytest.mark.extended), (0, 1)],
                         ids=["rank1", "leader"])
def test_killed_rank_survivors_train_on_and_it_rejoins(cli, tmp_path, undisturbed, killed, straggler):
    # A survivor straggles (each step 10 times as long), so the run lasts well past the
    # time the killed rank's new process takes to start and ask to join. Killing rank 0,
    # the group's leader, the others lead meanwhile, and when it is back it leads again
    # with the state it took from them, and writes the summary.
    result = cli("ddp", *ARGS, *dirs(tmp_path), "--max-restarts", 1, "--inject",
                 f"kill:rank={killed}:step=10", "--inject", f"slow:rank={straggler}:factor=10", timeout=360)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    survivors = [slot for slot in range(WORLD_SIZE) if slot != killed]

    # The survivors were never restarted: one process each, the same one at the end.
    pids, final = summary["rank_pids"], summary["final_pids"]
    for slot in survivors:
        assert len(pids[str(slot)]) == 1 and final[str(slot)] == pids[str(slot)][0]
    # The killed rank was started again, and that process is in the last group.
    assert len(pids[str(killed)]) == 2 and final[str(killed)] == pids[str(killed)][1]

    shrink, *rest = summary["live_recoveries"]
    assert shrink["kind"] == "shrink" and shrink["members"] == survivors
    assert shrink["resume_s"] is not None and shrink["resume_s"] < 10.0
    grows = [r for r in rest if r["kind"] == "grow"]
    assert summary["num_rejoins"] >= 1 and grows[-1]["members"] == [0, 1, 2]
    assert grows[0]["rejoin_s"] is not None and grows[0]["rejoin_s"] > 0

    # Every global batch applied exactly once, the failed step's included.
    assert summary["samples_applied"] == EPOCHS * samples_per_epoch()
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert summary["steps"] == undisturbed["steps"]
    assert abs(summary["final_accuracy"] - undisturbed["final_accuracy"]) <= 0.005
    assert "injected fault: kill at step 10" in (tmp_path / "logs" / f"rank{killed}.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_restarts_the_survivors_finish_the_run_alone(cli, tmp_path, undisturbed):
    result = cli("ddp", *ARGS, *dirs(tmp_path), "--max-restarts", 0, "--inject", "kill:rank=2:step=12",
                 timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["rank_pids"]["2"] and len(summary["rank_pids"]["2"]) == 1  # never started again
    assert set(summary["final_pids"]) == {"0", "1"} and summary["num_rejoins"] == 0
    assert [r["members"] for r in summary["live_recoveries"]] == [[0, 1]]
    assert summary["samples_applied"] == EPOCHS * samples_per_epoch()
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert abs(summary["final_accuracy"] - undisturbed["final_accuracy"]) <= 0.005


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.extended  # the scaling rule is unit-tested; live runs stay in make test
def test_linear_lr_scaling_scales_by_the_runs_world_size(cli, tmp_path, undisturbed):
    """`--lr-scaling linear` at a third of the undisturbed run's rate (3 ranks) trains the
    same model: its test loss is the undisturbed run's (the rates differ in the last bit)."""
    result = cli("ddp", *ARGS, *dirs(tmp_path), "--lr-scaling", "linear",
                 "--set", "training.learning_rate=0.001", timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["final_loss"] == pytest.approx(undisturbed["final_loss"], rel=1e-4)
    assert summary["final_accuracy"] == pytest.approx(undisturbed["final_accuracy"], abs=0.002)


@pytest.mark.slow
@pytest.mark.serial  # the split follows the speeds measured in the run: alone on the machine
@pytest.mark.timeout(400)
def test_balanced_live_run_gives_the_straggler_less_and_replans_after_a_loss(cli, tmp_path, undisturbed):
    """`system.balance proportional`: slot 2 straggles (4 times slower); the speed checks
    give it a smaller piece of each global batch; slot 1 is killed, and the survivors
    split by the speeds they measured (slot 2, now rank 1 of 2, still the smaller piece);
    a rejoined rank, not measured yet, makes the split even until the next check, which
    measures it from its second step and keeps the straggler's piece the smallest. The global
    batches stay the same, so every one is applied once and the model learns as the
    undisturbed run's."""
    result = cli("ddp", *ARGS, *dirs(tmp_path), "--max-restarts", 1, "--set", "system.balance=proportional",
                 "--set", "system.balance_interval=5", "--inject", "slow:rank=2:factor=4",
                 "--inject", "kill:rank=1:step=30", timeout=360)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    plans = summary["balance_plans"]
    global_batch = BATCH * WORLD_SIZE
    assert all(sum(batches) == global_batch for _, _, batches in plans)
    # Before the loss: three pieces, slot 2's the smallest by far.
    first = next(batches for _, _, batches in plans if len(batches) == 3)
    assert first[2] < min(first[0], first[1]) / 2
    # After it: the survivors [0, 2] split by their speeds, slot 2 still the smaller piece.
    shrink = summary["live_recoveries"][0]
    assert shrink["kind"] == "shrink" and shrink["members"] == [0, 2]
    shrunk = next(i for i, (_, _, batches) in enumerate(plans) if len(batches) == 2)
    pair = plans[shrunk][2]
    assert pair[1] < pair[0] / 2
    # Until slot 1 is back, a check may re-plan the pair again (as above). Once rejoined (0.8 s
    # after the loss here, of a run of 30 s), it is measured at the next check (a speed of
    # 0 would stop every re-plan), and measured as a rank at full speed: the straggler keeps
    # the smallest piece by far. Not held: slot 1's piece against slot 0's. Equal ranks
    # measured over 5 steps of a few milliseconds, 3 of them on 2 cores, differ by 2x (29
    # against 17 before the loss; 32 against 15 on a CI run), and a first step measured
    # too would move slot 1's piece less than that.
    assert summary["live_recoveries"][1]["kind"] == "grow"
    later = [batches for _, _, batches in plans[shrunk + 1:]]
    assert any(len(batches) == 3 for batches in later), plans
    for batches in later:
        if len(batches) == 2:
            assert batches[1] < batches[0] / 2
        else:
            assert batches[2] < min(batches[0], batches[1]) / 2
    assert summary["samples_applied"] == EPOCHS * samples_per_epoch()
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert summary["steps"] == undisturbed["steps"]
    assert abs(summary["final_accuracy"] - undisturbed["final_accuracy"]) <= 0.005


@pytest.mark.slow  # each a process of the command line
@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, message", [
    (["--precision", "fp16"], "training.precision: fp16"),
    (["--set", "training.sync_every=4", "--set", "system.balance=auto"], "system.balance with local updates"),
    (["--set", "system.balance=proportional", "--set", "system.balance_batches=24,16,8"],
     "system.balance_batches: a fixed plan"),
])
def test_settings_live_recovery_does_not_offer_are_refused_at_once(cli, tmp_path, extra, message):
    result = cli("ddp", *ARGS, *dirs(tmp_path), *extra, timeout=100)
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr
    assert not (tmp_path / "logs" / "rank0.log").exists()  # nothing was started
