"""The steps of the GPU check, one per run of this script (tools/gpu_check.py runs each in
its own process, under a timeout, and gathers their results into one JSON).

    python tools/gpu_steps.py NAME --device cuda|cpu --result FILE --work DIR [--budget-s S]

Each step writes its figures and checks to FILE as it goes (so a step stopped by its
timeout still leaves what it measured), and exits 1 when a check failed. `--device cpu`
runs the same logic on the CPU with tiny sizes, where a step has a CPU counterpart (the
NCCL run becomes gloo's `auto`; fp16, which needs CUDA, must be refused in one line).
The steps live here and beside it: `gpu_ddp` (ddp_backends, precision), `gpu_ps_wire`,
`gpu_workloads`; their shared parts in `gpu_runs`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gpu_ddp
import torch
from gpu_runs import Context

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS: dict[str, Callable[[Context], None]] = {"ddp_backends": gpu_ddp.ddp_backends,
                                                 "precision": gpu_ddp.precision}


def step(fn: Callable[[Context], None]) -> Callable[[Context], None]:
    STEPS[fn.__name__] = fn
    return fn


@step
def environment(ctx: Context) -> None:
    """What the machine is: torch, CUDA, cuDNN, NCCL, the devices; the carried packages import."""
    host: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cpu_count": os.cpu_count(),
                            "cuda_available": torch.cuda.is_available()}
    if ctx.cuda:
        nccl = torch.cuda.nccl.version()  # a tuple; an int in older torch
        host.update(cudnn=torch.backends.cudnn.version(),
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                    device_count=torch.cuda.device_count(), bf16_supported=torch.cuda.is_bf16_supported(),
                    devices=[{"name": p.name, "capability": f"{p.major}.{p.minor}",
                              "memory_gib": round(p.total_memory / 2**30, 1)}
                             for p in map(torch.cuda.get_device_properties,
                                          range(torch.cuda.device_count()))])
        host["device_name"] = host["devices"][0]["name"] if host["devices"] else None
    ctx.put("host", host)
    versions = {}
    for module in ("grpc", "grpc_health.v1.health", "google.protobuf", "tenacity", "shtab", "cryptography",
                   "numpy", "yaml", "tensorboard", "disttrain.cli"):
        try:
            versions[module] = getattr(importlib.import_module(module), "__version__", "imported")
        except Exception as e:  # any import failure is what this check reports
            versions[module] = f"error: {type(e).__name__}: {e}"
    ctx.put("packages", versions)
    ctx.check("packages_import", not any(str(v).startswith("error") for v in versions.values()),
              [m for m, v in versions.items() if str(v).startswith("error")])
    if ctx.cuda:
        a = torch.randn(256, 256, dtype=torch.float64)
        on_gpu = (a.cuda() @ a.cuda()).cpu()
        ctx.check("kernels_run", torch.allclose(on_gpu, a @ a), "a float64 matrix product on the GPU")
        try:
            smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            smi = f"error: {e}"
        ctx.put("nvidia_smi", smi)
    gpu = host.get("devices", [{}])[0] if ctx.cuda else {}
    ctx.put("summary", f"{gpu.get('name', 'cpu')} (capability {gpu.get('capability', '-')}), torch "
                       f"{torch.__version__}, CUDA {host['cuda']}, NCCL {host.get('nccl', '-')}; "
                       f"{'packages import' if not ctx.failed() else 'FAILED: ' + ', '.join(ctx.failed())}")


def gpu_test_files() -> list[str]:
    """The test files that hold a test marked `gpu`."""
    return sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in path.read_text())


@step
def gpu_tests(ctx: Context) -> None:
    """pytest -m gpu over the files holding such tests; per-test outcomes from its JUnit XML."""
    files, junit = gpu_test_files(), ctx.work / "junit.xml"
    ctx.put("files", files)
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
               "-p", "no:randomly", "--timeout", "150", f"--junitxml={junit}",
               "--continue-on-collection-errors",
               *(["-n", "3", "--dist", "loadfile"] if ctx.cuda else []), *files]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(ctx.left_s() - 5, 1),
                              cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, output = 124, f"pytest timed out: {e.stdout or ''}"
    ctx.put("pytest_exit_code", code)
    ctx.put("pytest_tail", output[-3000:] if isinstance(output, str) else str(output)[-3000:])
    tests: dict[str, str] = {}
    if junit.is_file():
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            outcome = next(((child.tag, child.get("message", "")) for child in case
                            if child.tag in ("failure", "error", "skipped")), ("passed", ""))
            tests[f"{case.get('classname')}::{case.get('name')}"] = ": ".join(filter(None, outcome))
    ctx.put("tests", tests)
    counts = {kind: sum(1 for o in tests.values() if o.split(":")[0] == kind)
              for kind in ("passed", "failure", "error", "skipped")}
    ctx.put("counts", counts)
    ctx.check("collected", bool(tests), f"{len(tests)} tests marked gpu in {len(files)} files")
    ctx.check("no_failures", code in (0, 5) and not counts["failure"] and not counts["error"],
              f"pytest exit {code}")
    if ctx.cuda:
        ctx.check("none_skipped", not counts["skipped"], "with a GPU every gpu test runs")
    else:
        ctx.check("all_skip_with_a_reason", counts["skipped"] == len(tests) and all(
            o.split(":", 1)[-1].strip() for o in tests.values()),
            "without CUDA every gpu test skips, saying why")
    ctx.put("summary", f"{counts['passed']} passed, {counts['failure']} failed, {counts['error']} errors, "
                       f"{counts['skipped']} skipped of {len(tests)}")


@step
def ps_wire(ctx: Context) -> None:
    """Gradients pushed from device tensors to a real shard server, parameters pulled into
    device tensors: checked against the SGD update, timed against the same on the CPU."""
    from gpu_ps_wire import exchange  # beside this file: it needs the gRPC stack the install brings

    hidden = 2048 if ctx.cuda else 128
    devices = ["cuda", "cpu"] if ctx.cuda else ["cpu"]
    results = {}
    for transport in ("grpc", "auto"):
        for device in devices:
            key = f"{transport}_{device}"
            results[key] = exchange(ctx.work / key, torch.device(device), transport, hidden)
            ctx.put("exchanges", results)
            ctx.check(f"{key}_exact", results[key]["matches"], {k: v for k, v in results[key].items()
                                                                if k != "matches"})
    if ctx.cuda:
        for transport in ("grpc", "auto"):
            results[f"{transport}_cuda_over_cpu"] = results[f"{transport}_cuda"]["gb_per_s"] / \
                results[f"{transport}_cpu"]["gb_per_s"]
        ctx.put("exchanges", results)
    ctx.put("summary", "; ".join(f"{k} {v['gb_per_s']:.2f} GB/s ({v['parameters']:,} floats)"
                                 for k, v in results.items() if isinstance(v, dict)))


@step
def workloads(ctx: Context) -> None:
    from gpu_workloads import run_workloads  # beside this file
    run_workloads(ctx)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(STEPS))
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=120.0)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    ctx = Context(args.device, args.work, args.result, time.monotonic() + args.budget_s - 3)
    ctx.write()
    STEPS[args.name](ctx)
    failed = ctx.failed()
    if failed:
        print(f"{args.name}: failed checks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
