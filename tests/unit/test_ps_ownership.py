"""Which blocks and epochs a worker may push (`server.ownership`), as pure rules."""

import pytest

from disttrain.strategies.ps.server.decisions import Push
from disttrain.strategies.ps.server.ownership import BlockLayout, InvalidBlock, NotReassigned

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
