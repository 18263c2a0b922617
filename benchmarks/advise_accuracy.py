"""Calibration of `disttrain advise`: its predicted samples/s against measured runs.

For 1, 2 and 4 processes on this machine, the parameter server in sync mode (one shard)
and DDP (gloo) train SimpleCNN on synthetic 28x28 images (batch 128), one torch thread
per process, as `disttrain ps` and `disttrain ddp` subprocesses; each run's summary.json
gives the measured samples/s. The prediction is the cost model's (`disttrain.advise`)
for the same configuration, the link measured on this machine's loopback. The processes
of one run share this machine's cores, which a cluster's workers do not: the step is
timed just before each run (the machine is shared and its load drifts) in n processes
stepping at once, so that the model answers for this machine. Reported per run:
predicted, measured and the relative error (predicted / measured - 1); the target is
|error| <= 25%. Each run is predicted a second time given the compute per step its own
processes logged (`time/compute_s`, as `advise --step-time` takes another device's): that
error is the cost model's alone (communication, waits, overheads), without the drift of
a shared machine's speed between the timing and the run.

Then the simulation (the shard's own rules in virtual time, each worker with its share of
the data) against three runs of the parameter server with as many workers as cores (2 to
4), the last one three times slower (`--inject slow:worker=N-1:factor=3`): sync, sync
with one backup worker, SSP(2); compared are the samples computed per second, and the
share of the pushes the shard dropped (late, or stale).

Then limited links (`--links`, default 1 Gbit/s and 100 Mbit/s): three hosts made as
Linux network namespaces on one bridge (the multi-host tests' network, as
`benchmarks/slow_link.py` makes it: needs root and iproute2), every host's link limited
with `tc ... tbf` to the rate in both directions (the cost model gives every machine
the same link). The link is measured between two of the hosts with the advise probe
(`disttrain advise --serve` on one, `measure_link` from the other), and 2 workers train
on their own hosts, the parameter server's one shard (sync) or DDP's rendezvous and the
coordinator on the third: predicted against measured as above, with the link measured.
Where namespaces cannot be made, the section says why (`skipped`) and the rest runs.

--quick: 4,096 samples (32 steps in one process); full: 16,384. --processes 1
--processes-only: the single-process runs only (the test suite's smoke run; add
--links none to leave out the limited links too). --from-run-compute: predict each run
from its own logged compute only, without timing the step beforehand (the calibration
test: `tests/integration/test_advise_calibration.py` fails where a run's step falls
outside 25% of that prediction). Each run also reports its step time, predicted from its
compute and measured (`n · batch / samples per second`). `calibration_misses` lists the
runs whose measured step falls outside ±25% of the step predicted from their own compute
(the JSON's `calibration_misses`; the calibration test asserts it empty).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import parse_args, report
from slow_link import ACCURACY_97, run_one

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "multihost"))
from netns import Network, unavailable_reason, wait_for  # noqa: E402

from disttrain.advise import (  # noqa: E402
    Candidate,
    CostModel,
    Link,
    Prediction,
    SimulationSetup,
    StepTimes,
    measure_loopback,
    measure_workload,
    simulate,
)
from disttrain.config import load_config  # noqa: E402
from disttrain.core import new_token, write_token_file  # noqa: E402
from disttrain.metrics import read_metrics  # noqa: E402

PROCESS_COUNTS = (1, 2, 4)
BATCH_SIZE = 128
MODEL, DATASET = "simplecnn", "synthetic"  # 1x28x28: a step long enough that the per-step overheads
NUM_SAMPLES = {True: 4096, False: 16384}  # the model leaves out stay small beside it (--quick: True)
TARGET = 0.25


# One of `n` processes measuring the step at once: each builds its model, says it is ready,
# waits for the word, and measures while the others do (the cores shared as in the run).
MEASURE_ONE = """
import sys, torch
from disttrain.advise import measure_workload
from disttrain.config import load_config
config = load_config(None, {"training.model_architecture": sys.argv[1], "training.dataset": sys.argv[2],
                            "training.batch_size": int(sys.argv[3]), "system.num_threads": 1}, [])
