"""Which blocks and epochs a worker may push (`server.ledger`), as pure rules, and the
run's layout a real shard computes from its config (`run.layout`), generated against the
workers' own block numbering (their samplers, balance plans and local-update rounds)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.config import config_from_dict
from disttrain.core.errors import ConfigError
from disttrain.data import PlannedSampler, ShardedSampler, load_datasets
from disttrain.strategies.ps.run.layout import run_layout, train_length
from disttrain.strategies.ps.server.aggregation import AggregationRules, Outcome
from disttrain.strategies.ps.server.decisions import Push
from disttrain.strategies.ps.server.ledger import BlockLayout, InvalidBlock, NotReassigned
from disttrain.strategies.ps.worker.blocks import block_id

LAYOUT = BlockLayout(world_size=3, num_epochs=2, batches_per_epoch=5)  # rank 1, epoch 1: blocks 20..24


def push(block, epoch=1, redo=False, last_in_epoch=False):
    return Push("w1", 1, 0, 8.0, block=block, epoch=epoch, redo=redo, last_in_epoch=last_in_epoch)


@pytest.mark.parametrize("block", [-1, 20, 24])
def test_a_workers_own_blocks_pass(block):
    LAYOUT.check(1, push(block))


@pytest.mark.parametrize("block, epoch", [(19, 1), (25, 1), (10, 0), (20, 0), (-2, 1)])
def test_blocks_of_other_ranks_or_epochs_are_refused(block, epoch):
    with pytest.raises(InvalidBlock):
        LAYOUT.check(1, push(block, epoch))


@pytest.mark.parametrize("epoch", [-1, 2, 10 ** 12])
def test_epochs_outside_the_run_are_refused_with_or_without_a_block(epoch):
    with pytest.raises(InvalidBlock, match="epoch"):
        LAYOUT.check(1, push(-1, epoch, last_in_epoch=True))


def test_redo_needs_a_block_of_its_own_or_of_a_reassigned_rank():
    LAYOUT.check(1, push(7, epoch=0, redo=True))  # its own block of epoch 0
    with pytest.raises(InvalidBlock):
        LAYOUT.check(1, push(-1, redo=True))
    with pytest.raises(NotReassigned):
        LAYOUT.check(1, push(12, epoch=0, redo=True))  # rank 2's
    LAYOUT.check(1, push(12, epoch=0, redo=True), reassigned={2})
    with pytest.raises(InvalidBlock, match="past the run"):
        LAYOUT.check(1, push(30, epoch=1, redo=True), reassigned={0, 2})  # epoch 2's


def test_without_the_batches_per_epoch_only_the_lower_bound_holds():
    layout = BlockLayout(world_size=3, num_epochs=2)
    layout.check(1, push(4))  # 1 * 3 + 1 = 4: the least block rank 1 may have in epoch 1
    with pytest.raises(InvalidBlock):
        layout.check(1, push(3))


# -- the run's layout, as a real shard computes it, against the workers' own numbering ------

def workers_blocks(num_samples, batch_size, world_size, num_epochs, shares, round_length):
    """Each worker's pushes of the run, as `WorkerParticipant.step` numbers them: (rank,
    block, epoch, last_in_epoch), from the sampler the worker builds (`start_balance`:
    `PlannedSampler` under a balance plan of `shares`, else `ShardedSampler`), a push per
    batch, or per round of `round_length` batches (local updates: rounds end after that
    many steps or at the epoch's end, counted as `OuterOptimizer.end_of_step` does)."""
    pushes = []
    for rank in range(world_size):
        if shares is None:
            sampler = ShardedSampler(num_samples, world_size=world_size, rank=rank, seed=3)
        else:
            sampler = PlannedSampler(num_samples, world_size=world_size, rank=rank, seed=3, shares=shares)
        bpe = sampler.num_batches(batch_size)
        for epoch in range(num_epochs):
            sampler.set_epoch(epoch)
            steps_in_round = 0
            for index, _ in enumerate(sampler.batches(batch_size)):
                steps_in_round += 1
                last = index == bpe - 1
                if steps_in_round >= round_length or last:
                    steps_in_round = 0
                    pushes.append((rank, block_id(epoch, rank, index, world_size, bpe), epoch, last))
    return pushes


@st.composite
def runs(draw):
    world_size = draw(st.integers(1, 5))
    batch_size = draw(st.integers(1, 9))
    balanced = draw(st.booleans())
    least = batch_size * world_size if balanced else world_size
    num_samples = draw(st.integers(least, least + 80))
    shares = None
    if balanced:  # any split of the global batch: the layout does not depend on it
        cuts = [] if world_size == 1 else sorted(draw(st.lists(
            st.integers(1, batch_size * world_size - 1), min_size=world_size - 1, max_size=world_size - 1,
            unique=True)))
        bounds = [0, *cuts, batch_size * world_size]
        shares = tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    round_length = 1 if balanced else draw(st.sampled_from([1, 1, 2, 3, 7]))  # local updates: no balance
    return num_samples, batch_size, world_size, draw(st.integers(1, 3)), shares, round_length


def layout_of(run) -> BlockLayout:
    """The layout a shard computes for a drawn run."""
    num_samples, batch_size, world_size, num_epochs, shares, round_length = run
    return BlockLayout.of_run(world_size, num_epochs, num_samples, batch_size, shares is not None,
                              round_length)


@settings(max_examples=150, deadline=None)
@given(runs())
def test_the_shards_layout_is_the_workers_block_numbering(run):
    num_samples, batch_size, world_size, num_epochs, shares, round_length = run
    layout = layout_of(run)
    pushes = workers_blocks(num_samples, batch_size, world_size, num_epochs, shares, round_length)
    # every block a worker pushes is in the plan, and the plan holds nothing else
    assert sorted(block for _, block, _, _ in pushes) == layout.blocks()
    for rank, block, epoch, last in pushes:
        assert layout.place(block)[:2] == (epoch, rank)
        layout.check(rank, Push(f"w{rank}", 1, 0, 1.0, block=block, epoch=epoch, last_in_epoch=last))
        layout.check(rank, Push(f"w{rank}", 1, 0, 1.0, block=block, epoch=epoch, redo=True))  # its redo
        for other in set(range(world_size)) - {rank}:  # nobody else's, by push or by redo
            with pytest.raises(InvalidBlock, match="its own blocks"):
                layout.check(other, Push(f"w{other}", 1, 0, 1.0, block=block, epoch=epoch))
            with pytest.raises(NotReassigned):
                layout.check(other, Push(f"w{other}", 1, 0, 1.0, block=block, epoch=epoch, redo=True))
            # a survivor takes the block of a worker the coordinator reassigned
            layout.check(other, Push(f"w{other}", 1, 0, 1.0, block=block, epoch=epoch, redo=True),
                         reassigned={rank})
    # no block past the plan, by anyone, even reassigned
    past = world_size * num_epochs * layout.batches_per_epoch
    for rank in range(world_size):
        for block in (past, past + 1, 10 ** 12):
            with pytest.raises(InvalidBlock, match="past the run"):
                layout.check(rank, Push("w", 1, 0, 1.0, block=block, epoch=num_epochs - 1, redo=True),
                             reassigned=set(range(world_size)))


@settings(max_examples=60, deadline=None)
@given(runs())
def test_with_local_updates_a_batch_within_a_round_is_no_block_of_the_plan(run):
    num_samples, batch_size, world_size, num_epochs, shares, round_length = run
    layout = layout_of(run)
    held = set(layout.blocks())
    for block in range(world_size * num_epochs * layout.batches_per_epoch):
        if block in held:
            continue
        epoch, rank, _ = layout.place(block)
        for redo in (False, True):
            with pytest.raises(InvalidBlock, match="ends no round"):
                layout.check(rank, Push("w", 1, 0, 1.0, block=block, epoch=epoch, redo=redo))


def test_a_push_ends_its_epoch_only_with_the_epochs_last_block():
    with pytest.raises(InvalidBlock, match="not its last"):
        LAYOUT.check(1, push(22, last_in_epoch=True))
    LAYOUT.check(1, push(24, last_in_epoch=True))


def test_a_redo_names_a_block_of_its_own_epoch():
    with pytest.raises(InvalidBlock, match="not of the push's epoch"):
        LAYOUT.check(1, push(7, epoch=1, redo=True))  # rank 1's of epoch 0


@pytest.mark.parametrize("dataset, limit", [("digits", None), ("digits", 100), ("digits", 10 ** 6),
                                            ("synthetic", None), ("synthetic", 50), ("synthetic:1x4x4", 60)])
def test_the_layout_reads_the_training_set_length_the_workers_sample(dataset, limit):
    config = config_from_dict({"training": {"dataset": dataset, "num_samples": 200, "batch_size": 16,
                                            "max_train_samples": limit, "num_epochs": 2},
                               "system": {"num_workers": 3}})
    length = len(load_datasets(config.training)[0])
    assert train_length(config) == length
    sampler = ShardedSampler(length, world_size=3, rank=2)
    assert run_layout(config) == BlockLayout(3, 2, sampler.num_batches(16), 1)
    local = run_layout(config.replace(training={"sync_every": 4}))
    assert local.round_length == 4 and local.batches_per_epoch == sampler.num_batches(16)
    balanced = run_layout(config.replace(system={"balance": "proportional"}))
    assert balanced.batches_per_epoch == length // 48


def test_a_training_set_that_makes_no_batch_per_worker_is_a_config_error():
    config = config_from_dict({"training": {"dataset": "digits", "max_train_samples": 40, "batch_size": 16},
                               "system": {"num_workers": 4, "balance": "proportional"}})
    with pytest.raises(ConfigError, match=r"40 training samples .* \(at least 64 needed\)"):
        run_layout(config)
    assert run_layout(config.replace(system={"balance": "none"})).batches_per_epoch == 1


@pytest.mark.parametrize("mode", ["sync", "ssp", "async"])
def test_the_rules_take_only_blocks_of_the_plan_and_a_redo_of_a_held_block_is_a_duplicate(mode):
    layout = BlockLayout.of_run(2, 1, 64, 16, balanced=False)  # rank 0: blocks 0-1, rank 1: blocks 2-3
    rules = AggregationRules(mode, 2, staleness_bound=1, layout=layout)
    for rank in range(2):
        assert rules.register(f"w{rank}") == rank
    for block, redo in ((2, False), (4, True), (10 ** 9, True)):  # rank 1's; no block of the plan
        with pytest.raises(InvalidBlock):
            rules.offer(Push("w0", 1, 0, 16.0, block=block, redo=redo), "g", now=0.0)
    assert (rules.version, rules.ledger.blocks, rules.counts["applied"]) == (0, set(), 0)
    for rank in range(2):  # each worker's own first block, one step
        rules.offer(Push(f"w{rank}", 1, 0, 16.0, block=2 * rank), f"g{rank}", now=1.0)
    assert rules.ledger.blocks == {0, 2} and rules.version in (1, 2)
    version = rules.version
    for block in (0, 2):  # its own again; rank 1's, once the coordinator reassigned rank 1
        if block == 2:
            rules.set_membership(1, {"w0": 0}, now=2.0, away=frozenset({"w1"}))
            assert rules.roster.reassigned == {1}
        decision = rules.offer(Push("w0", 2, version, 16.0, block=block, redo=True), "again", now=2.0)
        assert decision.outcome is Outcome.DUPLICATE and decision.apply == []
    assert rules.version == version and rules.ledger.blocks == {0, 2}


@pytest.mark.parametrize("dataset, limit, length", [("mnist", None, 60_000), ("fashion_mnist", 512, 512),
                                                    ("cifar10", None, 50_000)])
def test_a_public_sets_length_is_its_published_size_read_from_nothing(tmp_path, dataset, limit, length):
    """A shard of a run on a built-in public set needs no copy of it on its host."""
    config = config_from_dict({"training": {"dataset": dataset, "data_dir": str(tmp_path / "absent"),
                                            "download": False, "max_train_samples": limit}})
    assert train_length(config) == length
    assert not (tmp_path / "absent").exists()
