"""Streaming DiLoCo without processes: fragments balanced by bytes, the staggered schedule
(each fragment once per H steps, never two at one step but at an epoch's end), one
fragment equal to plain local updates bit for bit, a fragment's outer step touching its
own tensors only, mixing, the state mid-round, quantized pseudo-gradients with error
feedback, and the config's one-line refusals. Fragments cut inside tensors where a
layer is larger than a fragment's share. A delay tau: the outer result of the
pseudo-gradient sent at step s lands after step s + tau, mixed with the parameters of
then, on the same schedule; a state taken with exchanges in flight resumes bit-identical.
On a parameter-server worker the delayed push runs on its own thread and buffers, and its
pulled result lands tau steps later, mixed."""

from __future__ import annotations

import copy

import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.core.errors import ConfigError
from disttrain.strategies.ddp.runtime import check_supported
from disttrain.strategies.ps.run.launcher import check_supported as check_ps_supported
from disttrain.strategies.ps.wire.sharding import flat_parameters
from disttrain.strategies.ps.worker.local_rounds import WorkerRounds
from disttrain.training.fragments import Piece, StreamingRounds, done, outer_compressor, split_fragments
from disttrain.training.local_updates import LocalUpdates, OuterOptimizer

NESTEROV = LocalUpdates(4, "nesterov", 0.7, 0.9)


