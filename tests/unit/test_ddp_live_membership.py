"""The pure rules of DDP live recovery: when survivors have settled, who the next
generation is, how a global batch splits, whose state everyone takes; the state codec
that hands it over without pickle; and the launcher's recovery times."""

from __future__ import annotations

import pytest
import torch

from disttrain.config import Config
from disttrain.strategies.ddp.live.launcher import live_problems, recovery_times
from disttrain.strategies.ddp.live.membership import (
    Holding,
    Patience,
    choose_source,
    format_members,
    group_rank,
    next_members,
    parse_members,
    settled,
    split_batch,
)
from disttrain.strategies.ddp.live.state import buffer_size, flatten, unflatten


def test_members_round_trip_sorted_and_unique():
    assert format_members([2, 0, 2]) == "0,2"
    assert parse_members("2,0") == (0, 2)
    assert parse_members(format_members((0, 1, 3))) == (0, 1, 3)


def test_not_settled_while_a_live_member_has_not_proposed():
    seen = {0: 10.0, 1: 10.0, 2: 10.0}
    # Slot 1 beat 0.5 s ago and has not proposed: wait for it.
    assert not settled(10.5, 10.0, (0, 1, 2), {0, 2}, seen, Patience(1.0, 4.0, 5.0))


def test_settled_once_every_member_proposed():
    seen = {0: 10.0, 1: 10.0, 2: 10.0}
    assert settled(10.1, 10.0, (0, 1, 2), {0, 1, 2}, seen, Patience(1.0, 4.0, 5.0))


def test_settled_when_the_silent_member_goes_stale():
    seen = {0: 11.0, 1: 10.0, 2: 11.0}  # slot 1 stopped beating at 10.0
    assert not settled(10.9, 10.5, (0, 1, 2), {0, 2}, seen, Patience(1.0, 4.0, 5.0))
    assert settled(11.0, 10.5, (0, 1, 2), {0, 2}, seen, Patience(1.0, 4.0, 5.0))


def test_settled_after_the_window_even_with_a_live_straggler():
    seen = {0: 14.4, 1: 14.4, 2: 14.4}
    assert not settled(14.4, 10.5, (0, 1, 2), {0, 2}, seen, Patience(1.0, 4.0, 5.0))
    assert settled(14.5, 10.5, (0, 1, 2), {0, 2}, seen, Patience(1.0, 4.0, 5.0))


def test_a_member_never_seen_counts_as_silent():
    assert settled(10.0, 10.0, (0, 1), {0}, {0: 10.0}, Patience(1.0, 4.0, 5.0))


def test_next_members_keeps_proposers_of_the_previous_generation_and_adds_joiners():
    assert next_members((0, 1, 2), {0, 2}) == (0, 2)
    assert next_members((0, 2), {0, 2}, joiners=[1]) == (0, 1, 2)
    assert next_members((0, 2), {0, 2, 5}) == (0, 2)  # a stranger's proposal does not count
    with pytest.raises(ValueError, match="no member"):
        next_members((0, 1), set())


def test_group_rank_is_the_place_among_sorted_members():
    assert [group_rank((0, 2, 3), slot) for slot in (0, 2, 3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="slot 1"):
        group_rank((0, 2), 1)


@pytest.mark.parametrize("global_batch, ranks, expected", [
    (48, 3, (16, 16, 16)), (48, 2, (24, 24)), (10, 3, (4, 3, 3)), (3, 3, (1, 1, 1))])
def test_split_batch_covers_the_global_batch_evenly(global_batch, ranks, expected):
    shares = split_batch(global_batch, ranks)
    assert shares == expected and sum(shares) == global_batch


def test_split_batch_refuses_more_ranks_than_samples():
    with pytest.raises(ValueError):
        split_batch(2, 3)


def test_source_is_the_furthest_holder_and_never_a_joiner():
    # Rank 1 finished the failed step's all-reduce and applied it; rank 0 did not.
    assert choose_source([Holding(True, 9), Holding(True, 10), Holding(False)]) == 1
    # A joiner at rank 0 (slot 0 restarted) gives nothing; the lowest furthest holder does.
    assert choose_source([Holding(False), Holding(True, 7), Holding(True, 7)]) == 1
    # Same step, one evaluation further (the epoch-end evaluation finished there).
    assert choose_source([Holding(True, 14, 0), Holding(True, 14, 1)]) == 1
    # Nobody holds state (every holder died): the group's leader reads the checkpoint.
    assert choose_source([Holding(False), Holding(False)]) is None


def test_state_round_trips_through_manifest_and_bytes():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "ledger": torch.tensor([[1, 0], [2, 1]], dtype=torch.int32),
             "half": torch.randn(5).to(torch.bfloat16), "empty": torch.zeros(0), "flag": torch.tensor(True),
             "progress": {"epoch": 1, "evaluations": [[1.5, 0.9, 0.2]], "members": (0, 2), "none": None}}
    manifest, buffer = flatten(state)
    assert buffer.dtype == torch.uint8 and buffer.numel() == buffer_size(manifest)
    back = unflatten(manifest, buffer.clone())
    assert back["progress"] == {"epoch": 1, "evaluations": [[1.5, 0.9, 0.2]], "members": [0, 2],
                                "none": None}
    for key in ("ledger", "half", "empty", "flag"):
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key])
    assert set(back["optimizer"]["state"]) == {0, 1}  # integer keys stay integers
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())
    fresh.load_state_dict(back["optimizer"])
    restored, original = fresh.state_dict()["state"][0], optimizer.state_dict()["state"][0]
    assert torch.equal(restored["exp_avg"], original["exp_avg"])


