"""Plumbing shared by the parameter-server benchmarks: configs, servers, helper processes.

A benchmark script runs its own helper roles (a worker, a gloo rank, an echo server) by
starting itself again with `--role NAME --rank R`; each helper writes its result as JSON
to a file the parent reads. Every process runs with one torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from disttrain.config import Config, config_from_dict
from disttrain.core import Cluster
from disttrain.strategies.ps import start_servers

REPO_ROOT = Path(__file__).resolve().parents[1]
# An MLP whose parameters take 10.5 MB: 784*1270 + 1270*1270 + 1270*10 weights, plus biases.
TEN_MB_HIDDEN = 1270


def data_dir() -> Path | None:
    """MNIST beside the checkout or in $DISTTRAIN_DATA_DIR, or None (then: synthetic data)."""
    for candidate in (
        os.environ.get("DISTTRAIN_DATA_DIR"),
        REPO_ROOT / "data",
        REPO_ROOT.parent / "shared" / "data",
    ):
        if candidate and (Path(candidate) / "mnist" / "train-images-idx3-ubyte.gz").is_file():
            return Path(candidate)
    return None


def make_config(folder: Path, model: str = "simplecnn", training: dict[str, Any] | None = None,
                **system: Any) -> Config:
    """A PS config for benchmarks: MNIST when at hand (synthetic otherwise), one thread
    per process, no checkpoints during the run. `training` overrides training keys;
    `system` takes system keys and the original config's `system.aggregation_mode`."""
    found = data_dir()
    base = {
        "dataset": "mnist" if found else "synthetic",
        "data_dir": str(found or "data"),
        "model_architecture": model,
        "mlp_hidden_size": TEN_MB_HIDDEN,
        "optimizer": "adam",
        "checkpoint_interval": 10**9,
        "batch_size": 64,
    }
    defaults = {"num_threads": 1, "checkpoint_dir": str(folder / "ckpt"), "log_dir": str(folder / "logs")}
    return config_from_dict({"training": {**base, **(training or {})}, "system": {**defaults, **system}})


def servers(cluster: Cluster, config: Config, folder: Path) -> list[str]:
    """Start the config's shard servers; return their addresses."""
    path = folder / "config.yaml"
    config.save(path)
    return start_servers(cluster, path, config.ps.num_servers)


def run_roles(script: str, role: str, count: int, args: list[str], timeout_s: float = 600) -> list[dict]:
    """Run `count` copies of `script --role ROLE --rank R ARGS`; return their JSON results.

    Raises:
        RuntimeError: a helper failed (its stderr is included).
    """
    with tempfile.TemporaryDirectory() as tmp:
        outputs = [Path(tmp) / f"{role}{rank}.json" for rank in range(count)]
        processes = [
            subprocess.Popen(
                [sys.executable, script, "--role", role, "--rank", str(rank), "--result", str(out), *args],
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank, out in enumerate(outputs)
        ]
        try:
            for process in processes:
                _, stderr = process.communicate(timeout=timeout_s)
                if process.returncode != 0:
                    raise RuntimeError(f"{role} helper failed ({process.returncode}): {stderr[-2000:]}")
        finally:
            for process in processes:
                process.kill()
        return [json.loads(out.read_text()) for out in outputs]


ROLE_FLAGS = {
    "--role": str,
    "--rank": int,
    "--result": str,
    "--config": str,
    "--servers": str,
    "--store": str,
    "--nbytes": int,
    "--steps": int,
}


def role_flags(parser: argparse.ArgumentParser) -> None:
    """The hidden flags that helper roles of a benchmark script are started with."""
    for flag, type_ in ROLE_FLAGS.items():
        parser.add_argument(flag, type=type_, help=argparse.SUPPRESS)


def write_result(path: str, result: dict) -> None:
    Path(path).write_text(json.dumps(result))


def file_store(folder: Path) -> str:
    """An init_method for torch.distributed that needs no port."""
    return f"file://{folder / 'store'}"


def one_thread() -> None:
    torch.set_num_threads(1)


def exit_rank() -> None:
    """Leave a gloo rank's process without the interpreter's shutdown, once its result is
    written: gloo's threads may still drop a finished collective's tensors, which aborts
    the process during shutdown now and then (see `disttrain.cli.ddp.module_main`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