def model_params(seed: int = 0) -> list[torch.Tensor]:
    """Six tensors of unequal sizes (16, 4, 32, 8, 64, 2 values)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for shape in [(4, 4), (4,), (8, 4), (8,), (8, 8), (2,)]]


def test_fragments_are_equal_shares_in_order_whole_layers_where_a_boundary_is_near():
    sizes = [16, 4, 32, 8, 64, 2]  # 126 values: a share of 63 for two, 42 for three
    # The cut at 63 moves to the boundary at 60 (within 10% of a share): whole tensors.
    assert split_fragments(sizes, 2) == [[Piece(0, 0, 16), Piece(1, 0, 4), Piece(2, 0, 32), Piece(3, 0, 8)],
                                         [Piece(4, 0, 64), Piece(5, 0, 2)]]
    # No boundary near 42 or 84: the cuts fall inside the third and the fifth tensors.
    assert split_fragments(sizes, 3) == [[Piece(0, 0, 16), Piece(1, 0, 4), Piece(2, 0, 22)],
                                         [Piece(2, 22, 32), Piece(3, 0, 8), Piece(4, 0, 24)],
                                         [Piece(4, 24, 64), Piece(5, 0, 2)]]
    # One large tensor (SimpleCNN's first linear layer holds 95% of its values) is shared out.
    fragments = split_fragments([288, 32, 18432, 64, 1605632, 128, 1280, 10], 4)
    totals = [sum(p.stop - p.start for p in pieces) for pieces in fragments]
    assert sum(totals) == 1625866 and max(totals) - min(totals) <= 0.2 * 1625866 / 4
    assert split_fragments([7], 1) == [[Piece(0, 0, 7)]]
    assert split_fragments([], 1) == [[]]
    with pytest.raises(ValueError, match="4 fragment\\(s\\) of 3 parameter value\\(s\\)"):
        split_fragments([1, 1, 1], 4)


def due_steps(settings: LocalUpdates, num_steps: int, params: list[torch.Tensor]) -> dict[int, list[int]]:
    """For one epoch of `num_steps`: fragment -> the steps its round ended at."""
    rounds = StreamingRounds(settings, params)
    ended: dict[int, list[int]] = {f.index: [] for f in rounds.fragments}
    for step in range(1, num_steps + 1):
        for fragment in rounds.end_of_step(ends_epoch=step == num_steps):
            ended[fragment.index].append(step)
            rounds.apply(fragment, rounds.pseudo_gradient(fragment), step == num_steps)
    return ended


@pytest.mark.parametrize("num_fragments, sync_every, expected", [
    (1, 4, {0: [4, 8, 11]}),
    (2, 4, {0: [4, 8, 11], 1: [2, 6, 10, 11]}),
    (3, 6, {0: [6, 11], 1: [2, 8, 11], 2: [4, 10, 11]}),
])
def test_each_fragment_ends_a_round_every_h_steps_staggered(num_fragments, sync_every, expected):
    settings = LocalUpdates(sync_every, num_fragments=num_fragments)
    ended = due_steps(settings, 11, model_params())
    assert ended == expected
    # Within the epoch (its last step aside) no two fragments meet, and each goes H apart.
    inside = [step for steps in ended.values() for step in steps if step != 11]
    assert len(inside) == len(set(inside))
    for steps in ended.values():
        assert all(b - a == sync_every for a, b in zip(steps[:-1], steps[1:-1], strict=False))


def inner_step(params: list[torch.Tensor], generator: torch.Generator) -> None:
    for param in params:
        param.sub_(0.1 * torch.randn(param.shape, generator=generator))


def test_one_fragment_is_plain_local_updates_bit_for_bit():
    """Two workers, 11 steps with rounds of 4: the same parameters, outer state and
    checkpoint state as `OuterOptimizer` alone."""
    workers = [model_params(), model_params()]
    plain_workers = copy.deepcopy(workers)
    streaming = [StreamingRounds(NESTEROV, w) for w in workers]
    plain = [OuterOptimizer(NESTEROV, w) for w in plain_workers]
    generators = [torch.Generator().manual_seed(r) for r in range(2)]
    plain_generators = [torch.Generator().manual_seed(r) for r in range(2)]
    for step in range(1, 12):
        last = step == 11
        for w, g, pw, pg in zip(workers, generators, plain_workers, plain_generators, strict=True):
            inner_step(w, g)
            inner_step(pw, pg)
        due = [s.end_of_step(last) for s in streaming]
        ended = [p.end_of_step(last) for p in plain]
        assert [bool(d) for d in due] == ended
        if ended[0]:
            average = sum(s.pseudo_gradient(d[0]).clone() for s, d in zip(streaming, due, strict=True)) / 2
            plain_average = sum(p.pseudo_gradient(pw).clone() for p, pw in zip(plain, plain_workers,
                                                                               strict=True)) / 2
            for s, d in zip(streaming, due, strict=True):
                s.apply(d[0], average.clone(), last)
            for p, pw in zip(plain, plain_workers, strict=True):
                p.step(plain_average.clone())
                p.copy_to(pw)
        if step == 7:  # mid-round: the same checkpoint state
            state, plain_state = streaming[0].state_dict(), plain[0].state_dict()
            assert state.keys() == plain_state.keys()
            assert all(torch.equal(state[k], plain_state[k]) if torch.is_tensor(state[k])
                       else state[k] == plain_state[k] for k in state)
    for w, pw in zip(workers, plain_workers, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w, pw, strict=True))
    assert streaming[0].rounds == plain[0].rounds == 3


def test_a_fragments_exchange_moves_its_own_values_only():
    """Three fragments cut inside tensors: a fragment's outer step writes its part of a
    parameter and leaves the other part, another fragment's, as the worker had it."""
    params = model_params()
    rounds = StreamingRounds(LocalUpdates(4, "sgd", 1.0, 0.0, num_fragments=3), params,
                             [f"w{i}" for i in range(6)])
    first, second, third = rounds.fragments
    assert [f.offset for f in rounds.fragments] == [0, 1, 2]
    assert second.names == ["w2[22:32]", "w3", "w4[0:24]"] and first.names == ["w0", "w1", "w2[0:22]"]
    assert [f.nbytes() for f in rounds.fragments] == [4 * 42, 4 * 42, 4 * 42]
    start = [p.clone() for p in params]
    inner_step(params, torch.Generator().manual_seed(1))
    moved = [p.clone() for p in params]
    due = rounds.end_of_step(False)  # step 1: the second fragment's first round ends
    assert due == [second]
    delta = rounds.pseudo_gradient(second)
    assert delta.numel() == 42
    rounds.apply(second, torch.zeros_like(delta), False)  # the workers' mean: no change
    now, moved, start = ([p.view(-1) for p in ps] for ps in (params, moved, start))
    assert torch.equal(now[2][:22], moved[2][:22]) and torch.equal(now[2][22:], start[2][22:])
    assert torch.equal(now[3], start[3]) and torch.equal(now[1], moved[1])
    assert torch.equal(now[4][:24], start[4][:24]) and torch.equal(now[4][24:], moved[4][24:])
    # The second fragment's next round starts there; the others' still from the start.
    assert second.outer.rounds == 1 and first.outer.rounds == third.outer.rounds == 0 and rounds.rounds == 0


