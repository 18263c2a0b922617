"""torchft beside disttrain's live DDP recovery, on one drill: three replicas train the
shipped digits MLP on fixed global batches, replica 1 is SIGKILLed at step 10 and started
again at once; replica 0 straggles (each step's work takes 10 times as long) so the run
outlasts the new process starting up.

disttrain: `disttrain ddp --ddp-recovery live` with `--inject kill:rank=1:step=10`; the
figures come from its summary (the ledger, `live_recoveries`, `rank_pids`).

torchft (PyPI `torchft`, optional: measured only where it imports; never a dependency of
disttrain): a `LighthouseServer` in this process; per replica a `Manager` (synchronous
quorum, so a healed replica trains the step it joins), a reconfigurable
`ProcessGroupGloo`, torchft's `DistributedDataParallel`, and healing from a live peer
(torchft's HTTP checkpoint transport). Global batch `s` is the batch of the manager's
step `s`, split evenly over the step's participants; a replica logs each step it applied
(`should_commit` True) with its samples, and the ledger counts every sample of every
global batch across those logs, as disttrain's does.

Measured for both, `--repeats` times, interleaved: whether the survivors were restarted
(their process ids), from the killed process's exit (as its parent saw it) to the
survivors training again (`resume_s`: the re-formed group ready; torchft also the first
step the survivors applied), from the new process's start to the group training with it
(`rejoin_s`), from the kill to that, and the ledger (samples applied, lost, applied twice).

    python benchmarks/torchft_drill.py --repeats 3 --output benchmarks/results/torchft_drill.json

Run it with an interpreter where both disttrain and torchft import (torchft 0.2.0 wants
torch >= 2.7 and the OpenTelemetry SDK); without torchft, only disttrain is measured and
the JSON says why.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from common import parse_args, report

WORLD_SIZE, BATCH, SEED, LR = 3, 16, 1, 0.003
KILLED, KILL_STEP, STRAGGLER, FACTOR = 1, 10, 0, 10.0
HEARTBEAT_S, HEARTBEAT_TIMEOUT_S = 0.2, 1.0  # disttrain's coordinator; torchft's lighthouse alike
# How long torchft's lighthouse waits for a live replica that has not asked to join a step's
# quorum (its default): set to the heartbeat timeout, it left the straggler out of a quorum
# at a step that took it longer, and the others finished the run without it.
JOIN_TIMEOUT_S = 60.0
COLLECTIVE_TIMEOUT_S = 60
RUN_TIMEOUT_S = 900


def torchft_absent() -> str | None:
    """Why torchft cannot be measured here (None: it imports)."""
    try:
        import torchft  # noqa: F401
        from torchft import DistributedDataParallel, Manager, ProcessGroupGloo  # noqa: F401
        from torchft.coordination import LighthouseServer  # noqa: F401
    except Exception as error:  # an absent package, or one of its imports failing
        return f"torchft does not import: {type(error).__name__}: {error}"
    return None


def torchft_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torchft")
    except PackageNotFoundError:
        return None


# -- the data both runs train on -----------------------------------------------------

def digits():
    from disttrain.config import TrainingConfig
    from disttrain.data import load_datasets
    training = TrainingConfig(dataset="digits", model_architecture="mlp", learning_rate=LR)
    train, test = load_datasets(training)
    return training, train, test


def steps_per_epoch(num_train: int) -> int:
    return num_train // (BATCH * WORLD_SIZE)


def global_batch(step: int, num_train: int) -> tuple[int, list[int]]:
    """Step `step`'s global batch: (epoch, sample indices), from a shuffle of (SEED, epoch);
    an epoch's tail (less than a global batch) is left out, as disttrain's live mode does."""
    import torch
    per_epoch = steps_per_epoch(num_train)
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(num_train, generator=torch.Generator().manual_seed(SEED * 1000 + epoch))
    size = BATCH * WORLD_SIZE
    return epoch, order[index * size:(index + 1) * size].tolist()


def shard(indices: list[int], rank: int, num: int) -> list[int]:
    """Rank `rank` of `num`'s piece of a global batch: even contiguous pieces."""
    base, extra = divmod(len(indices), num)
    start = rank * base + min(rank, extra)
    return indices[start:start + base + (1 if rank < extra else 0)]


