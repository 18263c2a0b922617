"""The overlapped synchronous step on two real shard servers: each shard's push leaves
during backward, and the servers end where one process stepping on the same batches
ends; compressed pushes end as the classic step's do; a gradient with NaN reaches no
shard launched after it; a reply lost in the middle is answered again, nothing applied
twice. Each test checks the servers' parameters, not logs."""

from __future__ import annotations

import pytest
import torch

from disttrain.compression import Compressor
from disttrain.core.errors import TrainingError
from disttrain.metrics.window import StepTimer
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire.payloads import GradientEncoder
from disttrain.strategies.ps.wire.sharding import flat_parameters, plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.strategies.ps.worker.exchange import Block, SyncOptions, WorkerTensors, make_exchange
from disttrain.strategies.ps.worker.overlap_trial import OverlapTrial, judge
from disttrain.training.engine import forward_backward
from disttrain.training.models import init_model
from tests.distributed.test_ps_server import make_config

pytestmark = pytest.mark.timeout(60)

SHARDS = 2
STEPS = 3


def batches(count: int = STEPS):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 1, 8, 8, generator=generator), torch.randint(0, 10, (8,), generator=generator))
            for _ in range(count)]


class Cluster:
    """`shards` shard servers (two by default) and one registered worker with its model in
    flat buffers, its payloads through `transport`."""

    def __init__(self, config, overlap: bool, compression: bool = False, before=None, trial_steps: int = 0,
                 shards: int = SHARDS, transport: str = "auto"):
        self.servers = [ShardServer(build_state(config, s, shards), "127.0.0.1:0") for s in range(shards)]
        self.model = init_model(config.training)
        if before is not None:
            before(self.model)  # hooks of the test, ahead of the exchange's
        plans = plan_shards(self.model, shards)
        self.plans = plans
        self.flat, self.grads = flat_parameters(self.model)
        self.client = PSClient([s.address for s in self.servers], plans, RetryPolicy(timeout_s=20.0),
                               transport)
        self.client.register("w0", 0, key=b"k" * 32)
        encoder = None
        if compression:
            encoder = GradientEncoder(Compressor.from_config(config.compression, 0), plans)
        self.exchange = make_exchange(self.client, "w0", WorkerTensors(self.flat, self.grads),
                                      encoder=encoder,
                                      sync=SyncOptions(overlap=self.model if overlap else None,
                                                       overlap_trial_steps=trial_steps))
        self.exchange.start()

    def step(self, step: int, inputs, targets, timer: StepTimer | None = None):
        def compute():
            self.grads.zero_()
            return forward_backward(self.model, inputs, targets)

        return self.exchange.step(compute, Block(step, step, 0, len(targets)), timer or StepTimer())

    def parameters(self) -> torch.Tensor:
        return torch.cat([s.state.parameters() for s in self.servers])

    def close(self):
        self.client.close()
        for server in self.servers:
            server.stop(0)


def one_process(config, count: int = STEPS) -> torch.Tensor:
    model = init_model(config.training)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.training.learning_rate)
    for inputs, targets in batches(count):
        optimizer.zero_grad()
        forward_backward(model, inputs, targets)
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_overlapped_steps_match_one_process_and_overlap_backward(tmp_path):
    config = make_config(tmp_path)
    cluster = Cluster(config, overlap=True)
    try:
        timers = []
        for step, (inputs, targets) in enumerate(batches(), start=1):
            timers.append(StepTimer())
            cluster.step(step, inputs, targets, timers[-1])
        torch.testing.assert_close(cluster.parameters(), one_process(config), rtol=1e-5, atol=1e-6)
        assert torch.equal(cluster.flat, cluster.parameters())  # the worker holds the servers' step
        assert cluster.exchange.versions == [STEPS] * SHARDS
        drained = [t.drain() for t in timers]
        assert all("time/comm_overlapped_s" in d for d in drained)
        # shard 1 (the last layers) went out before backward ended
        assert sum(d["time/comm_overlapped_s"] for d in drained) > 0
    finally:
        cluster.close()