def test_mixing_keeps_a_share_of_the_workers_own_but_at_an_epochs_end():
    alpha = 0.25
    params = model_params()
    rounds = StreamingRounds(LocalUpdates(1, mixing=alpha), params)
    start = [p.clone() for p in params]
    inner_step(params, torch.Generator().manual_seed(2))
    local = [p.clone() for p in params]
    fragment, = rounds.end_of_step(False)
    delta = rounds.pseudo_gradient(fragment).clone()
    average = 0.5 * delta  # the other worker did not move
    rounds.apply(fragment, average.clone(), False)
    outer = [s - a.view_as(s) for s, a in zip(start, fragment.outer.views(average), strict=True)]
    for param, own, result in zip(params, local, outer, strict=True):
        torch.testing.assert_close(param, alpha * own + (1 - alpha) * result, rtol=0, atol=1e-6)
    # The next round starts from the outer result: the kept share is in its pseudo-gradient.
    for view, result in zip(fragment.outer.views(fragment.outer.start), outer, strict=True):
        torch.testing.assert_close(view, result, rtol=0, atol=1e-6)
    fragment, = rounds.end_of_step(True)
    rounds.apply(fragment, rounds.pseudo_gradient(fragment).clone(), True)
    assert all(torch.equal(p, s) for p, s in zip(params, fragment.outer.views(fragment.outer.start),
                                                 strict=True))


def run_steps(rounds: StreamingRounds, params: list[torch.Tensor], generator: torch.Generator,
              steps: range, num_steps: int) -> None:
    for step in steps:
        inner_step(params, generator)
        for fragment in rounds.end_of_step(step == num_steps):
            rounds.apply(fragment, 0.5 * rounds.pseudo_gradient(fragment), step == num_steps)


def test_the_state_mid_round_resumes_bit_identical_and_refuses_another_count():
    settings = LocalUpdates(4, "nesterov", 0.7, 0.9, num_fragments=3)
    params = model_params()
    rounds, generator = StreamingRounds(settings, params), torch.Generator().manual_seed(3)
    run_steps(rounds, params, generator, range(1, 6), 11)
    state = copy.deepcopy(rounds.state_dict())
    assert state["num_fragments"] == 3 and [s["steps_in_round"] for s in state["fragments"]] == [1, 0, 3]
    saved_params, saved_generator = [p.clone() for p in params], generator.get_state()
    run_steps(rounds, params, generator, range(6, 12), 11)

    resumed_params = saved_params
    resumed = StreamingRounds(settings, resumed_params)
    resumed.load_state_dict(state)
    run_steps(resumed, resumed_params, torch.Generator().set_state(saved_generator), range(6, 12), 11)
    assert all(torch.equal(a, b) for a, b in zip(params, resumed_params, strict=True))
    assert resumed.state_dict()["fragments"][2]["rounds"] == rounds.state_dict()["fragments"][2]["rounds"]
    with pytest.raises(ValueError, match="written with training.outer_fragments=3 and this run has 2"):
        StreamingRounds(LocalUpdates(4, num_fragments=2), model_params()).load_state_dict(state)
    with pytest.raises(ValueError, match="outer_fragments=1 and this run has 3"):
        StreamingRounds(settings, model_params()).load_state_dict(
            StreamingRounds(LocalUpdates(4), model_params()).state_dict())


def delayed_steps(rounds: StreamingRounds, params: list[torch.Tensor], generator: torch.Generator,
                  steps: range, num_steps: int) -> dict[int, tuple[list[int], list[int]]]:
    """`run_steps` through `send` and `land`: step -> (fragments sent, fragments landed)."""
    events = {}
    for step in steps:
        inner_step(params, generator)
        last = step == num_steps
        due = rounds.end_of_step(last)
        landed = rounds.land(last)
        for fragment in due:
            rounds.send(fragment, done(0.5 * rounds.pseudo_gradient(fragment)), last)
        events[step] = ([f.index for f in due], [e.fragment.index for e in landed])
    return events


