"""`disttrain ps --resume` on another number of workers in async and SSP mode: a 2-worker
run preempted mid-epoch (`--inject term:worker=W:step=S` for both workers) goes on on 3
workers, or on 1.
Every sample of each epoch is applied exactly once across the change (the shards' ledgers,
through the summary, and what the model's forward was given in every worker process of
both runs), the global batch is kept (said in the launcher's log), the shards' step
clocks restart for the new workers (SSP's bound holds: the run finishes), and the run ends
normally. The runs and checks are `test_ps_resize_cli`'s."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_ps_resize_cli import BATCH_SIZE, STOP_STEP, batch_line, config_file, finished, logs, ps

from disttrain.core import checkpoint as ckpt

MODES = {"async": ("--aggregation-mode", "async"), "ssp": ("--aggregation-mode", "ssp", "--staleness", "1")}


# SSP resizes as async does (one step count per worker): make test-extended runs it
@pytest.fixture(scope="module", params=["async", pytest.param("ssp", marks=pytest.mark.extended)])
def stopped(request, tmp_path_factory) -> tuple[Path, list[dict], str]:
    """A 2-worker run of the mode preempted mid-epoch 1 (its records labelled `two`)."""
    mode = request.param
    path = tmp_path_factory.mktemp(f"two-{mode}")
    config_file(path)
    # Both workers are signalled at the step: async workers drift apart, and on a loaded
    # machine one alone may finish the run (100 steps in under a second) before the other
    # reaches it; the first to get there stops both mid-epoch (a second SIGTERM changes nothing).
    result = ps(path, "two", 2, *MODES[mode], "--inject", f"term:worker=0:step={STOP_STEP}",
                "--inject", f"term:worker=1:step={STOP_STEP}")
    assert result.returncode == 143, logs(path, result)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: preempted by SIGTERM: "), logs(path, result)
    # Each worker's stop, from its checkpoint: a preemption's agreement stops them at one
    # step, but the resize takes them wherever they stand.
    states = [ckpt.load_checkpoint(ckpt.list_checkpoints(path / "ckpt" / f"worker{r}")[-1]) for r in range(2)]
    stops = [(s["position"]["step"], s["sampler"]["epoch"], s["sampler"]["position"]) for s in states]
    assert all(stop[1] == 1 and 0 < stop[2] < 300 for stop in stops), (stops, logs(path, result))
    return path, stops, mode


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [3, pytest.param(1, marks=pytest.mark.extended)])
def test_an_async_or_ssp_run_of_two_resumed_on_three_or_one_applies_every_sample_once(stopped, tmp_path,
                                                                                      workers):
    source, stops, mode = stopped
    path = tmp_path / "run"
    shutil.copytree(source, path)
    result = ps(path, "resumed", workers, *MODES[mode], "--resume")
    batch_line(result, path, 2, workers)
    assert "rewrote the checkpoints of 2 workers (epoch 1, " in result.stderr, logs(path, result)
    # Async and SSP count pushes applied: the 2 workers' steps, then the new workers' blocks
    # of the rest of epoch 1 (50 an epoch on any number), past the whole batches of the
    # new size the old ones had taken.
    new_batch = BATCH_SIZE * 2 // workers
    pushes = sum(step for step, _, _ in stops) + workers * 50 - sum(p for _, _, p in stops) // new_batch
    steps = {step for step, _, _ in stops}
    resumed_from = steps.pop() if len(steps) == 1 else None  # apart, the rewrite moves the steps on
    summary = finished(path, result, workers, resumed_from, [("two", 0), ("resumed", 1)], pushes)
    assert summary["strategy"] == f"ps-{mode}"
    assert len(list((path / "records").glob("resumed-*"))) == workers
