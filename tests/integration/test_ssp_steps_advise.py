"""`disttrain advise --simulate` with SSP by steps at 1,024 workers with stragglers: the run
of the issue (SimpleCNN, 1 Gbit/s, 50 ms steps), its figures asserted, not timed."""

from __future__ import annotations

import json

import pytest

ISSUE_RUN = ["advise", "--model", "simplecnn", "--dataset", "digits", "--link", "1gbit,0.2ms", "--step-time",
             "0.05", "--workers", "1024", "--simulate", "1024", "--sim-steps", "100", "--stragglers", "0.05",
             "--num-threads", "1", "--json"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.extended  # the same figures: tests/unit/test_advise_simulation
def test_ssp_at_1024_workers_with_stragglers_drops_nothing_and_keeps_up_with_sync(cli):
    result = cli(*ISSUE_RUN, timeout=280)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = {(r["mode"], r["backup_workers"]): r for r in json.loads(result.stdout)["simulations"]}
    ssp, sync = runs[("ssp", 0)], runs[("sync", 0)]
    assert ssp["num_workers"] == 1024 and ssp["staleness_bound"] == 2
    assert ssp["num_rejected_stale"] == 0 and ssp["work_dropped_fraction"] == 0
    assert ssp["num_pushes"] == ssp["num_updates"] == 100 * 1024  # every push applied
    assert ssp["samples_per_s"] >= sync["samples_per_s"]
    # the bound holds every worker within tau steps of the stragglers, so SSP is not async
    assert ssp["samples_per_s"] < runs[("async", 0)]["samples_per_s"]