def test_a_delayed_exchange_lands_tau_steps_later_mixed_with_the_parameters_of_then():
    tau, alpha = 2, 0.5
    settings = LocalUpdates(4, "nesterov", 0.7, 0.9, num_fragments=2, mixing=alpha, delay=tau)
    params, generator = model_params(), torch.Generator().manual_seed(4)
    rounds = StreamingRounds(settings, params)
    events = delayed_steps(rounds, params, generator, range(1, 12), 11)
    # The same schedule as without delay; each lands tau steps after it was sent, and the
    # epoch's last step lands what is in flight, then exchanges every fragment at once.
    sent = {step: s for step, (s, _) in events.items() if s}
    assert sent == {2: [1], 4: [0], 6: [1], 8: [0], 10: [1], 11: [0, 1]}
    assert {step: landed for step, (_, landed) in events.items() if landed} == {
        4: [1], 6: [0], 8: [1], 10: [0], 11: [1]}
    assert not rounds.in_flight and rounds.rounds == 3

    # By hand, fragment 1's first exchange: the pseudo-gradient of step 2, its outer step
    # applied after step 4 to the parameters that moved on for 2 steps.
    params, generator = model_params(), torch.Generator().manual_seed(4)
    rounds = StreamingRounds(settings, params)
    second = rounds.fragments[1]
    start = second.outer.start.clone()
    delayed_steps(rounds, params, generator, range(1, 3), 11)
    average = 0.5 * (start - torch.cat([t.reshape(-1) for t in second.tensors]))
    assert second.outer.steps_in_round == 0 and len(rounds.in_flight) == 1
    delayed_steps(rounds, params, generator, range(3, 4), 11)
    assert torch.equal(second.outer.start, start)  # not landed yet
    inner_step(params, generator)
    moved = torch.cat([t.reshape(-1) for t in second.tensors])
    assert rounds.end_of_step(False) == [rounds.fragments[0]]
    assert [e.fragment for e in rounds.land(False)] == [second]
    outer = start - 0.7 * (average + 0.9 * average)  # nesterov's first step: buffer = average
    torch.testing.assert_close(second.outer.start, outer, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in second.tensors]),
                               alpha * moved + (1 - alpha) * outer, rtol=0, atol=1e-6)
    assert second.outer.steps_in_round == 2  # its round counts from the step it was sent


def test_a_state_with_exchanges_in_flight_resumes_bit_identical():
    settings = LocalUpdates(4, "sgd", 1.0, 0.5, num_fragments=4, mixing=0.5, delay=3)
    params = model_params()
    rounds, generator = StreamingRounds(settings, params), torch.Generator().manual_seed(5)
    delayed_steps(rounds, params, generator, range(1, 7), 11)
    state = copy.deepcopy(rounds.state_dict())
    # Sent at steps 4, 5 and 6 (fragments 0, 1, 2), landing after steps 7, 8 and 9.
    assert [(e["fragment"], e["steps_left"]) for e in state["in_flight"]] == [(0, 1), (1, 2), (2, 3)]
    saved_params, saved_generator = [p.clone() for p in params], generator.get_state()
    delayed_steps(rounds, params, generator, range(7, 12), 11)

    resumed = StreamingRounds(settings, saved_params)
    resumed.load_state_dict(state)
    delayed_steps(resumed, saved_params, torch.Generator().set_state(saved_generator), range(7, 12), 11)
    assert all(torch.equal(a, b) for a, b in zip(params, saved_params, strict=True))
    with pytest.raises(ValueError, match="resume with the run's training.outer_delay"):
        StreamingRounds(LocalUpdates(4, "sgd", 1.0, 0.5, num_fragments=4),
                        model_params()).load_state_dict(state)


