"""The invariants read from what a run left on disk catch what they claim to: a sample lost
or applied twice on a shard, shards whose ledgers or steps disagree, a live ledger with a
hole or a double, a final model that differs by one bit, a stop without its reason or
without the command that continues it."""

from __future__ import annotations

import pytest
import torch

from disttrain.chaos import invariants
from disttrain.chaos.scenarios import scenario
from disttrain.core.atomic_files import atomic_torch_save
from disttrain.core.checkpoint import save_checkpoint

PS = scenario("ps-sync")


def write_shard(folder, shard, samples=PS.total_samples, blocks=range(10), sync_step=PS.total_steps,
                done=(0, 1)):
    rules = {"counts": {"samples": samples}, "done": list(done), "ledger": {"blocks": list(blocks)},
             "sync_step": sync_step}
    save_checkpoint(folder / f"server{shard}", PS.total_steps, {"rules": rules})


def test_shards_that_applied_every_sample_once_pass(tmp_path):
    for shard in range(PS.servers):
        write_shard(tmp_path, shard)
    assert invariants.check_ps_ledgers(PS, tmp_path) == []


@pytest.mark.parametrize(("change", "said"), [
    ({"samples": PS.total_samples - 16}, "samples lost"),
    ({"samples": PS.total_samples + 16}, "samples applied twice"),
    ({"blocks": range(9)}, "the shards' ledgers differ"),
    ({"sync_step": PS.total_steps - 1}, "the shards ended at different steps"),
    ({"done": (0,)}, "workers [0] done of 2"),
])
def test_a_shard_that_broke_exactly_once_is_named(tmp_path, change, said):
    write_shard(tmp_path, 0)
    write_shard(tmp_path, 1, **change)
    (problem,) = invariants.check_ps_ledgers(PS, tmp_path)
    assert said in problem


def test_a_shard_without_a_checkpoint_is_a_violation(tmp_path):
    write_shard(tmp_path, 0)
    (problem,) = invariants.check_ps_ledgers(PS, tmp_path)
    assert problem.startswith("shard 1: no checkpoint")


LIVE = scenario("ddp-live")


@pytest.mark.parametrize(("entry", "said"), [(0, "1 global batch(es) never applied"),
                                             (2, "1 applied more than once"), (1, None)])
def test_the_live_ledger_counts_every_global_batch_once(tmp_path, entry, said):
    ledger = torch.ones(LIVE.epochs, LIVE.steps_per_epoch, dtype=torch.int32)
    ledger[1, 5] = entry
    save_checkpoint(tmp_path, LIVE.total_steps, {"ledger": ledger})
    problems = invariants._live_ledger(LIVE, tmp_path)
    assert (problems == []) if said is None else (said in problems[0])


