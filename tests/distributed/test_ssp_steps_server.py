"""SSP by steps on a real shard server (port 0) and real worker exchanges in threads: the
shard holds the reply of a worker that is the bound ahead, over the Step stream and over
a push and a pull alike, and applies every gradient, refusing none."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.metrics.window import StepTimer
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.strategies.ps.worker.exchange import Block, ExchangeRules, WorkerTensors, make_exchange
from disttrain.training.engine import StepResult

NUM_WORKERS, NUM_STEPS = 3, 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("one_round_trip", [True, False])
@pytest.mark.parametrize("tau", [0, 1])
def test_no_worker_computes_a_step_before_the_slowest_is_within_the_bound(tmp_path, one_round_trip, tau):
    torch.set_num_threads(1)
    config = config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd", "momentum": 0.0},
        "system": {"num_workers": NUM_WORKERS, "checkpoint_dir": str(tmp_path / "ckpt")},
        "ps": {"aggregation_mode": "ssp", "staleness": tau}})
    state = build_state(config, 0, 1)
    server = ShardServer(state, "127.0.0.1:0")
    plan = state.plan
    clients = [PSClient([server.address], [plan], RetryPolicy(timeout_s=20.0), one_round_trip=one_round_trip)
               for _ in range(NUM_WORKERS)]
    started: list[tuple[int, int, int]] = []  # (rank, step, the slowest clock on the shard as it started)

    def slowest() -> int:
        with state._lock:  # the shard's own clocks, read as the rules read them
            return min(state.rules.clocks.of(rank) for rank in range(NUM_WORKERS))

    def worker(rank: int) -> None:
        c = clients[rank]
        c.register(f"w{rank}", rank)
        exchange = make_exchange(c, f"w{rank}",
                                 WorkerTensors(torch.zeros(plan.numel), torch.ones(plan.numel)),
                                 ExchangeRules("ssp", tau))
        exchange.start()
        for step in range(1, NUM_STEPS + 1):
            def compute(step=step) -> StepResult:
                started.append((rank, step, slowest()))
                return StepResult(0.0, 0, 4)

            exchange.step(compute, Block(step, rank * NUM_STEPS + step, 0, 4,
                                         last_in_epoch=step == NUM_STEPS), StepTimer())
        c.worker_done(f"w{rank}")

    try:
        with ThreadPoolExecutor(NUM_WORKERS) as pool:
            for future in [pool.submit(worker, rank) for rank in range(NUM_WORKERS)]:
                future.result()
        status = state.status()
        assert status["num_applied"] == NUM_WORKERS * NUM_STEPS and status["num_rejected_stale"] == 0
        assert status["num_blocks_applied"] == NUM_WORKERS * NUM_STEPS
        # A worker starts step s only once every worker pushed step s - 1 - tau.
        assert len(started) == NUM_WORKERS * NUM_STEPS
        assert all(step - 1 - clock <= tau for _, step, clock in started), started
    finally:
        for c in clients:
            c.close()
        server.stop(0)