@pytest.mark.parametrize("scheme, bytes_per_value", [("int8", 1), ("fp16", 2)])
def test_quantized_pseudo_gradients_carry_what_they_left_out_into_the_next(scheme, bytes_per_value):
    """Each worker encodes its pseudo-gradient; the mean of the decoded payloads is applied.
    Error feedback: what a payload left out waits per parameter, so over the rounds the
    sum of what was sent stays within one payload's rounding of the sum of the truth."""
    settings = LocalUpdates(2, num_fragments=2, compression=scheme)
    params = model_params()
    rounds = StreamingRounds(settings, params, [f"p{i}" for i in range(len(params))])
    compressor = outer_compressor(settings)
    assert compressor is not None and outer_compressor(LocalUpdates(2)) is None
    names = [f"p{i}" for i in range(len(params))]
    generator = torch.Generator().manual_seed(4)
    truth = {f.index: torch.zeros_like(f.outer.start) for f in rounds.fragments}
    sent = {f.index: torch.zeros_like(f.outer.start) for f in rounds.fragments}
    last_error = {}
    for _ in range(40):
        inner_step(params, generator)
        for fragment in rounds.end_of_step(False):
            delta = rounds.pseudo_gradient(fragment)
            segments = [(name, tensor.numel()) for name, tensor in zip(fragment.names, fragment.tensors,
                                                                        strict=True)]
            encoded = compressor.encode(delta, segments)
            assert encoded.nbytes < delta.numel() * 4 and encoded.nbytes >= delta.numel() * bytes_per_value
            compressor.commit(encoded)
            decoded = torch.empty_like(delta)
            compressor.decode(encoded.data, segments, decoded)
            truth[fragment.index] += delta
            sent[fragment.index] += decoded
            last_error[fragment.index] = (delta - decoded).abs().max()
            rounds.apply(fragment, decoded, False)
    # Per parameter, whichever fragment holds it; int8 sends p5 (2 values) dense, exactly.
    assert set(compressor.residuals) == set(names) - ({"p5"} if scheme == "int8" else set())
    for index in truth:
        fragment = rounds.fragments[index]
        residual = torch.cat([compressor.residuals.get(name, torch.zeros(tensor.numel()))
                              for name, tensor in zip(fragment.names, fragment.tensors, strict=True)])
        # sent + residual == truth: nothing is lost, only delayed.
        torch.testing.assert_close(sent[index] + residual, truth[index], rtol=0, atol=1e-4)
        if scheme == "int8":
            assert last_error[index] > 0  # the payload is really lossy


@pytest.mark.parametrize("training, fragment", [
    ({"outer_fragments": 0}, "training.outer_fragments: 0 must be >= 1"),
    ({"outer_fragments": 5}, "training.outer_fragments: 5 fragments need at least as many steps per round"),
    ({"outer_mixing": 1.0}, "training.outer_mixing: 1.0 must be in [0, 1)"),
    ({"outer_compression": "int4"}, "training.outer_compression: 'int4' must be one of none, fp16, int8"),
    ({"outer_delay": 4}, "training.outer_delay: 4 must be less than training.sync_every (4)"),
    ({"outer_delay": -1}, "training.outer_delay: -1 must be >= 0"),
])
def test_bad_streaming_settings_are_one_line_naming_the_key(training, fragment):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"training": {"sync_every": 4, **training}})
    assert any(fragment in line for line in info.value.problems), info.value.problems
    assert all("\n" not in line for line in info.value.problems)


def test_the_run_refuses_two_compressions_of_the_pseudo_gradient():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"training": {"sync_every": 4, "outer_compression": "int8"},
                          "compression": {"enabled": True, "type": "topk"}})
    assert any("training.outer_compression: int8 compresses the pseudo-gradients, and so would "
               "compression.type topk" in line for line in info.value.problems), info.value.problems


