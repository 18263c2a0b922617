"""The GPU check: every CUDA path of disttrain run once, in one go, written to one JSON.

GPUs come rarely and for minutes, so this runs start to end without anything to prepare
there and without a network: it installs the wheels that `tools/gpu_wheels.sh` fetched
into `.whl/` (what the GPU machine's image lacks), then runs each step of
`tools/gpu_steps.py` in its own process under a timeout, within one time budget:

    environment    torch, CUDA, NCCL and the device as the machine reports them
    gpu_tests      every test marked `gpu` (pytest -m gpu)
    ddp_backends   DDP over NCCL against the same run over gloo: final parameters compared
    precision      fp16 with its gradient scaler and bf16 against float32, on the GPU
    ps_wire        CUDA tensors pushed to and pulled from a real parameter-server shard
    workloads      ResNet-18 and gpt_small samples/s: each strategy against a plain
                   single-GPU loop timed in the same run

A step that fails or runs out of time is recorded and the next one runs; the JSON is
rewritten after every step, so whatever ran is there even if the whole run is stopped.

Without a CUDA device it says so in one line and exits 0. `--cpu` runs the same steps on
the CPU with tiny sizes: the proof, on any machine, that every step's own logic works.

    tools/gpu_check.sh                      # JSON to $OUT/gpu_check.json, else runs/gpu_check/
    tools/gpu_check.sh --cpu --output /tmp/gpu_check.json

Exit status: 0 when every step that ran passed (or when there is no CUDA device), 1 otherwise.
This file uses the standard library only: it must run before anything is installed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS_SCRIPT = REPO_ROOT / "tools" / "gpu_steps.py"
DEFAULT_BUDGET_S = 420.0   # the whole check; the machine's session also pays its start
CPU_BUDGET_S = 900.0       # --cpu: two shared cores run what sixteen and a GPU run in minutes
PROBE_TIMEOUT_S = 90.0     # importing torch and starting CUDA
INSTALL_TIMEOUT_S = 90.0
MIN_STEP_S = 20.0          # a step with less left than this is not started
KILL_GRACE_S = 5           # after its timeout a step gets SIGTERM, then SIGKILL this much later
TAIL_CHARS = 2500          # a failed step's output kept in the JSON

PROBE = """
import json, sys
import torch
cuda = torch.cuda.is_available()
print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__,
                  "cuda_available": cuda, "device_count": torch.cuda.device_count() if cuda else 0}))
"""


@dataclass(frozen=True)
class Step:
    name: str
    timeout_s: float  # the most this step may take (less when less of the budget is left)
    cpu_timeout_s: float  # the same under --cpu
    what: str


STEPS = (
    Step("environment", 45, 60, "torch, CUDA, NCCL and the device"),
    Step("gpu_tests", 150, 120, "every test marked gpu"),
    Step("ddp_backends", 100, 300, "DDP over NCCL against the same run over gloo"),
    Step("precision", 100, 180, "fp16 with its gradient scaler and bf16 against float32"),
    Step("ps_wire", 60, 60, "CUDA tensors through a real parameter-server shard"),
    Step("workloads", 240, 420, "ResNet-18 and gpt_small samples/s against a plain single-GPU loop"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="run every step on the CPU with tiny sizes (the dry run of the steps' logic)")
    parser.add_argument("--output", type=Path, default=None,
                        help="the JSON file (default: $OUT/gpu_check.json, else "
                             "runs/gpu_check/gpu_check.json)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole check, probe and install included "
                             f"(default {DEFAULT_BUDGET_S:g}; --cpu: {CPU_BUDGET_S:g})")
    parser.add_argument("--steps", default=",".join(step.name for step in STEPS),
                        help="the steps to run, comma-separated (default: all, in order)")
    parser.add_argument("--wheels", type=Path, default=REPO_ROOT / ".whl",
                        help="the wheels to install on a CUDA machine (tools/gpu_wheels.sh fetches them)")
    parser.add_argument("--site", type=Path, default=Path("/tmp/disttrain-gpu-site"),
                        help="where they are installed (put first on PYTHONPATH)")
    parser.add_argument("--work", type=Path, default=None,
                        help="the steps' runs, logs and checkpoints (default: a new temporary folder; "
                             "kept apart from the JSON, which may be all that comes back)")
    args = parser.parse_args(argv)
    known = {step.name for step in STEPS}
    unknown = [name for name in args.steps.split(",") if name not in known]
    if unknown:
        parser.error(f"--steps: unknown step(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.budget_s is None:
        args.budget_s = CPU_BUDGET_S if args.cpu else DEFAULT_BUDGET_S
    if args.output is None:
        args.output = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else \
            REPO_ROOT / "runs" / "gpu_check" / "gpu_check.json"
    return args


class Report:
    """The one JSON file: rewritten whole (atomically) after every step."""

    def __init__(self, path: Path, work: Path, mode: str, budget_s: float):
        self.path = path
        self.work = work
        self.started = time.monotonic()
        self.data: dict = {"check": "gpu_check", "mode": mode, "budget_s": budget_s, "work": str(work),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": {}, "steps": {}}

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def write(self) -> None:
        steps = self.data["steps"].values()
        self.data["total_s"] = round(self.elapsed(), 1)
        self.data["passed"] = all(s["status"] in ("passed", "skipped") for s in steps)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".json.part")
        partial.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        partial.replace(self.path)


def run_bounded(command: list[str], timeout_s: float, env: dict[str, str], log: Path) -> tuple[int, bool]:
    """Run `command` under coreutils' `timeout` (SIGTERM, then SIGKILL), its output to
    `log`. Returns (exit status, timed out). A Python-side limit backs the `timeout` up."""
    bounded = ["timeout", "-k", str(KILL_GRACE_S), str(max(1, int(timeout_s))), *command]
    with log.open("w") as out:
        try:
            done = subprocess.run(bounded, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                  stdin=subprocess.DEVNULL, timeout=timeout_s + KILL_GRACE_S + 10)
        except subprocess.TimeoutExpired:
            return 137, True
    return done.returncode, done.returncode in (124, 137)


def tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-TAIL_CHARS:]
    except OSError:
        return ""


def probe(python: str, env: dict[str, str]) -> dict:
    """torch's view of this machine, from a fresh process (never this one: it must not hang)."""
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, env=env,
                              timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"importing torch took over {PROBE_TIMEOUT_S:g}s"}
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def install(report: Report, args: argparse.Namespace, python: str, env: dict[str, str]) -> None:
    """pip install the carried wheels into `args.site`, offline, without their dependencies."""
    wheels = sorted(glob.glob(str(args.wheels / "*.whl")))
    entry: dict = {"wheels": [Path(w).name for w in wheels], "site": str(args.site)}
    report.data["steps"]["install"] = entry
    if not wheels:
        entry.update(status="skipped", duration_s=0.0,
                     summary=f"no wheels in {args.wheels}: the machine's own packages are used")
        return
    log = report.work / "install.log"
    started = time.monotonic()
    code, timed_out = run_bounded([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                   "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(args.site),
                                   *wheels], INSTALL_TIMEOUT_S, env, log)
    entry.update(status="passed" if code == 0 else ("timed_out" if timed_out else "failed"),
                 duration_s=round(time.monotonic() - started, 1),
                 summary=f"{len(wheels)} wheels into {args.site}" if code == 0 else f"pip exit {code}")
    if code != 0:
        entry["output_tail"] = tail(log)


