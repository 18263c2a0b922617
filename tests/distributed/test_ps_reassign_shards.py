"""Reassignment on real sockets: two shards told by the membership that a worker was
reassigned stop waiting for it at a barrier and say it is away; a survivor takes one of
its blocks over on both shards; the worker rejoins and finishes the same block, and both
shards answer DUPLICATE, their ledgers and samples unchanged. Each check reads the
servers' state."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from disttrain.metrics.window import StepTimer
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.worker.blocks import block_id
from disttrain.strategies.ps.worker.exchange import Block
from disttrain.strategies.ps.worker.takeover import away_ranks
from tests.distributed.test_ps_recovery import exchange_for, result, start
from tests.distributed.test_ps_server import make_config

pytestmark = pytest.mark.timeout(60)


def test_a_reassigned_workers_block_taken_over_then_finished_by_it_is_applied_once_on_every_shard(tmp_path):
    config = make_config(tmp_path, num_workers=3).replace(ps={"aggregation_mode": "sync"})
    servers, plans = start(config, 2)
    exchanges = []

    def membership(generation, live, away=frozenset()):
        for server in servers:
            server.state.set_membership(generation, live, away)

    try:
        exchanges = [exchange_for(config, servers, plans, f"w{r}", mode="sync", generation=1)
                     for r in range(3)]
        membership(1, {"w0": 1, "w1": 1, "w2": 1})
        membership(2, {"w0": 1, "w1": 1})  # w2 failed
        membership(3, {"w0": 1, "w1": 1}, frozenset({"w2"}))  # and did not come back in time
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(exchanges[0].client.barrier, "w0", "epoch0:trained", [1.0])
            rows = exchanges[1].client.barrier("w1", "epoch0:trained", [1.0])
            assert away_ranks(first.result()) == [2]  # the same answer for both
        assert rows[:2] == [[1.0], [1.0]] and away_ranks(rows) == [2]  # NaN crossed the wire
        block = block_id(0, 2, 5, 3, 10)
        exchanges[0].redo(result, Block(1, block, 0, 8, redo=True), [0, 1], StepTimer())
        assert all(server.state.ledger(0, 0) == [block] for server in servers)
        samples = [server.state.status()["num_samples_applied"] for server in servers]
        assert samples == [8, 8]
        for worker in ("w0", "w1"):
            exchanges[int(worker[1])].client.worker_done(worker)
        assert all(server.state.status()["num_done"] == 3 for server in servers)  # w2 counts as done
        membership(4, {"w0": 1, "w1": 1, "w2": 4})  # w2 rejoined: waited for again
        assert not any(server.state.rules.all_done() for server in servers)
        client = exchanges[2].client
        headers = [pb.GradientMessage(worker_id="w2", step=6, block_id=block, shard=s, num_samples=8,
                                      base_version=server.state.version, generation=4, epoch=0)
                   for s, server in enumerate(servers)]
        replies = client.push(headers, exchanges[2].grads, [0, 1])
        assert [r.outcome for r in replies] == [pb.PushReply.DUPLICATE] * 2
        for server in servers:
            status = server.state.status()
            assert server.state.ledger(0, 0) == [block]
            assert status["num_samples_applied"] == 8 and status["num_samples_duplicate"] == 8
    finally:
        for exchange in exchanges:
            exchange.client.close()
        for server in servers:
            server.stop(0)