def test_the_parameter_server_takes_fragments_of_whole_shards_and_live_groups_refuse_the_keys():
    streaming = {"training": {"sync_every": 4, "outer_fragments": 2}}
    check_ps_supported(config_from_dict({**streaming, "ps": {"num_servers": 2}}))
    refusals = [({**streaming, "ps": {"num_servers": 1}}, "2 fragments need as many servers at least"),
                ({**streaming, "ps": {"num_servers": 2, "backup_workers": 1}, "system": {"num_workers": 2}},
                 "ps.backup_workers: 1 is not offered with training.outer_fragments > 1"),
                ({"training": {"sync_every": 4, "outer_compression": "int8"}},
                 "leave it none and set compression.type")]
    for config, message in refusals:
        with pytest.raises(ConfigError, match=message) as info:
            check_ps_supported(config_from_dict(config))
        assert "\n" not in str(info.value)
    check_ps_supported(config_from_dict({"training": {"sync_every": 4, "outer_delay": 2}}))  # a delay
    with pytest.raises(ConfigError) as info:
        config_from_dict({"training": {"sync_every": 4, "outer_delay": 2},
                          "compression": {"enabled": True, "type": "powersgd"}})
    assert any("training.outer_delay: 2 overlaps a plain all-reduce" in line for line in info.value.problems)
    with pytest.raises(ConfigError, match="not offered with ddp.recovery live"):
        check_supported(config_from_dict({"training": {"sync_every": 4, "outer_delay": 1},
                                          "ddp": {"recovery": "live"}}))
    with pytest.raises(ConfigError, match="not offered with ddp.recovery live"):
        check_supported(config_from_dict({**streaming, "ddp": {"recovery": "live"}}))
    check_supported(config_from_dict(streaming))


class PushBuffers:
    """What a delayed push sees of the exchange: the buffers it pushes from and pulls into."""

    def __init__(self, flat: torch.Tensor, grads: torch.Tensor):
        self.flat, self.grads = flat, grads


def test_a_parameter_server_workers_delayed_push_runs_on_its_own_buffers_and_lands_mixed():
    tau, alpha = 2, 0.5
    settings = LocalUpdates(4, num_fragments=2, mixing=alpha, delay=tau)
    training = config_from_dict({"training": {"sync_every": 4, "optimizer": "sgd",
                                              "learning_rate": 0.1}}).training
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 4))  # 8 + 12 values
    flat, grads = flat_parameters(model)
    rounds = WorkerRounds(settings, model, flat, grads, training, [10, 10])
    exchange, pushed = PushBuffers(flat, grads), []

    def step(seed: int) -> bool:
        grads.zero_()
        model(torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
        due = rounds.inner_step(4, ends_epoch=False)
        rounds.land()
        return due

    start = flat[10:].clone()
    assert not step(0) and step(1)  # step 2 ends fragment 1's round
    delta = rounds.pseudo_gradient()
    expected = delta[10:].clone()
    assert rounds.delays and rounds.due_shards == [1]

    def trade() -> None:  # as the exchange would: push from its grads, pull the shards' result
        assert exchange.flat is not flat and exchange.grads is not grads
        exchange.grads.copy_(delta)
        pushed.append(exchange.grads[10:].clone())
        exchange.flat[10:] = 0.25

    rounds.send(exchange, trade)
    assert not rounds.opening and rounds.shard_samples() == [8, 0]
    assert not step(2)  # step 3: in flight, fragment 1's parameters move on
    assert torch.equal(rounds.outer.fragments[1].outer.start, start)
    state = copy.deepcopy(rounds.state_dict())  # waits for the push
    assert [(e["fragment"], e["steps_left"]) for e in state["outer"]["in_flight"]] == [(1, 1)]
    saved = flat.clone()
    grads.zero_()
    model(torch.randn(4, 3, generator=torch.Generator().manual_seed(3))).square().sum().backward()
    assert rounds.inner_step(4, ends_epoch=False)  # step 4: fragment 0's round ends, 1's lands
    moved = flat[10:].clone()
    rounds.land()
    torch.testing.assert_close(pushed[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(flat[10:], alpha * moved + (1 - alpha) * torch.full((10,), 0.25),
                               rtol=0, atol=1e-7)
    assert torch.equal(rounds.outer.fragments[1].outer.start, torch.full((10,), 0.25))
    assert rounds.outer.fragments[1].outer.steps_in_round == 2 and rounds.scalars()["local/rounds"] == 0

    # Resumed from the state in flight: the result lands at the same step, the same bits.
    landed = flat.clone()
    rounds.load_state_dict(state)
    assert torch.equal(flat, saved)
    grads.zero_()
    model(torch.randn(4, 3, generator=torch.Generator().manual_seed(3))).square().sum().backward()
    assert rounds.inner_step(4, ends_epoch=False)
    rounds.land()
    assert torch.equal(flat, landed)

    with_buffers = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="training.outer_delay on the parameter server takes models without"):
        WorkerRounds(LocalUpdates(4, delay=1), with_buffers, *flat_parameters(with_buffers), training)