measure_workload(config, repeats=1)
print("ready", flush=True)
sys.stdin.readline()
print(measure_workload(config, repeats=int(sys.argv[4])).compute_s, flush=True)
"""


def concurrent_step_s(num_processes: int, repeats: int) -> float:
    """Forward+backward seconds of one of `num_processes` processes stepping at once."""
    command = [sys.executable, "-c", MEASURE_ONE, MODEL, DATASET, str(BATCH_SIZE), str(repeats)]
    processes = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for _ in range(num_processes)]
    try:
        for process in processes:
            if process.stdout.readline().strip() != "ready":
                raise SystemExit("a measuring process failed")
        for process in processes:
            process.stdin.write("go\n")
            process.stdin.flush()
        return statistics.mean(float(process.stdout.readline()) for process in processes)
    finally:
        for process in processes:
            process.wait(timeout=300)


def predicted_samples_per_s(strategy: str, num_processes: int, model: CostModel, step_s: float) -> float:
    """The cost model's samples/s with each process's compute as measured beside the others."""
    return predicted_step(strategy, num_processes, model, step_s).samples_per_s


def predicted_step(strategy: str, num_processes: int, model: CostModel, step_s: float) -> Prediction:
    """The cost model's prediction with each process's compute `step_s` (forward+backward)."""
    shared = CostModel(model.workload.with_step_time(step_s), model.link, model.bucket_cap_bytes,
                       model.overlap)
    candidate = Candidate("ddp") if strategy == "ddp" else Candidate("ps-sync", "none", 1)
    return shared.predict(candidate, num_processes)


# The simulation against the real cluster: workers, the last of them 3x slower (the `slow`
# fault), under sync, sync with one backup worker, and SSP(2). As many workers as cores,
# from 2 to 4: the simulation's workers each have a machine of their own, and on shared
# cores the slowed worker's sleep would lend its core to the others, which no cluster does.
SIMULATED = {"sync_slow": ("sync", 0, 2), "sync_backup1_slow": ("sync", 1, 2), "ssp2_slow": ("ssp", 0, 2)}
SIMULATED_WORKERS = min(4, max(2, os.cpu_count() or 1))
SLOW_FACTOR = 3.0


def ps_flags(mode: str, backup_workers: int, staleness: int) -> list[str]:
    return ["--aggregation-mode", mode, "--backup-workers", str(backup_workers),
            "--staleness", str(staleness),
            "--inject", f"slow:worker={SIMULATED_WORKERS - 1}:factor={SLOW_FACTOR:g}"]


def simulated_run(mode: str, backup_workers: int, staleness: int, model: CostModel, step_s: float,
                  num_samples: int) -> tuple[float, float]:
    """Samples computed per second by the simulated run (what the run's summary counts),
    each worker with its share of the data as in the run; and the share of its pushes the
    rules dropped (late, or stale)."""
    n = SIMULATED_WORKERS
    workload = model.workload.with_step_time(step_s)
    shared = CostModel(workload, model.link, model.bucket_cap_bytes, model.overlap)
    strategy = "ps-sync" if mode == "sync" else "ps-async"
    trip = shared.round_trip(Candidate(strategy, "none", 1), n)
    steps = max(2, num_samples // (BATCH_SIZE * n))
    setup = SimulationSetup(mode, n, steps * n, staleness, backup_workers, BATCH_SIZE, steps_per_worker=steps)
    result = simulate(setup, StepTimes(step_s, straggler_fraction=1 / n, straggler_factor=SLOW_FACTOR), trip)
    return result.num_pushes * BATCH_SIZE / result.virtual_time_s, result.work_dropped_fraction


def measured_run(strategy: str, num_processes: int, num_samples: int, folder: Path,
                 extra: list[str] | None = None) -> dict:
    """The run's summary (summary.json)."""
    how = (["ddp", "--world-size", str(num_processes)] if strategy == "ddp"
           else ["ps", "--workers", str(num_processes), "--servers", "1",
                 *(extra or ["--aggregation-mode", "sync"])])
    command = [sys.executable, "-m", "disttrain", *how, "--model", MODEL, "--dataset", DATASET,
               "--batch-size", str(BATCH_SIZE), "--num-samples", str(num_samples), "--num-epochs", "1",
               "--num-threads", "1",
               "--log-dir", str(folder / "logs"), "--checkpoint-dir", str(folder / "ckpt")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(how)} failed:\n{done.stderr[-3000:]}")
    return json.loads((folder / "logs" / "summary.json").read_text())


def run_compute_s(folder: Path) -> float:
    """The median compute of a step (`time/compute_s`, a window's mean per record) as the
    run's own processes logged it."""
    values = [record["time/compute_s"] for path in sorted(folder.rglob("metrics.jsonl"))
              for record in read_metrics(path) if "time/compute_s" in record]
    return statistics.median(values)


def dropped_fraction(summary: dict, num_samples: int) -> float:
    """The share of a parameter-server run's pushes its shard dropped: late (backup
    workers) or stale (SSP)."""
    pushes = num_samples // BATCH_SIZE
    dropped = summary.get("samples_dropped_late", 0) / BATCH_SIZE + summary.get("num_rejected_stale", 0)
    return dropped / pushes


# The limited links: each host's link limited to the rate (tc tbf), 2 workers.
LINK_RATES = "1gbit,100mbit"
LINK_WORKERS = 2
LINK_CONFIGS = {"ps_sync": ("ps", ["--aggregation-mode", "sync"]), "ddp": ("ddp", [])}
PROBE_BYTES = {True: 4 * 2**20, False: 16 * 2**20}
MEASURE_LINK = """
import json, sys
from pathlib import Path
from disttrain.advise import measure_link
token = Path(sys.argv[3]).read_text().strip()
print(json.dumps(measure_link(sys.argv[1], token, num_bytes=int(sys.argv[2])).to_dict()))
"""


def probe_link(net: Network, folder: Path, num_bytes: int) -> Link:
    """The link between hosts b and a, measured by the advise probe: a probe server on a,
    the client on b."""
    a, b = net.hosts["a"], net.hosts["b"]
    log = folder / "probe.out"
    # A probe server beyond loopback needs a token, as a user's would.
    token = write_token_file(folder / "probe.token", new_token())
    a.start([sys.executable, "-m", "disttrain", "advise", "--serve", "--bind", f"{a.address}:0",
             "--token-file", str(token)], log)
    try:
        marker = "serving link probes on "
        line = wait_for(lambda: next((x for x in log.read_text().splitlines() if x.startswith(marker)), None),
                        60, "the probe server to listen")
        address = line[len(marker):].split()[0]
        measured = json.loads(b.run(sys.executable, "-c", MEASURE_LINK, address, str(num_bytes),
                                    str(token)).stdout)
    finally:
        a.stop_processes()
        a.processes.clear()
    return Link(measured["bandwidth_bytes_per_s"], measured["latency_s"], f"tbf {folder.name}")


def calibration_misses(document: dict, target: float = TARGET) -> list[str]:
    """The runs of a result `document` (as `main` writes it) whose measured step falls
    outside `target` of the step the cost model predicts from the compute the run's own
    processes logged, one line each (empty: every such run within it). Runs without that
    prediction (the simulated ones, predicted from a step timed before them; a limited
    link skipped or failed) are not checked here.

    The measured step is `n · batch / measured samples/s` and the predicted one `n · batch
    / predicted samples/s`, so the step's error is `predicted / measured samples/s - 1`.
    """
    misses = []
    for run in [*document["runs"], *(document.get("limited_links") or {}).get("runs", [])]:
        predicted, measured = run.get("predicted_from_run_compute"), run.get("measured_samples_per_s")
        if not predicted or not measured:
            continue
        error = predicted / measured - 1
        if abs(error) > target:
            where = f" on {run['rate']}" if "rate" in run else ""
            misses.append(f"{run['strategy']}, {run['num_processes']} processes{where}: measured step "
                          f"{error:+.1%} off the step predicted from the run's compute "
                          f"({run['run_compute_s']} s; predicted {predicted} samples/s, measured {measured})")
    return misses


def limited_link_runs(rates: list[str], model: CostModel, num_samples: int, repeats: int, quick: bool,
                      scratch: Path) -> dict:
    """Predicted against measured on each limited link: rates, runs, and why they were
    skipped (null when they ran)."""
    if not rates:
        return {"rates": [], "runs": [], "skipped": "--links none"}
    reason = unavailable_reason()
    if reason:
        print(f"advise_accuracy: limited links skipped: cannot make network namespaces here: {reason}",
              file=sys.stderr)
        return {"rates": rates, "runs": [], "skipped": f"cannot make network namespaces here: {reason}"}
    data = ["--model", MODEL, "--dataset", DATASET, "--batch-size", str(BATCH_SIZE),
            "--num-samples", str(num_samples), "--num-epochs", "1"]
    runs = []
    for rate in rates:
        with Network(["a", "b", "c"]) as net:
            for host in net.hosts.values():
                host.limit_rate(rate)
            folder = scratch / f"link-{rate}"
            folder.mkdir()
            link = probe_link(net, folder, PROBE_BYTES[quick])
            for name, (kind, flags) in LINK_CONFIGS.items():
                step_s = concurrent_step_s(LINK_WORKERS, max(5, repeats))
                shared = CostModel(model.workload.with_step_time(step_s), link, model.bucket_cap_bytes,
                                   model.overlap)
                candidate = Candidate("ddp") if kind == "ddp" else Candidate("ps-sync", "none", 1)
                predicted = shared.predict(candidate, LINK_WORKERS).samples_per_s
                run_folder = folder / name
                run_folder.mkdir()
                result = run_one(net, kind, flags, data, ACCURACY_97, run_folder)
                entry = {"rate": rate, "strategy": name, "num_processes": LINK_WORKERS,
                         "link": link.to_dict(), "step_s": round(step_s, 4),
                         "predicted_samples_per_s": round(predicted, 1), "status": result["status"]}
                if result["status"] == "ok":
                    error = predicted / result["samples_per_s"] - 1
                    logged_s = run_compute_s(run_folder)
                    given = CostModel(model.workload.with_step_time(logged_s), link, model.bucket_cap_bytes,
                                      model.overlap).predict(candidate, LINK_WORKERS).samples_per_s
                    entry.update(measured_samples_per_s=result["samples_per_s"], error=round(error, 3),
                                 within_target=abs(error) <= TARGET, run_compute_s=round(logged_s, 4),
                                 predicted_from_run_compute=round(given, 1),
                                 error_from_run_compute=round(given / result["samples_per_s"] - 1, 3))
                else:
                    entry["log_tails"] = result["log_tails"]
                runs.append(entry)
                print(f"{rate:>8} {name:<8} {entry}", file=sys.stderr, flush=True)
    return {"rates": rates, "runs": runs, "skipped": None}


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--processes", default=",".join(map(str, PROCESS_COUNTS)), metavar="N[,N...]",
                        help="process counts to run (default 1,2,4)")
    parser.add_argument("--processes-only", action="store_true", help="leave out the simulation's runs")
    parser.add_argument("--from-run-compute", action="store_true",
                        help="predict each run from its own logged compute only (no step timed before it)")
    parser.add_argument("--links", default=LINK_RATES, metavar="RATE[,RATE...]",
                        help=f"tc rates of the limited links to run on (default {LINK_RATES}); none: "
                             "leave them out")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], add_flags)
    counts = [int(part) for part in args.processes.split(",")]
    num_samples = NUM_SAMPLES[args.quick]
    config = load_config(None, {"training.model_architecture": MODEL, "training.dataset": DATASET,
                                "training.batch_size": BATCH_SIZE, "system.num_threads": 1}, [])
    link = measure_loopback()
    workload = measure_workload(config, repeats=1)  # sizes and compressors; the step is timed per run
    model = CostModel(workload, link, config.ddp.bucket_cap_mb * 2**20, config.ps.overlap)
    num_cores = os.cpu_count() or 1
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("ps_sync", "ddp"):
            for n in counts:
                folder = Path(tmp) / f"{strategy}{n}"
                if args.from_run_compute:
                    measured = measured_run(strategy, n, num_samples, folder)["throughput_samples_per_s"]
                    entry = {"strategy": strategy, "num_processes": n}
                else:
                    # measured again right before each run (the machine's load drifts), in n
                    # processes at once, as the run's n processes share the cores
                    step_s = concurrent_step_s(n, max(5, args.repeats))
                    predicted = predicted_samples_per_s(strategy, n, model, step_s)
                    measured = measured_run(strategy, n, num_samples, folder)["throughput_samples_per_s"]
                    error = predicted / measured - 1
                    entry = {"strategy": strategy, "num_processes": n, "step_s": round(step_s, 4),
                             "predicted_samples_per_s": round(predicted, 1), "error": round(error, 3),
                             "within_target": abs(error) <= TARGET}
                # the model again, given the compute the run's processes logged: its error is
                # the communication's and overheads' alone, the drift of the machine left out
                logged_s = run_compute_s(folder)
                given = predicted_step(strategy, n, model, logged_s)
                measured_step_s = n * BATCH_SIZE / measured
                entry.update({"measured_samples_per_s": round(measured, 1),
                              "run_compute_s": round(logged_s, 4),
                              "predicted_from_run_compute": round(given.samples_per_s, 1),
                              "error_from_run_compute": round(given.samples_per_s / measured - 1, 3),
                              "predicted_step_s": round(given.step_time_s, 4),
                              "measured_step_s": round(measured_step_s, 4),
                              "step_error_from_run_compute": round(measured_step_s / given.step_time_s - 1,
                                                                   3)})
                runs.append(entry)
        if not args.processes_only:
            for name, (mode, backups, staleness) in SIMULATED.items():
                step_s = concurrent_step_s(SIMULATED_WORKERS, max(5, args.repeats))
                predicted, predicted_dropped = simulated_run(mode, backups, staleness, model, step_s,
                                                             num_samples)
                summary = measured_run("ps", SIMULATED_WORKERS, num_samples, Path(tmp) / name,
                                       ps_flags(mode, backups, staleness))
                measured = summary["throughput_samples_per_s"]
                error = predicted / measured - 1
                runs.append({"strategy": f"simulated_{name}", "num_processes": SIMULATED_WORKERS,
                             "step_s": round(step_s, 4), "predicted_samples_per_s": round(predicted, 1),
                             "measured_samples_per_s": round(measured, 1), "error": round(error, 3),
                             "within_target": abs(error) <= TARGET,
                             "predicted_pushes_dropped": round(predicted_dropped, 3),
                             "measured_pushes_dropped": round(dropped_fraction(summary, num_samples), 3)})
        rates = [r for r in args.links.split(",") if r and r != "none"]
        limited = limited_link_runs(rates, model, num_samples, args.repeats, args.quick, Path(tmp))
    everything = [*runs, *limited["runs"]]
    failed = [r for r in limited["runs"] if r["status"] != "ok"]
    worst = max((abs(r["error"]) for r in everything if "error" in r), default=0.0)
    # the analytic runs given their own logged compute, the simulated ones as above
    worst_given = max((abs(r.get("error_from_run_compute", r.get("error", 0.0))) for r in everything),
                      default=0.0)
    misses = calibration_misses({"runs": runs, "limited_links": limited})
    report("advise_accuracy", {"quick": args.quick, "num_samples": num_samples, "num_cores": num_cores,
                               "link": link.to_dict(), "runs": runs, "limited_links": limited,
                               "calibration_misses": misses,
                               "max_abs_error": None if args.from_run_compute else round(worst, 3),
                               "all_within_target": None if args.from_run_compute
                               else worst <= TARGET and not failed,
                               "max_abs_error_from_run_compute": round(worst_given, 3),
                               "all_within_target_from_run_compute": worst_given <= TARGET and not failed},
           args.output, target=f"|predicted / measured - 1| <= {TARGET:.0%} for every run")
    if failed:
        raise SystemExit(f"{len(failed)} run(s) on the limited links failed: "
                         + ", ".join(f"{r['strategy']} at {r['rate']}" for r in failed))


if __name__ == "__main__":
    main()
