"""The overlapped push's trigger on a real model: each shard launches once, as soon as
backward has produced its whole gradient, the last layers' shard first, and tells how much
of each shard's end is written before that; what a streamed push waits for (`Written`);
and the split of communication time into the part in flight while backward computed."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from disttrain.strategies.ps.wire.sharding import flat_parameters, plan_shards
from disttrain.strategies.ps.worker.overlap import (
    PushAbandoned,
    ShardTrigger,
    Written,
    overlapped_s,
    shards_of_parameters,
)

pytestmark = pytest.mark.timeout(30)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def backward(net: nn.Module, grads: torch.Tensor) -> None:
    grads.zero_()
    net(torch.randn(4, 6)).sum().backward()


def test_each_shard_launches_once_backward_produced_it_last_layers_first():
    net = model()
    _, grads = flat_parameters(net)
    plans = plan_shards(net, 3)
    trigger = ShardTrigger(net, plans)
    seen: list[tuple[int, int]] = []  # (shard, gradients of the first layer's weight produced then)
    first = net[0].weight

    def launch(shard: int) -> None:
        plan = plans[shard]
        # the shard's whole gradient is in place when it launches
        assert grads[plan.offset:plan.offset + plan.numel].abs().sum() > 0
        seen.append((shard, int(first.grad.abs().sum() > 0)))

    trigger.arm(launch)
    backward(net, grads)
    assert trigger.disarm() == []
    assert [s for s, _ in seen] == [2, 1, 0]
    # the last layers' shard went out before backward reached the first layer
    assert seen[0][1] == 0 and seen[-1][1] == 1


def test_a_disarmed_trigger_launches_nothing_and_a_split_tensor_waits_for_both_parts():
    net = model()
    _, grads = flat_parameters(net)
    plans = plan_shards(net, 2)
    shards = shards_of_parameters(net, plans)
    assert any(len(s) == 2 for s in shards)  # 2 shards cut one tensor in two
    trigger = ShardTrigger(net, plans)
    launched: list[int] = []
    backward(net, grads)  # not armed: the hooks do nothing
    trigger.arm(launched.append)
    backward(net, grads)
    trigger.disarm()
    backward(net, grads)
    assert launched == [1, 0]


def test_shards_of_parameters_no_backward_took_are_left_to_launch_after_it():
    net = model()
    _, grads = flat_parameters(net)
    plans = plan_shards(net, 2)
    trigger = ShardTrigger(net, plans)
    launched: list[int] = []
    trigger.arm(launched.append)
    grads.zero_()
    net[4](torch.randn(4, 8)).sum().backward()  # only the last layer takes a gradient
    assert launched == []  # shard 1 also holds part of the middle layer, which took none
    assert trigger.disarm() == [1, 0]


def test_overlapped_time_is_the_union_in_flight_before_backward_ended():
    assert overlapped_s([], 5.0) == 0.0
    assert overlapped_s([(1.0, 3.0), (2.0, 4.0)], 5.0) == pytest.approx(3.0)  # overlaps counted once
    assert overlapped_s([(1.0, 3.0), (4.0, 7.0)], 5.0) == pytest.approx(3.0)  # cut at the end of backward
    assert overlapped_s([(6.0, 7.0)], 5.0) == 0.0  # launched after backward: all blocked


def test_progress_tells_each_shards_written_end_growing_before_it_launches():
    net = model()
    _, grads = flat_parameters(net)
    plans = plan_shards(net, 2)
    trigger = ShardTrigger(net, plans)
    events: list[tuple[str, int, int]] = []

    def progress(shard: int, start: int) -> None:
        plan = plans[shard]
        # every element from `start` to the shard's end is written, and the one before is not yet
        assert grads[plan.offset + start:plan.offset + plan.numel].abs().sum() > 0
        events.append(("progress", shard, start))

    trigger.arm(lambda shard: events.append(("launch", shard, 0)), progress)
    backward(net, grads)
    assert trigger.disarm() == []
    for shard in range(2):
        mine = [(kind, start) for kind, s, start in events if s == shard]
        starts = [start for kind, start in mine if kind == "progress"]
        assert starts == sorted(set(starts), reverse=True) and starts[-1] == 0  # only ever growing
        assert mine[-1] == ("launch", 0) and [kind for kind, _ in mine].count("launch") == 1
    # shard 1's end (the last layer) was written, and told, before anything of shard 0
    kind, shard, start = events[0]
    assert (kind, shard) == ("progress", 1) and start > 0


def test_a_written_push_goes_piece_by_piece_and_its_first_piece_only_once_released():
    written = Written(100)
    ready = written.attempt()
    assert not written.released
    written.advance(60)
    assert ready(60) and ready(80)  # written from 60 on
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(ready(0)))
    waiter.start()
    written.advance(0)  # every byte written, but the whole not yet checked
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and results == []
    written.release()
    waiter.join(timeout=10)
    assert results == [True] and written.released


def test_an_aborted_push_cancels_its_call_before_its_frames_end_and_refuses_attempts():
    written = Written(100)
    ready = written.attempt()
    cancelled = threading.Event()
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(ready(0)))
    waiter.start()
    written.abort(PushAbandoned("backward failed"))
    # no call to cancel yet: the frames wait rather than end (an ended stream is a whole push)
    waiter.join(timeout=0.2)
    assert waiter.is_alive()
    written.on_abort(cancelled.set)
    waiter.join(timeout=10)
    assert cancelled.is_set() and results == [False]
    with pytest.raises(PushAbandoned):
        written.attempt()


def test_an_earlier_attempts_frames_end_once_a_new_attempt_began():
    written = Written(100)
    first = written.attempt()
    second = written.attempt()
    assert first(50) is False  # that call failed already: its frames end
    written.release()
    assert second(0) is True
