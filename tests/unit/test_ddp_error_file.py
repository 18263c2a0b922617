"""A failing rank's error file for the elastic agent is whole or absent, never empty."""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from disttrain.strategies.ddp import error_file
from disttrain.strategies.ddp.error_file import AtomicErrorHandler


def test_the_error_file_lands_whole_by_rename_and_the_agent_reads_it(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ValueError("rank 1 was lost")
    except ValueError as e:
        AtomicErrorHandler().record_exception(e)
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no temporary file left
    failure = ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=str(path))
    assert failure.message["message"] == "ValueError: rank 1 was lost"
    assert "rank 1 was lost" in json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"]


def test_a_rank_stopped_while_writing_leaves_no_file_the_agent_cannot_parse(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def stopped(*args, **kwargs):  # the agent's SIGTERM arrives while the rank writes
        raise SystemExit(143)
    monkeypatch.setattr(error_file.os, "replace", stopped)
    with pytest.raises(SystemExit):
        AtomicErrorHandler().record_exception(ValueError("rank 1 was lost"))
    assert not path.exists()
    ProcessFailure(local_rank=1, pid=101, exitcode=-15, error_file=str(path))  # parses: no file, no message