def test_restart_modes_final_model_must_be_bit_identical(tmp_path):
    restart = scenario("ddp-restart")
    model = {"weight": torch.ones(3), "bias": torch.zeros(2)}
    save_checkpoint(tmp_path, 1, {})  # a registry-free run: only the final model matters here
    reference = {"model": {k: v.clone() for k, v in model.items()}}
    atomic_torch_save({"model": model}, tmp_path / "ddp_final.pt")
    assert invariants.check_ddp(restart, tmp_path, tmp_path, reference) == []
    model["weight"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    atomic_torch_save({"model": model}, tmp_path / "ddp_final.pt")
    (problem,) = invariants.check_ddp(restart, tmp_path, tmp_path, reference)
    assert "differs from the fault-free run's in 1 tensor(s) (weight)" in problem


@pytest.mark.parametrize(("code", "line", "said"), [
    (0, "", None),
    (1, "error: shard 1 cannot write its checkpoints; once it can: disttrain ps ... --resume", None),
    (1, "", "without a last line"),
    (1, "  File \"x.py\", line 3, in f", "with a traceback"),
    (1, "error: worker 0 did not write the run summary", "without the command that continues it"),
])
def test_a_stop_must_say_why_and_how_to_go_on(code, line, said):
    problems = invariants.check_exit(code, line, summary_found=True)
    assert (problems == []) if said is None else (said in problems[0])


def test_accuracy_within_one_point_either_way_of_the_fault_free_runs():
    assert invariants.check_accuracy(0.905, [0.90]) == []
    assert invariants.check_accuracy(0.885, [0.90]) and invariants.check_accuracy(0.915, [0.90])
    assert invariants.check_accuracy(0.925, [0.90, 0.92, 0.91]) == []
    (problem,) = invariants.check_accuracy(0.885, [0.90, 0.92])
    assert "0.9000 to 0.9200" in problem


def test_a_worker_taken_over_that_never_finished_on_the_shards_is_no_violation(tmp_path):
    # chaos ps-reassign seed 8: worker 1, killed, was reassigned and came back after the end
    for shard in range(PS.servers):
        write_shard(tmp_path, shard, done=(0,))
    assert invariants.check_ps_ledgers(PS, tmp_path, reassigned={1}) == []
    (problem,) = invariants.check_ps_ledgers(PS, tmp_path, reassigned={0})[:1]
    assert "workers [0] done of 2" in problem


def test_a_resumed_run_is_checked_against_the_workers_of_its_last_launch_and_the_runs_last_step(tmp_path):
    # a run of 2 workers resumed on 1: shard ledgers say worker 0 alone is done
    for shard in range(PS.servers):
        write_shard(tmp_path, shard, done=(0,))
    assert invariants.check_ps_ledgers(PS, tmp_path, workers=1, end_step=PS.total_steps) == []
    assert "workers [0] done of 2" in invariants.check_ps_ledgers(PS, tmp_path)[0]
    for shard in range(PS.servers):
        write_shard(tmp_path / "short", shard, sync_step=PS.total_steps - 11)
    (problem,) = invariants.check_ps_ledgers(PS, tmp_path / "short", end_step=PS.total_steps)
    assert f"ended at step {PS.total_steps - 11}, not at the run's last, {PS.total_steps}" in problem


def test_a_model_one_bit_off_is_named_with_who_promised_it():
    reference = {"model": {"w": torch.ones(4)}}
    model = {"model": {"w": torch.ones(4)}}
    assert invariants.check_identical(model, reference, "a sync run preempted and resumed") == []
    model["model"]["w"][2] = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    (problem,) = invariants.check_identical(model, reference, "a sync run preempted and resumed")
    assert "in 1 tensor(s) (w); a sync run preempted and resumed promises it bit-identical" in problem


RESTART = scenario("ddp-restart")


def write_ddp_end(folder, step=RESTART.total_steps, epoch=RESTART.epochs, position=0, world_size=4):
    state = {"position": {"epoch": epoch, "step": step}, "sampler": {"epoch": epoch, "position": position},
             "world_size": world_size}
    save_checkpoint(folder, step, state)


ALL = RESTART.epochs * RESTART.train_samples


@pytest.mark.parametrize(("change", "samples", "said"), [
    ({}, ALL, None),
    ({"step": 175, "epoch": RESTART.epochs - 1, "position": 96}, None, "ended at step 175"),
    ({"position": 32}, ALL, "a sampler at position 32"),
    ({"world_size": 2}, ALL, "of 2 ranks, not 0 of 4"),
    ({}, ALL - 32, "processed 5600 samples, not 5632"),
])
def test_a_ddp_run_resumed_on_another_size_must_end_at_the_runs_end_with_every_sample(
        tmp_path, change, samples, said):
    write_ddp_end(tmp_path, **change)
    summary = {"samples_processed": samples} if samples is not None else {}
    problems = invariants.check_ddp_end(RESTART, tmp_path, summary, world_size=4)
    assert (problems == []) if said is None else any(said in p for p in problems), problems
