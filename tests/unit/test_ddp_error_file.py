"""A failing rank's error file for the elastic agent is whole or absent, never empty."""

from __future__ import annotations

import json

from disttrain.strategies.ddp.error_file import AtomicErrorHandler


def test_the_error_file_lands_whole_by_rename(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    AtomicErrorHandler().record_exception(ValueError("rank 1 was lost"))
    assert "rank 1 was lost" in json.loads(path.read_text())["message"]["message"]
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no temporary file left
