"""Shared plumbing of the benchmark scripts: arguments, repeated timing, JSON output.

Every benchmark measures a ratio against a baseline timed in the same run, because the
machines are shared and noisy; absolute figures are reported beside it for context.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output", type=Path, help="write the JSON result here too")
    parser.add_argument("--repeats", type=int, help="timed repetitions per variant (default 5; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and one repeat, the full run's "
                        "JSON keys: minutes, for a look or a smoke test (make bench-quick)")
    if extra:
        extra(parser)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    return args


def time_interleaved(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Time each variant `repeats` times, interleaving them (A B A B ...) so that drift in
    the machine's load hits every variant alike. Returns seconds per run, per variant."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def environment() -> dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "machine": platform.machine(), "torch_threads": torch.get_num_threads()}


def report(name: str, result: dict[str, Any], output: Path | None, target: str | None = None) -> None:
    """Print the result as JSON and write it to `output` when given."""
    payload = {"benchmark": name, **result, "environment": environment()}
    if target:
        payload["target"] = target
    text = json.dumps(payload, indent=2)
    print(text)
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")
    sys.stdout.flush()
