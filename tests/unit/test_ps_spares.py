"""Hot spares of the parameter server (`run.spares`): the hand-off file a launcher writes
for a spare (atomic, private, read once), and the runs spares are refused for."""

from __future__ import annotations

import os
import stat

import pytest

from disttrain.core.errors import ConfigError
from disttrain.strategies.ps.run.spares import Identity, check_spares, read_handoff, write_handoff


def test_a_handoff_is_written_private_read_once_and_names_the_worker(tmp_path):
    path = tmp_path / "spare0.handoff.json"
    write_handoff(path, Identity("worker1", 1, 2, "node-token"))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    assert read_handoff(path) == Identity("worker1", 1, 2, "node-token")
    assert not path.exists()  # the token does not outlive the hand-off


@pytest.mark.parametrize("text", ['{"worker_id": 3, "rank": 1, "attempt": 1}', '["worker1"]',
                                  '{"worker_id": "worker1", "attempt": 1}'])
def test_a_handoff_that_names_no_worker_is_refused(tmp_path, text):
    path = tmp_path / "spare0.handoff.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="does not name a worker"):
        read_handoff(path)


def test_spares_are_refused_for_an_elastic_run_only():
    with pytest.raises(ConfigError, match=r"ps.spares: 1 hot spares are not offered with --workers MIN:MAX"):
        check_spares(1, elastic=True)
    check_spares(1, elastic=False)
    check_spares(0, elastic=True)
