"""The README's examples run as written. A fenced block after `<!-- runnable -->` is a shell
block, run with bash; one after `<!-- runnable: FILE -->` is a file the blocks after it use,
written as FILE. They run in order, in one fresh folder, with nothing substituted: a block
that needs a data folder must name it as `$DISTTRAIN_DATA_DIR`, which the run sets from the
MNIST copy the other tests use (and skips without one). Each run's outputs are then read:
every `--log-dir` holds a summary and every `--output-dir` a comparison whose runs all
finished."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, find_real_data_dir

README = REPO_ROOT / "README.md"
MARK = re.compile(r"^<!-- runnable(?:: (?P<file>[\w./-]+))? -->\n```(?P<lang>\w*)\n(?P<body>.*?)^```$",
                  re.M | re.S)


def runnable_blocks(text: str) -> list[tuple[str | None, str]]:
    """(file or None for a shell block, body) of every block marked runnable, in order."""
    return [(match["file"], match["body"]) for match in MARK.finditer(text)]


def test_the_readme_marks_a_block_for_every_strategy_and_the_plugin_examples():
    blocks = runnable_blocks(README.read_text())
    shell = "\n".join(body for file, body in blocks if file is None)
    for command in ("disttrain baseline", "disttrain ps", "disttrain ddp", "disttrain compare"):
        assert command in shell
    assert [file for file, _ in blocks if file] == ["my_model.py", "hf_gpt2.py"]
    assert README.read_text().count("<!-- runnable") == len(blocks), "a marker without a block after it"


def test_a_data_folder_comes_from_the_documented_variable():
    for _, body in runnable_blocks(README.read_text()):
        for value in re.findall(r"--data-dir[ =](\S+)", body):
            assert value in ('"$DISTTRAIN_DATA_DIR"', "$DISTTRAIN_DATA_DIR"), body


def test_the_markers_are_read():
    text = ("<!-- runnable: a.py -->\n```python\nx = 1\n```\n\n```bash\nnot marked\n```\n"
            "<!-- runnable -->\n```bash\ndisttrain configs\n```\n")
    assert runnable_blocks(text) == [("a.py", "x = 1\n"), (None, "disttrain configs\n")]


def _outputs_finished(folder: Path, body: str) -> None:
    for log_dir in re.findall(r"--log-dir (\S+)", body):
        summary = json.loads((folder / log_dir / "summary.json").read_text())
        assert summary["samples_processed"] > 0, log_dir
    for output_dir in re.findall(r"--output-dir (\S+)", body):
        runs = json.loads((folder / output_dir / "comparison.json").read_text())["runs"]
        statuses = {run["name"]: run["status"] for run in runs}
        assert statuses and set(statuses.values()) == {"ok"}, statuses
        assert (folder / output_dir / "report.html").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_runnable_blocks_run_as_written(tmp_path):
    blocks = runnable_blocks(README.read_text())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if any("DISTTRAIN_DATA_DIR" in body for _, body in blocks):
        data = find_real_data_dir()
        if data is None:
            pytest.skip("a README block reads MNIST and no copy is at hand (set DISTTRAIN_DATA_DIR)")
        env["DISTTRAIN_DATA_DIR"] = str(data)
    for file, body in blocks:
        if file is not None:
            (tmp_path / file).write_text(body)
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{body}\nexit {done.returncode}\n{done.stderr[-3000:]}"
        _outputs_finished(tmp_path, body)
