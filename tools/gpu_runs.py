"""What the GPU check's steps share: their context (device, folders, deadline, and the
result file each writes as it goes), `disttrain` runs through its command line as a user
runs them, and the comparison of two runs' final parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# GPU and CPU runs of one model differ by rounding only (TF32 is switched off for them):
# an all-reduce that summed instead of averaging, or missed a bucket, is off by far more.
PARAMETER_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}
EXACT = {"NVIDIA_TF32_OVERRIDE": "0"}  # no TF32 in cuBLAS and cuDNN: float32 means float32


@dataclass
class Context:
    """What a step runs with: the device type, where it writes, and until when it may run."""

    device: str
    work: Path
    result_path: Path
    deadline: float
    data: dict[str, Any] = field(default_factory=lambda: {"checks": {}})

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.write()

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.data["checks"][name] = {"ok": bool(ok), "detail": detail}
        self.write()
        return bool(ok)

    def failed(self) -> list[str]:
        return [name for name, c in self.data["checks"].items() if not c["ok"]]

    def write(self) -> None:
        partial = self.result_path.with_suffix(".part")
        partial.write_text(json.dumps(self.data, indent=2, default=str))
        partial.replace(self.result_path)


@dataclass
class Run:
    """One `python -m disttrain ...` run: its exit status, the end of its output, its summary."""

    name: str
    code: int
    wall_s: float
    output: str
    folder: Path

    @property
    def summary(self) -> dict[str, Any]:
        path = self.folder / "logs" / "summary.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def final_model(self, name: str) -> dict[str, torch.Tensor]:
        state = torch.load(self.folder / "ckpt" / name, map_location="cpu", weights_only=True)
        return state["model"]

    def training_losses(self) -> list[float]:
        """Rank 0's logged training loss (`loss/train`), one value per logging window."""
        path = self.folder / "logs" / "rank0" / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
            if path.is_file() else []
        return [record["loss/train"] for record in records if "loss/train" in record]

    def last_checkpoint(self) -> dict[str, Any]:
        paths = sorted((self.folder / "ckpt").glob("checkpoint_step*.pt"))
        return torch.load(paths[-1], map_location="cpu", weights_only=True) if paths else {}

    def figures(self) -> dict[str, Any]:
        summary = self.summary
        keys = ("backend", "device", "world_size", "steps", "final_loss", "final_accuracy", "throughput")
        figures = {key: summary.get(key) for key in keys if key in summary}
        figures.update(exit_code=self.code, wall_s=round(self.wall_s, 1))
        if self.code != 0:
            figures["output_tail"] = self.output[-1500:]
        return figures


def disttrain(name: str, args: list[str], folder: Path, timeout_s: float, env: dict[str, str] | None = None
              ) -> Run:
    """Run `python -m disttrain ARGS` with its logs and checkpoints under `folder`."""
    command = [sys.executable, "-m", "disttrain", *map(str, args),
               "--log-dir", str(folder / "logs"), "--checkpoint-dir", str(folder / "ckpt")]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(timeout_s, 1),
                              env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, output = 124, f"timed out after {timeout_s:.0f}s: {e.output or ''}{e.stderr or ''}"
    return Run(name, code, time.monotonic() - started, output if isinstance(output, str) else str(output),
               folder)


def run_all(ctx: Context, runs: dict[str, list[str]], env: dict[str, str] | None = None) -> dict[str, Run]:
    """Several disttrain runs at once, each in its own folder and stopped at the step's
    deadline: 8 at a time on a CUDA machine (16 cores), 2 under --cpu."""

    def one(name: str, args: list[str]) -> Run:
        return disttrain(name, args, ctx.work / name, ctx.left_s() - 5, env)

    with ThreadPoolExecutor(8 if ctx.cuda else 2) as pool:
        futures = {name: pool.submit(one, name, args) for name, args in runs.items()}
        return {name: future.result() for name, future in futures.items()}


def compare_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The largest absolute and relative difference between two state dicts' float tensors,
    and whether every tensor is within PARAMETER_TOLERANCE."""
    if a.keys() != b.keys():
        return {"same_keys": False, "within_tolerance": False}
    worst_abs = worst_rel = 0.0
    close = True
    for key in a:
        x, y = a[key].double(), b[key].double()
        if not x.is_floating_point():
            close = close and torch.equal(x, y)
            continue
        difference = (x - y).abs()
        worst_abs = max(worst_abs, float(difference.max()) if difference.numel() else 0.0)
        worst_rel = max(worst_rel, float((difference / y.abs().clamp_min(1e-6)).max()) if difference.numel()
                        else 0.0)
        close = close and torch.allclose(x, y, **PARAMETER_TOLERANCE)
    return {"same_keys": True, "max_abs_diff": worst_abs, "max_rel_diff": worst_rel,
            "within_tolerance": close, "tolerance": PARAMETER_TOLERANCE}
