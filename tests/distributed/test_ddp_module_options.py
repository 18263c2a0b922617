"""The DDP section's module options reach torch's DDP module: each rank of a real 2-rank
gloo group joins it as the strategy does (`runtime.start`, rendezvous through a store
the test hosts as the elastic agent would), builds its participant from a config (`rank.restart_participant`),
trains two steps, and reports what the DDP module holds and what the strategy's own
communication hook saw. Defaults against non-default values of `ddp.bucket_cap_mb`,
`ddp.gradient_as_bucket_view` and `ddp.static_graph`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from disttrain.config import config_from_dict
from disttrain.data import load_datasets
from disttrain.strategies.ddp import runtime as rt
from disttrain.strategies.ddp.participant import DDPParticipant
from disttrain.strategies.ddp.rank import restart_participant
from disttrain.training.engine import forward_backward
from disttrain.training.strategy import StepInfo

pytestmark = pytest.mark.timeout(120)

WORLD_SIZE = 2
BATCH_SIZE = 8
TRAINING = {"dataset": "digits", "max_train_samples": 64, "max_test_samples": 32,
            "batch_size": BATCH_SIZE, "num_epochs": 1}
# SimpleCNN holds about 212 kB of parameters: one bucket under the default 25 MB cap;
# under 0.05 MB a bucket closes once past 52 kB (fc1's weight alone is 131 kB).
SMALL_CAP_MB = 0.05
SETTINGS = {
    "defaults": {},
    "set": {"bucket_cap_mb": SMALL_CAP_MB, "gradient_as_bucket_view": True, "static_graph": True},
}


def observe(participant: DDPParticipant, rank: int) -> dict:
    """What the strategy's DDP module holds after two training steps, and the buckets the
    strategy's communication hook counted in one more backward pass."""
    model = participant.recovery.begin_step(0)  # the rank's DDP module
    indices = torch.arange(rank * BATCH_SIZE, (rank + 1) * BATCH_SIZE)
    for step in (1, 2):  # DDP sizes its buckets anew after the first step
        participant.step([indices], StepInfo(step, 0, step - 1))
    participant.optimizer.zero_grad(set_to_none=True)
    inputs, targets = participant.data.train.batch(indices)
    forward_backward(model, inputs, targets, 1.0, participant.precision)
    counted = participant.comm.drain()
    logged = model._get_ddp_logging_data()  # what the reducer was set up with
    grads = [p.grad for p in participant.module.parameters()]
    return {
        "bucket_bytes_cap": model.bucket_bytes_cap, "logged_bucket_bytes_cap": logged["bucket_cap_bytes"],
        "num_buckets": counted.num_buckets, "num_bytes": counted.num_bytes,
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "logged_gradient_as_bucket_view": logged["gradient_as_bucket_view"],
        # Gradients that are views into their buckets' flat buffers share their storages.
        "num_grads": len(grads), "num_grad_storages": len({g.untyped_storage().data_ptr() for g in grads}),
        "static_graph": model.static_graph, "logged_static_graph": logged.get("static_graph", 0),
        "broadcast_buffers": model.broadcast_buffers,
    }


def rank_main(rank: int, port: int, out_dir: str) -> None:
    # The variables the elastic agent sets; its store is the test's.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    info = rt.RankInfo.from_env(os.environ)
    runtime = rt.start(config_from_dict({}).ddp, info, num_threads=1)
    facts = {}
    for name, ddp in SETTINGS.items():
        config = config_from_dict({"training": TRAINING, "ddp": ddp})
        participant = restart_participant(config, runtime, load_datasets(config.training))
        facts[name] = observe(participant, rank)
    torch.save(facts, Path(out_dir) / f"rank{rank}.pt")
    rt.shutdown(runtime)
    os._exit(0)  # as a rank of `disttrain ddp` leaves: gloo's threads can abort interpreter shutdown


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ddp_options")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # binds a free port
    mp.start_processes(rank_main, args=(store.port, str(out_dir)), nprocs=WORLD_SIZE,
                       start_method="forkserver")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


@pytest.mark.slow
def test_bucket_cap_mb_sizes_the_gradient_buckets(facts):
    for rank_facts in facts:
        defaults, small = rank_facts["defaults"], rank_facts["set"]
        assert defaults["bucket_bytes_cap"] == defaults["logged_bucket_bytes_cap"] == 25 * 2 ** 20
        assert small["bucket_bytes_cap"] == small["logged_bucket_bytes_cap"] == int(SMALL_CAP_MB * 2 ** 20)
        # The same gradient bytes, cut into more buckets: one each, all-reduced one by one.
        assert defaults["num_bytes"] == small["num_bytes"] > 0
        assert defaults["num_buckets"] == 1
        assert small["num_buckets"] == 3, small


@pytest.mark.slow  # the module's process group of spawned ranks
def test_gradient_as_bucket_view_makes_gradients_views_of_the_buckets(facts):
    for rank_facts in facts:
        defaults, view = rank_facts["defaults"], rank_facts["set"]
        assert not defaults["gradient_as_bucket_view"] and defaults["logged_gradient_as_bucket_view"] == 0
        assert defaults["num_grad_storages"] == defaults["num_grads"] == 8  # one tensor each
        assert view["gradient_as_bucket_view"] and view["logged_gradient_as_bucket_view"] == 1
        assert view["num_grad_storages"] == view["num_buckets"] == 3  # the three buckets


@pytest.mark.slow  # the module's process group of spawned ranks
def test_static_graph_reaches_the_reducer(facts):
    for rank_facts in facts:
        defaults, static = rank_facts["defaults"], rank_facts["set"]
        assert not defaults["static_graph"] and defaults["logged_static_graph"] == 0
        assert static["static_graph"] and static["logged_static_graph"] == 1


@pytest.mark.slow  # the module's process group of spawned ranks
def test_buffers_are_broadcast_from_rank_zero_whatever_the_options(facts):
    # The README's DDP buffer rule (tests/distributed/test_ddp_buffers.py checks its effect).
    assert all(rank_facts[name]["broadcast_buffers"] for rank_facts in facts for name in SETTINGS)
