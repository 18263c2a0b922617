"""Shared fixtures: the real-data folder (skip when absent), a CLI runner, thread limits,
the check of a benchmark's JSON keys, the test's S3 server (moto's) and a bucket on it."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launched import Launched

from disttrain import cli
from disttrain.core import forking
from disttrain.core.processes import PARENT_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
# The tests' fork server (`run_cli`) imports what the commands' children import, once, as a
# launcher's does (importing `disttrain.cli` asks for it already; said here where it is relied on).
forking.preload(*cli.CHILD_MODULES)
# The marks of a variant of a capability the suite already runs end to end (another
# compressor, mode or rank on the same path): make test-extended runs it, make test does not.
VARIANT = (pytest.mark.slow, pytest.mark.extended)

torch.set_num_threads(1)
# Every process a test starts runs one OpenMP thread by default (each sets its own intra-op
# count; this is what its other threads start from), as the DDP launcher gives two ranks on
# these 2 cores: so the fork servers the tests' runs are forked from share the ranks'
# start-up settings, and a DDP run's ranks are forked rather than new interpreters.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tests that start ranks of a process group themselves start them from multiprocessing's
# fork server (`start_method="forkserver"`): one new interpreter a test process imports torch
# and the project once, and each rank is a fork of it, where each spawned rank imported them
# again (seconds of CPU a rank).
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", *cli.CHILD_MODULES])


def find_real_data_dir() -> Path | None:
    """MNIST/Fashion-MNIST IDX files: $DISTTRAIN_DATA_DIR, else ./data or ../shared/data
    beside the checkout. None when no copy is at hand (tests needing it skip)."""
    candidates = [os.environ.get("DISTTRAIN_DATA_DIR"), REPO_ROOT / "data",
                  REPO_ROOT.parent / "shared" / "data"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "mnist" / "train-images-idx3-ubyte.gz").is_file():
            return Path(candidate)
    return None


@pytest.fixture
def real_data_dir() -> Path:
    found = find_real_data_dir()
    if found is None:
        pytest.skip("no MNIST copy at hand (set DISTTRAIN_DATA_DIR)")
    return found


@pytest.fixture
def mnist_or_digits() -> list:
    """Flags that train on real MNIST when a copy is at hand, else on the shipped digits."""
    found = find_real_data_dir()
    return ["--data-dir", found] if found else ["--dataset", "digits"]


def run_cli(*args: str, timeout: float = 240, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `python -m disttrain ARGS` in a process of its own, forked from the fork server
    as launchers start their children (torch imported once for the test process, not once
    a run: `disttrain.core.forking`, whose tests show a forked child runs as a new
    interpreter would; `DISTTRAIN_FORK_SERVER=0` runs each as a new interpreter); capture
    its output. A run past `timeout` fails the test with the end of what it printed and of
    each log in its `--log-dir` (a hang must say where it hung)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    command = [sys.executable, "-m", "disttrain", *map(str, args)]
    try:
        if forking.forking():
            return _run_forked(command, full_env, cwd, timeout)
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"disttrain {' '.join(map(str, args))} ran past {timeout}s\n{_hang_report(args, e)}")


def _run_forked(command: list[str], env: dict[str, str], cwd: Path | None,
                timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, ...)` with the process forked."""
    process = Launched(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, cwd=cwd,
                       parent_env=PARENT_ENV if PARENT_ENV in env else None)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise subprocess.TimeoutExpired(command, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _hang_report(args, error: subprocess.TimeoutExpired) -> str:
    def tail(text, lines: int = 25) -> str:
        text = text.decode(errors="replace") if isinstance(text, bytes) else (text or "")
        return "\n".join(text.splitlines()[-lines:])

    parts = [f"--- its stderr ---\n{tail(error.stderr)}"]
    args = list(map(str, args))
    if "--log-dir" in args and args.index("--log-dir") + 1 < len(args):
        for log in sorted(Path(args[args.index("--log-dir") + 1]).glob("*.log")):
            parts.append(f"--- {log.name} ---\n{tail(log.read_text(errors='replace'))}")
    return "\n".join(parts)


@pytest.fixture
def cli():
    return run_cli


def run_ddp(folder: Path, *args, timeout: float = 250) -> dict:
    """`disttrain ddp ARGS` with its logs and checkpoints in `folder`: asserts it succeeded
    and returns its summary."""
    result = run_cli("ddp", *args, "--log-dir", folder / "logs", "--checkpoint-dir", folder / "ckpt",
                     timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "logs" / "summary.json").read_text())


def assert_full_run_keys(folder: Path) -> None:
    """The benchmark JSON in `folder` (a quick run's) has the keys of the full run's, at every
    level, as recorded in benchmarks/shapes.json (tools/bench_shapes.py)."""
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_shapes.py"), str(folder)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def moto_port():
    """A real S3-compatible server (moto's) for the module, on a free port; skipped with the
    reason where it cannot start."""
    from s3_server import start_moto, stop_moto
    try:
        process, port = start_moto()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"no S3-compatible server could start: {e}")
    yield port
    stop_moto(process)


@pytest.fixture
def bucket(moto_port, monkeypatch):
    """A fresh bucket, which this process reaches as the runs do."""
    from s3_runs import new_bucket, point_at
    point_at(moto_port, monkeypatch)
    return new_bucket(moto_port)


@pytest.fixture
def tool(monkeypatch):
    """Imports a script of tools/ by name, for this test only: each is dropped from
    `sys.modules` after it, so the next test imports it afresh."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tools"))
    names: list[str] = []

    def load(name: str):
        names.append(name)
        return importlib.import_module(name)

    yield load
    for name in names:
        sys.modules.pop(name, None)