# -- torchft: one replica ------------------------------------------------------------

def replica(slot: int, attempt: int, lighthouse: str, folder: Path, num_epochs: int, exchange: str) -> None:
    """One torchft replica (a replica group of one process), writing its events to
    `folder/replica{slot}-{attempt}.jsonl`. `exchange`: "ddp" (torchft's
    `DistributedDataParallel`) or "allreduce" (after backward, one `Manager.allreduce` of
    the gradients in one flat buffer, waited: the manager's own fault-tolerant all-reduce)."""
    import torch
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo

    from disttrain.training import build_model

    torch.set_num_threads(1)
    training, train, test = digits()
    total_steps = num_epochs * steps_per_epoch(len(train))
    torch.manual_seed(SEED)
    model = build_model("mlp", train.input_shape, train.num_classes, training)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    log = (folder / f"replica{slot}-{attempt}.jsonl").open("a", buffering=1)

    def event(kind: str, **fields: Any) -> None:
        log.write(json.dumps({"event": kind, "t": time.time(), **fields}) + "\n")

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
                      state_dict=state_dict, min_replica_size=2, use_async_quorum=False,
                      timeout=timeout, quorum_timeout=timedelta(seconds=120), connect_timeout=timeout,
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=lighthouse, replica_id=f"replica_{slot}", hostname="127.0.0.1",
                      heartbeat_interval=timedelta(seconds=HEARTBEAT_S))
    forward = DistributedDataParallel(manager, model) if exchange == "ddp" else model
    event("started", pid=os.getpid())
    while manager.current_step() < total_steps:
        manager.start_quorum()  # synchronous: a healing replica loads a peer's state here
        step, rank, num = manager.current_step(), manager.participating_rank(), manager.num_participants()
        event("quorum", step=step, rank=rank, num=num, quorum_id=manager._quorum_id)
        if slot == KILLED and attempt == 0 and step == KILL_STEP:
            event("kill", step=step)
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        epoch, indices = global_batch(step, len(train))
        mine = shard(indices, rank, num) if rank is not None else []
        started = time.perf_counter()
        if mine:
            images, labels = train.images[mine], train.labels[mine]
            loss = torch.nn.functional.cross_entropy(forward(images), labels)
            loss.backward()
        if exchange == "allreduce":
            average(manager, model, bool(mine))
        if slot == STRAGGLER:
            time.sleep((FACTOR - 1) * (time.perf_counter() - started))
        applied = manager.should_commit()
        if applied:
            optimizer.step()
        event("step", step=step, rank=rank, num=num, applied=applied, epoch=epoch, samples=mine)
    with torch.no_grad():
        accuracy = (model(test.images).argmax(1) == test.labels).float().mean().item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    event("done", accuracy=accuracy, params_sha256=hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    log.close()
    manager.shutdown(wait=False)


def average(manager, model, computed: bool) -> None:
    """All-reduce the gradients as one flat buffer through the manager (its average over
    the step's participants; an error is reported to the manager, so `should_commit` says
    False, and the buffer is discarded)."""
    import torch
    params = list(model.parameters())
    if not computed:
        for p in params:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    manager.allreduce(flat).wait()
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


# -- torchft: the drill ----------------------------------------------------------------

def torchft_run(folder: Path, num_epochs: int, exchange: str) -> dict[str, Any]:
    """Three replicas with a lighthouse; replica KILLED dies at KILL_STEP and is started
    again as soon as its exit is seen (once). Should another replica die, the run stops
    there: its figures say who died and the last line of its error. Returns the figures
    (see `torchft_figures`)."""
    from torchft.coordination import LighthouseServer

    folder.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=int(JOIN_TIMEOUT_S * 1000),
                                  quorum_tick_ms=100, heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT_S * 1000))
    started_at: dict[int, list[float]] = {}
    pids: dict[int, list[int]] = {}
    deaths: list[tuple[float, int, int]] = []  # (when, slot, exit status)
    finished: dict[int, int] = {}  # slot: the attempt that finished the run
    gone: set[int] = set()  # slots whose process died and is not started again
    processes: list[subprocess.Popen] = []
    stopping = threading.Event()  # the run is over: exits from here on are this driver's kills
    lock = threading.Condition()

    def start(slot: int, attempt: int) -> None:
        command = [sys.executable, __file__, "--replica", str(slot), "--attempt", str(attempt),
                   "--lighthouse", lighthouse.address(), "--folder", str(folder), "--epochs", str(num_epochs),
                   "--exchange", exchange]
        err = (folder / f"replica{slot}-{attempt}.err").open("w")
        process = subprocess.Popen(command, stdout=err, stderr=subprocess.STDOUT, env=os.environ | {
            "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"})
        with lock:
            processes.append(process)
            started_at.setdefault(slot, []).append(time.time())
            pids.setdefault(slot, []).append(process.pid)
        threading.Thread(target=watch, args=(slot, attempt, process), daemon=True).start()

    def watch(slot: int, attempt: int, process: subprocess.Popen) -> None:
        status = process.wait()
        if stopping.is_set():
            return
        with lock:
            if status == 0:
                finished[slot] = attempt
            else:
                deaths.append((time.time(), slot, status))
                if slot != KILLED or attempt > 0:
                    gone.add(slot)
            lock.notify_all()
        if status != 0 and slot == KILLED and attempt == 0:
            start(slot, attempt + 1)  # the killed replica once, as --max-restarts 1

    began = time.perf_counter()
    for slot in range(WORLD_SIZE):
        start(slot, 0)
    with lock:
        done = lock.wait_for(lambda: len(finished) == WORLD_SIZE or gone, timeout=RUN_TIMEOUT_S)
    wall_s = time.perf_counter() - began
    stopping.set()
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    lighthouse.shutdown()
    if not done or len(finished) != WORLD_SIZE:
        return {"completed": False, "exchange": exchange, "wall_s": wall_s,
                "deaths": [{"after_s": when - deaths[0][0], "slot": slot, "exit_status": status}
                           for when, slot, status in deaths],
                "survivors_restarted": False, "survivors_died": sorted(gone - {KILLED}),
                "errors": {slot: last_error(folder, slot) for slot in sorted(gone - {KILLED})}}
    return {"completed": True, "exchange": exchange, "wall_s": wall_s,
            **torchft_figures(folder, started_at, pids, deaths, num_epochs)}