def test_state_refuses_what_json_cannot_carry():
    with pytest.raises(TypeError, match="set"):
        flatten({"members": {1, 2}})


def test_recovery_times_from_deaths_and_restarts():
    deaths = [(100.0, 1)]
    started = {0: [90.0], 1: [90.0, 101.0], 2: [90.0]}
    shrink = recovery_times({"kind": "shrink", "members": [0, 2], "failed_at": 100.2, "resumed_at": 101.0},
                            deaths, started)
    assert shrink["detect_s"] == pytest.approx(0.2) and shrink["reform_s"] == pytest.approx(0.8)
    assert shrink["resume_s"] == pytest.approx(1.0)
    grow = recovery_times({"kind": "grow", "members": [0, 1, 2], "failed_at": 106.0, "resumed_at": 106.5},
                          deaths, started)
    assert grow["rejoin_s"] == pytest.approx(5.5) and grow["reform_s"] == pytest.approx(0.5)
    # Survivors that noticed before the launcher saw the exit: detected at once.
    early = recovery_times({"kind": "shrink", "members": [0, 2], "failed_at": 99.9, "resumed_at": 101.0},
                           deaths, started)
    assert early["detect_s"] == 0.0


def test_live_problems_name_each_setting_live_recovery_does_not_offer():
    assert live_problems(Config()) == []
    # Offered: compression (PowerSGD too), gradient accumulation, loader workers, bf16, --resume,
    # local updates.
    for scheme in ("topk", "powersgd"):
        offered = Config().replace(compression={"enabled": True, "type": scheme},
                                   ddp={"grad_accumulation_steps": 2},
                                   training={"loader_workers": 2, "precision": "bf16", "sync_every": 4})
        assert live_problems(offered) == []
    assert live_problems(Config().replace(ddp={"lr_scaling": "linear"})) == []
    for balance in ("proportional", "auto"):
        assert live_problems(Config().replace(system={"balance": balance})) == []
    config = Config().replace(training={"sync_every": 4, "precision": "fp16"}, ddp={"backend": "nccl"},
                              system={"balance": "proportional", "balance_batches": "24,8"})
    problems = live_problems(config)
    assert len(problems) == 4
    assert any(p.startswith("system.balance_batches: a fixed plan") for p in problems)
    assert any(p.startswith("training.precision: fp16") and "bf16" in p for p in problems)
    assert any(p.startswith("system.balance with local updates") for p in problems)
    assert all("ddp.recovery restart" in p for p in problems)


def test_config_checks_the_recovery_key():
    from disttrain.config.loading import config_from_dict
    from disttrain.core.errors import ConfigError
    assert config_from_dict({}).ddp.recovery == "restart"
    assert config_from_dict({"ddp": {"recovery": "live"}}).ddp.recovery == "live"
    with pytest.raises(ConfigError, match="ddp.recovery"):
        config_from_dict({"ddp": {"recovery": "sometimes"}})
    several = config_from_dict({"ddp": {"recovery": "live", "num_nodes": 2, "rdzv_endpoint": "node0:29400"}})
    assert several.ddp.num_nodes == 2  # several nodes meet at the endpoint's live store
    with pytest.raises(ConfigError, match="ddp.rdzv_endpoint: ddp.num_nodes is 2"):
        config_from_dict({"ddp": {"recovery": "live", "num_nodes": 2}})


def test_the_node_with_the_endpoints_address_hosts_the_live_store():
    from disttrain.strategies.ddp.live.launcher import local_address
    assert local_address("127.0.0.1") == "127.0.0.1" and local_address("localhost") in ("127.0.0.1", "::1")
    assert local_address("198.51.100.250") is None  # TEST-NET-2: no machine's own address
    assert local_address("no-such-host.invalid") is None


def test_the_live_store_listens_on_its_address_alone():
    """torch's store listens on every interface; the live store only where it is meant to
    be reached (loopback on one node)."""
    import subprocess
    from datetime import timedelta

    from disttrain.strategies.ddp.live.launcher import hosted_store
    store = hosted_store("127.0.0.1", 0, timedelta(seconds=5))
    listening = [line.split()[3] for line in subprocess.run(["ss", "-ltnH"], capture_output=True, text=True,
                                                             check=True).stdout.splitlines()]
    assert [a for a in listening if a.endswith(f":{store.port}")] == [f"127.0.0.1:{store.port}"]
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_summary_lines_tell_each_live_recovery():
    from disttrain.metrics.summary import Outcome, RunSummary, Work
    summary = RunSummary.create(
        "ddp", Config(), Outcome(0.9, 0.3),
        Work(samples_processed=96, steps=2, world_size=3, total_time_s=10.0, train_time_s=8.0),
        extra={"samples_applied": 96, "samples_redone": 16, "samples_lost": 0, "live_recoveries": [
            {"kind": "shrink", "members": [0, 2], "step": 10, "resume_s": 0.17},
            {"kind": "grow", "members": [0, 1, 2], "step": 134, "rejoin_s": 12.5}]})
    lines = summary.lines()
    assert "Data: 96 samples applied, 16 redone, 0 lost" in lines
    assert "Live recovery: ranks 0,2 training again 0.17s after the death (step 10)" in lines
    assert "Live recovery: ranks 0,1,2 together again 12.50s after its restart (step 134)" in lines
