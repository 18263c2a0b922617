"""A live trainer with local updates, in a real gloo group of one process: a change of
group in the middle of a round sends it back to the round's start (model, step, ledger),
and what it would hand a joiner meanwhile is that round-start state; a round that ends
averages, counts its global batches in the ledger and opens the next."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from disttrain.config import Config
from tests.live_steps import live_step

pytestmark = pytest.mark.slow  # every test spawns a process group of live ranks

SYNC_EVERY, BATCH = 4, 16


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def joined_trainer(port: int):
    """A live trainer with local updates, attached to a group of one formed through the
    store at `port`; (trainer, group)."""
    torch.set_num_threads(1)
    from disttrain.strategies.ddp.live.group import LiveGroup, connect
    from disttrain.strategies.ddp.live.membership import Patience
    from disttrain.strategies.ddp.live.trainer import LiveTrainer
    config = Config().replace(training={"model_architecture": "mlp", "dataset": "digits", "batch_size": BATCH,
                                        "sync_every": SYNC_EVERY, "num_epochs": 1},
                              system={"num_workers": 1})
    trainer = LiveTrainer(config, 0)
    group = LiveGroup(connect("127.0.0.1", port, 30.0), 0, Patience(1.0, 5.0, 30.0))
    group.form(0, (0,))
    trainer.attach(0, 1)
    return trainer, group


def member(port: int, out_dir: str) -> None:
    trainer, group = joined_trainer(port)
    start = flat(trainer.module)
    record: dict = {}
    for _ in range(2):  # half a round
        live_step(trainer)
    record["moved"] = not torch.equal(flat(trainer.module), start)
    handed = trainer.state_dict()
    record["handed_step"] = handed["progress"]["step"]
    record["handed_is_start"] = torch.equal(
        torch.cat([t.reshape(-1) for t in handed["model"].values()]), start)
    trainer.detach()  # the group changed mid-round
    record["back_at_start"] = torch.equal(flat(trainer.module), start)
    record["step_after"] = trainer.progress.step
    record["redone"] = trainer.samples_redone
    record["ledger_after"] = int(trainer.ledger.sum())
    trainer.attach(0, 1)
    for _ in range(SYNC_EVERY):  # a whole round
        live_step(trainer)
    record["ledger_round"] = trainer.ledger[0, :SYNC_EVERY + 1].tolist()
    record["rounds"] = trainer.state_dict()["outer"]["rounds"]
    record["between_rounds"] = trainer.at_round_boundary
    dist.barrier()
    group.leave()
    (Path(out_dir) / "member.json").write_text(json.dumps(record))
    os._exit(0)


def run_member(target, tmp_path: Path) -> dict:
    """Run `target` (a member function) in its own process beside a store; its record."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    process = mp.get_context("forkserver").Process(target=target, args=(store.port, str(tmp_path)))
    process.start()
    process.join(timeout=100)
    assert process.exitcode == 0
    return json.loads((tmp_path / "member.json").read_text())


@pytest.mark.timeout(120)
def test_a_change_of_group_mid_round_goes_back_to_the_rounds_start(tmp_path):
    record = run_member(member, tmp_path)
    assert record["moved"]  # half a round trained this member's own model
    assert record["handed_step"] == 0 and record["handed_is_start"]  # a joiner would get the start
    assert record["back_at_start"] and record["step_after"] == 0
    assert record["redone"] == 2 * BATCH and record["ledger_after"] == 0
    assert record["ledger_round"] == [1] * SYNC_EVERY + [0]
    assert record["rounds"] == 1 and record["between_rounds"]


def member_cut_after_outer_step(port: int, out_dir: str) -> None:
    """The round's exchange fails after its outer step (in the buffers' broadcast, as when a
    peer dies between the all-reduce and it): going back to the round's start must take
    the outer state back too, or the next round's pseudo-gradient is taken from a start
    the model never held."""
    from disttrain.strategies.ddp import local_updates
    trainer, group = joined_trainer(port)
    start = flat(trainer.module)
    broadcast = local_updates.broadcast_module

    def cut(module, parameters=True):
        raise RuntimeError("a peer was lost in the broadcast")

    for _ in range(SYNC_EVERY - 1):
        live_step(trainer)
    local_updates.broadcast_module = cut
    record: dict = {}
    try:
        live_step(trainer)
    except RuntimeError:
        record["cut"] = True
    local_updates.broadcast_module = broadcast
    record["outer_moved"] = trainer.rounds.outer.rounds == 1  # the outer step was taken
    trainer.detach()
    outer = trainer.rounds.outer.state_dict()
    record["back_at_start"] = torch.equal(flat(trainer.module), start)
    record["outer_back"] = outer["rounds"] == 0 and torch.equal(outer["round_start"], start)
    handed = trainer.state_dict()
    record["handed_outer_back"] = (handed["outer"]["rounds"] == 0
                                   and torch.equal(handed["outer"]["round_start"], start))
    trainer.attach(0, 1)
    for _ in range(SYNC_EVERY):  # the round again, whole
        live_step(trainer)
    record["rounds"] = trainer.rounds.outer.rounds
    record["model_is_outer_start"] = torch.equal(flat(trainer.module),
                                                 trainer.rounds.outer.state_dict()["round_start"])
    record["ledger_round"] = trainer.ledger[0, :SYNC_EVERY + 1].tolist()
    dist.barrier()
    group.leave()
    (Path(out_dir) / "member.json").write_text(json.dumps(record))
    os._exit(0)


@pytest.mark.timeout(120)
def test_an_exchange_cut_after_its_outer_step_goes_back_with_the_outer_state(tmp_path):
    record = run_member(member_cut_after_outer_step, tmp_path)
    assert record["cut"] and record["outer_moved"]
    assert record["back_at_start"] and record["outer_back"] and record["handed_outer_back"]
    assert record["rounds"] == 1 and record["model_is_outer_start"]
    assert record["ledger_round"] == [1] * SYNC_EVERY + [0]