def last_error(folder: Path, slot: int) -> list[str]:
    """The lines of a replica's output that name an error, and the torchft frame it failed in."""
    text = (folder / f"replica{slot}-0.err").read_text().splitlines()
    return [package_path(line.strip()) for line in text if "Error" in line or "torchft/" in line][-4:]


def package_path(line: str) -> str:
    """A traceback line with its file named from the package down (`torchft/ddp.py`), not
    by where this machine installed it."""
    return re.sub(r'File "[^"]*/site-packages/', 'File "', line)


def events(folder: Path, slot: int, attempt: int) -> list[dict[str, Any]]:
    path = folder / f"replica{slot}-{attempt}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def torchft_figures(folder: Path, started_at: dict[int, list[float]], pids: dict[int, list[int]],
                    deaths: list[tuple[float, int, int]], num_epochs: int) -> dict[str, Any]:
    _, train, test = digits()
    death = next(when for when, slot, _ in deaths if slot == KILLED)
    restart = started_at[KILLED][1]
    survivors = [slot for slot in range(WORLD_SIZE) if slot != KILLED]
    survivor_events = [e for slot in survivors for e in events(folder, slot, 0)]
    back = events(folder, KILLED, 1)
    after = sorted((e for e in survivor_events if e["t"] > death), key=lambda e: e["t"])
    resumed = next(e for e in after if e["event"] == "quorum" and e["num"] == WORLD_SIZE - 1)
    first_applied = next(e for e in after if e["event"] == "step" and e["applied"])
    rejoined = next(e for e in back if e["event"] == "quorum" and e["rank"] is not None)
    rejoined_applied = next(e for e in back if e["event"] == "step" and e["applied"])
    failed_steps = sorted({e["step"] for e in survivor_events if e["event"] == "step" and not e["applied"]})

    logs = [events(folder, slot, attempt) for slot in range(WORLD_SIZE) for attempt in range(len(pids[slot]))]
    counts: dict[tuple[int, int], int] = {}
    for log in logs:
        for e in log:
            if e["event"] == "step" and e["applied"]:
                for sample in e["samples"]:
                    counts[(e["epoch"], sample)] = counts.get((e["epoch"], sample), 0) + 1
    total_steps = num_epochs * steps_per_epoch(len(train))
    expected = {(epoch, sample) for step in range(total_steps)
                for epoch, indices in [global_batch(step, len(train))] for sample in indices}
    done = [e for log in logs for e in log if e["event"] == "done"]
    return {
        "survivors_restarted": any(len(pids[slot]) > 1 for slot in survivors),
        "rank_pids": {str(slot): pids[slot] for slot in sorted(pids)},
        "killed_exit_status": next(status for _, slot, status in deaths if slot == KILLED),
        "resume_s": resumed["t"] - death,
        "first_applied_step_after_kill_s": first_applied["t"] - death,
        "failed_steps": failed_steps,
        "rejoin_s": rejoined["t"] - restart,
        "rejoin_first_applied_s": rejoined_applied["t"] - restart,
        "kill_to_rejoined_s": rejoined["t"] - death,
        "healed_at_step": rejoined["step"],
        "samples_applied": sum(counts.values()),
        "samples_expected": len(expected),
        "samples_lost": len(expected - set(counts)),
        "samples_applied_twice": sum(1 for n in counts.values() if n > 1),
        "samples_outside_the_run": len(set(counts) - expected),
        "replicas_identical_at_end": len({e["params_sha256"] for e in done}) == 1,
        "final_accuracy": statistics.mean(e["accuracy"] for e in done),
        "test_samples": len(test),
    }