def run_step(report: Report, step: Step, args: argparse.Namespace, python: str, env: dict[str, str],
             work: Path) -> None:
    entry: dict = {"what": step.what}
    report.data["steps"][step.name] = entry
    left = args.budget_s - report.elapsed()
    if left < MIN_STEP_S:
        entry.update(status="not_run", duration_s=0.0,
                     summary=f"{left:.0f}s of the {args.budget_s:g}s budget left")
        return
    timeout_s = min(step.cpu_timeout_s if args.cpu else step.timeout_s, left)
    result, log = work / f"{step.name}.json", work / f"{step.name}.log"
    command = [python, str(STEPS_SCRIPT), step.name, "--device", "cpu" if args.cpu else "cuda",
               "--result", str(result), "--work", str(work / step.name), "--budget-s", str(int(timeout_s))]
    started = time.monotonic()
    code, timed_out = run_bounded(command, timeout_s, env, log)
    figures = {}
    if result.is_file():  # written by the step as it goes: present even when it was stopped
        try:
            figures = json.loads(result.read_text())
        except json.JSONDecodeError:
            figures = {"unreadable": result.read_text()[-500:]}
    status = "timed_out" if timed_out else ("passed" if code == 0 else "failed")
    entry.update(status=status, duration_s=round(time.monotonic() - started, 1), timeout_s=round(timeout_s),
                 exit_code=code, summary=figures.pop("summary", ""), figures=figures)
    if status != "passed":
        entry["output_tail"] = tail(log)


def print_summary(report: Report) -> None:
    data = report.data
    host = data["host"]
    print(f"\ngpu_check ({data['mode']}): {host.get('device_name') or host.get('error') or 'cpu'}, "
          f"torch {host.get('torch', '?')}, {data['total_s']:.0f}s of {data['budget_s']:g}s")
    for name, entry in data["steps"].items():
        print(f"  {name:<13} {entry['status']:<9} {entry.get('duration_s', 0):6.1f}s  "
              f"{entry.get('summary', '')}")
    print(f"{'PASSED' if data['passed'] else 'FAILED'}: {report.path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    python = sys.executable
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    source = str(REPO_ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    host = probe(python, env)
    if not args.cpu and not host.get("cuda_available"):
        why = host.get("error") or f"torch {host.get('torch')} sees none"
        print(f"gpu_check: no CUDA device here ({why}); nothing to check (--cpu runs the steps on the CPU)")
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    report = Report(args.output, work, "cpu" if args.cpu else "cuda", args.budget_s)
    report.data["host"] = host
    if args.cpu:
        report.data["steps"]["install"] = {"status": "skipped", "duration_s": 0.0,
                                           "summary": "--cpu: this environment's packages"}
    else:
        install(report, args, python, env)
        if report.data["steps"]["install"]["status"] == "passed":
            env["PYTHONPATH"] = os.pathsep.join((str(args.site), env["PYTHONPATH"]))
    report.write()
    wanted = args.steps.split(",")
    for step in STEPS:
        if step.name not in wanted:
            continue
        print(f"gpu_check: {step.name} ({step.what}) ...", flush=True)
        run_step(report, step, args, python, env, work)
        entry = report.data["steps"][step.name]
        print(f"gpu_check: {step.name} {entry['status']} in {entry['duration_s']:.1f}s  {entry['summary']}",
              flush=True)
        if step.name == "environment":
            host.update(entry.get("figures", {}).get("host", {}))
        report.write()
    print_summary(report)
    return 0 if report.data["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