@pytest.mark.timeout(120)
def test_a_trial_of_both_pushes_matches_one_process_and_keeps_one_side(tmp_path):
    """The overlap trial (`ps.overlap_trial_steps`) runs overlapped and plain steps in ABBA
    pairs on real shards: what is trained is unchanged, both sides ran (overlapped steps send
    during backward, plain ones do not), the trial ran one round of pairs or, undecided,
    more (up to its cap), and after the trial every step takes one side."""
    rounds = OverlapTrial(2).max_rounds
    count = 2 + 2 * 2 * rounds + 3  # warm-up, the most rounds of two timed steps per side, then the side kept
    config = make_config(tmp_path)
    cluster = Cluster(config, overlap=True, trial_steps=2)
    try:
        used = []
        for step, (inputs, targets) in enumerate(batches(count), start=1):
            timer = StepTimer()
            cluster.step(step, inputs, targets, timer)
            used.append(timer.drain()["time/comm_overlapped_s"] > 0)
        trial = cluster.exchange.trial
        torch.testing.assert_close(cluster.parameters(), one_process(config, count), rtol=1e-5, atol=1e-6)
        assert cluster.exchange.versions == [count] * SHARDS
        timed = len(trial.pairs)
        assert trial.chosen is not None and timed in {2 * r for r in range(1, rounds + 1)}
        # ABBA pairs: the plain steps of the trial sent nothing during backward, the
        # overlapped ones did (shard 1 leaves before backward ends)
        assert used[2:2 + 2 * timed] == [True, False, False, True] * (timed // 2)
        assert used[2 + 2 * timed:] == [trial.chosen] * (count - 2 - 2 * timed)
        # each round but the last was undecided, the last decided it (or reached the cap)
        for end in range(2, timed, 2):
            assert judge(trial.timed[True][:end], trial.timed[False][:end]).undecided
        last = judge(trial.timed[True], trial.timed[False])
        assert trial.chosen == last.keep_overlap and (timed == 2 * rounds or not last.undecided)
    finally:
        cluster.close()


def test_compressed_overlapped_steps_end_where_the_classic_steps_end(tmp_path):
    config = make_config(tmp_path).replace(compression={"enabled": True, "type": "topk", "ratio": 0.1})
    ends = []
    for overlap in (False, True):
        folder = {"checkpoint_dir": str(tmp_path / f"ckpt{overlap}")}
        cluster = Cluster(config.replace(system=folder), overlap, compression=True)
        try:
            for step, (inputs, targets) in enumerate(batches(), start=1):
                cluster.step(step, inputs, targets)
            ends.append((cluster.parameters(), cluster.exchange.encoder.state_dict()))
        finally:
            cluster.close()
    (classic, classic_state), (overlapped, overlapped_state) = ends
    assert torch.equal(classic, overlapped)
    assert classic_state.keys() == overlapped_state.keys()


def poison(parameter_index: int):
    """A hook that puts NaN in one parameter's gradient before the exchange sees it."""

    def before(model):
        def hook(param) -> None:
            param.grad.view(-1)[0] = float("nan")

        list(model.parameters())[parameter_index].register_post_accumulate_grad_hook(hook)

    return before


@pytest.mark.parametrize("parameter_index, sent", [(-1, "no shard was sent"), (0, r"shard\(s\) \[1\]")])
def test_a_gradient_with_nan_reaches_no_shard_launched_after_it(tmp_path, parameter_index, sent):
    config = make_config(tmp_path)
    cluster = Cluster(config, overlap=True, before=poison(parameter_index))
    try:
        before = [s.state.parameters() for s in cluster.servers]
        inputs, targets = batches()[0]
        with pytest.raises(TrainingError, match=sent):
            cluster.step(1, inputs, targets)
        bad = 1 if parameter_index == -1 else 0
        assert cluster.servers[bad].state.version == 0
        assert torch.equal(cluster.servers[bad].state.parameters(), before[bad])
        if parameter_index == -1:  # the last layers' shard goes first: nothing went anywhere
            assert cluster.servers[0].state.version == 0
    finally:
        cluster.close()


def test_a_reply_lost_during_backward_is_answered_again_and_applied_once(tmp_path):
    config = make_config(tmp_path)
    cluster = Cluster(config, overlap=True)
    try:
        for step, (inputs, targets) in enumerate(batches(), start=1):
            if step == 2:
                cluster.client.lose_next_replies()  # every shard's reply of step 2
            cluster.step(step, inputs, targets)
        torch.testing.assert_close(cluster.parameters(), one_process(config), rtol=1e-5, atol=1e-6)
        assert [s.state.version for s in cluster.servers] == [STEPS] * SHARDS
        assert all(set(cluster.client.ledger(0, 0)[s]) == {1, 2, 3} for s in range(SHARDS))
    finally:
        cluster.close()