# -- disttrain's live recovery on the same drill -----------------------------------------

def ours_command(folder: Path, num_epochs: int) -> list[str]:
    return [sys.executable, "-m", "disttrain", "ddp", "--world-size", str(WORLD_SIZE),
            "--ddp-recovery", "live", "--dataset", "digits", "--num-epochs", str(num_epochs),
            "--batch-size", str(BATCH), "--seed", str(SEED), "--timeout-s", str(COLLECTIVE_TIMEOUT_S),
            "--num-threads", "1", "--max-restarts", "1", "--set", "training.model_architecture=mlp",
            "--set", f"training.learning_rate={LR}", "--set", f"coordinator.heartbeat_interval={HEARTBEAT_S}",
            "--set", f"coordinator.heartbeat_timeout={HEARTBEAT_TIMEOUT_S}",
            "--inject", f"kill:rank={KILLED}:step={KILL_STEP}",
            "--inject", f"slow:rank={STRAGGLER}:factor={FACTOR:g}",
            "--log-dir", str(folder / "logs"), "--checkpoint-dir", str(folder / "ckpt")]


def ours_run(folder: Path, num_epochs: int) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    result = subprocess.run(ours_command(folder, num_epochs), capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    wall_s = time.perf_counter() - began
    if result.returncode != 0:
        return {"completed": False, "returncode": result.returncode, "stderr_tail": result.stderr[-1500:],
                "wall_s": wall_s}
    summary = json.loads((folder / "logs" / "summary.json").read_text())
    pids = summary["rank_pids"]
    shrink = next(r for r in summary["live_recoveries"] if r["kind"] == "shrink")
    grows = [r for r in summary["live_recoveries"] if r["kind"] == "grow"]
    death = shrink["resumed_at"] - shrink["resume_s"]
    return {
        "completed": True, "wall_s": wall_s,
        "survivors_restarted": any(len(pids[str(slot)]) > 1 for slot in range(WORLD_SIZE) if slot != KILLED),
        "rank_pids": pids,
        "detect_s": shrink["detect_s"], "reform_s": shrink["reform_s"],
        "resume_s": shrink["resume_s"],
        "rejoin_s": grows[0]["rejoin_s"] if grows else None,
        "kill_to_rejoined_s": grows[0]["resumed_at"] - death if grows else None,
        "rejoined_at_step": grows[0]["step"] if grows else None,
        "samples_applied": summary["samples_applied"],
        "samples_lost": summary["samples_lost"],
        "samples_applied_twice": summary["samples_applied_twice"],
        "steps": summary["steps"],
        "final_accuracy": summary["final_accuracy"],
    }


# -- the benchmark ----------------------------------------------------------------------

FIGURES = ("resume_s", "rejoin_s", "kill_to_rejoined_s", "first_applied_step_after_kill_s", "wall_s")


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    done = [run for run in runs if run.get("completed")]
    return {key: statistics.median(run[key] for run in done) for key in FIGURES
            if done and all(run.get(key) is not None for run in done)}


def flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, help="epochs of the digits per drill (default 16, --quick 8: "
                        "the run outlasts a new process starting up on a loaded machine)")
    parser.add_argument("--keep", type=Path, help="keep the runs' folders here (default: a temporary one)")
    for name, kind in (("--replica", int), ("--attempt", int), ("--lighthouse", str), ("--folder", Path),
                       ("--exchange", str)):  # a replica's process
        parser.add_argument(name, type=kind, help=argparse.SUPPRESS)


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], flags)
    args.epochs = args.epochs or (8 if args.quick else 16)
    if args.replica is not None:
        replica(args.replica, args.attempt or 0, args.lighthouse, args.folder, args.epochs, args.exchange)
        return
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its lighthouse logs every request
    absent = torchft_absent()
    if absent is not None:
        report("torchft_drill", {"skipped": f"{absent}; install torchft (pip install torchft) beside "
                                 "disttrain to measure it"}, args.output)
        return
    root = args.keep or Path(tempfile.mkdtemp(prefix="torchft-drill-"))
    runs: dict[str, list[dict[str, Any]]] = {"disttrain_live": [], "torchft": []}
    for repeat in range(args.repeats):  # interleaved: the machine's load hits both alike
        runs["disttrain_live"].append(ours_run(root / f"ours{repeat}", args.epochs))
        runs["torchft"].append(torchft_run(root / f"torchft{repeat}", args.epochs, "allreduce"))
    # torchft's DistributedDataParallel on the same drill, once (--quick: left out)
    ddp_wrapper = None if args.quick else torchft_run(root / "torchft-ddp", args.epochs, "ddp")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    report("torchft_drill", {
        "drill": {"world_size": WORLD_SIZE, "batch_per_replica": BATCH, "global_batch": BATCH * WORLD_SIZE,
                  "epochs": args.epochs, "model": "mlp", "dataset": "digits", "killed": KILLED,
                  "kill_step": KILL_STEP, "straggler": STRAGGLER, "straggle_factor": FACTOR,
                  "heartbeat_s": HEARTBEAT_S, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
                  "torchft_join_timeout_s": JOIN_TIMEOUT_S,
                  "restarts": "the killed replica once, as soon as its exit is seen"},
        "torchft_version": torchft_version(),
        "runs": runs, "medians": {name: medians(value) for name, value in runs.items()},
        "torchft_ddp_wrapper": ddp_wrapper,
    }, args.output)


if __name__ == "__main__":
    main()
