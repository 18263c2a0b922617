"""The configurations fault schedules run on: small real runs of `disttrain ps` and
`disttrain ddp` on the bundled digits data set (no download), each named, with what a
schedule needs to know of it (its processes, its steps, its checkpoints).

Every scenario trains the same MLP with the same seed and sizes, so a fault-free run of
it is the reference its faulty runs are measured against (accuracy, time). It trains to
the end of a cosine decay of the learning rate, as runs are trained: a fault changes the
run's path (a worker's steps taken alone while it restarts, a shard's lost steps redone
later), and a model stopped half-way down its loss, at a constant rate, ends up to 3
points apart for paths that differ that little (different training seeds: 94.7% to
97.8%), which would say nothing of the recovery. Decayed to zero, runs of four training
seeds end within about a point, and faulty runs within a point of their fault-free run.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Scenario:
    """One configuration.

    Attributes:
        name: how schedules and results name it.
        command: `ps` or `ddp`.
        mode: PS: the aggregation mode (sync, ssp, async); DDP: the recovery (restart, live).
        flags: further flags of the command (compression, overlap, local updates, ...).
        workers: PS workers, or DDP ranks.
        servers: PS shards (0 for DDP).
        epochs, train_samples, batch_size: the run's size (digits has 1,438 samples).
        learning_rate: the rate the cosine decay starts from (it reaches 0 at the run's end).
        checkpoint_interval: steps (a shard: versions) between checkpoints.
        reassign: PS: a worker past its restarts is left out, the others take its blocks.
        group_restart: every process of the group restarts when one fails (DDP restart).
        exact: the final model is bit-identical to the fault-free run's (DDP restart on CPU).
        (The sizes make each epoch a whole number of checkpoint intervals, so the last
        checkpoint holds the whole run.)
        max_restarts: the crash-loop budget of each process.
        preemptible: schedules may preempt it (SIGTERM: it stops with checkpoints, exit
            143) and resume it with `--resume`.
        resizable: a preempted run may resume on another number of workers (ranks), one
            of `sizes()` (PS in every aggregation mode, DDP restart mode).
        exact_resume: a run only preempted and resumed on its own size ends bit-identical
            to the fault-free run (sync mode: no other fault changed its path).
        preempt_before: the share of the run its preemptions are drawn in (a preemption
            late in it may let the run end first, within the grace).
        preempted_slowdown: how many times longer each member's steps take in every
            launch of a schedule with preemptions (`slow:rank:factor=F`, which changes no
            number, only the time). A DDP group agrees on its stop step in rounds about
            50 ms of training apart, up to 100 steps (`ddp.preemption`); this small
            run's steps take about a millisecond, so a SIGTERM lets it end first (exit 0,
            'SIGTERM came after the last step') unless its steps take as long as a real
            model's: slowed tenfold, the group stops within a few steps of the signal.
        max_workers: an elastic run (PS: `--workers WORKERS:MAX`; DDP live:
            `--world-size WORKERS:MAX`) that grows and shrinks while it runs; its schedules
            draw its changes at steps (`chaos.elastic`; 0: a run of a fixed size).
        accuracy_gap: how far (either way) a faulty run's final accuracy may be from the
            fault-free run's. An elastic run's changes re-split each epoch's remaining
            samples over the new workers where the run stops, a step that varies with the
            machine's load: its order of samples is another one at each run, as another
            training seed's is, and seed 4's ended at 96.94% and 98.05% (4 of the 359 test
            samples) against the fault-free 96.94%.
    """

    name: str
    command: str
    mode: str
    flags: tuple[str, ...] = ()
    workers: int = 2
    servers: int = 0
    epochs: int = 4
    train_samples: int = 1408
    batch_size: int = 16
    checkpoint_interval: int = 11
    learning_rate: float = 0.003
    reassign: bool = False
    group_restart: bool = False
    exact: bool = False
    max_restarts: int = 3
    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 1.5
    preemptible: bool = False
    resizable: bool = False
    exact_resume: bool = False
    preempt_before: float = 1.0
    preempted_slowdown: float = 1.0
    max_workers: int = 0
    accuracy_gap: float = 0.01

    @property
    def references(self) -> int:
        """Fault-free runs to measure against: several where the order pushes arrive in
        changes the result (async, SSP), else one (a run is deterministic)."""
        return 3 if self.mode in ("async", "ssp") else 1

    @property
    def steps_per_epoch(self) -> int:
        """Each worker's (rank's) steps in one epoch."""
        return math.ceil((self.train_samples // self.workers) / self.batch_size)

    @property
    def total_steps(self) -> int:
        """Each worker's (rank's) steps in the run."""
        return self.epochs * self.steps_per_epoch

    @property
    def total_samples(self) -> int:
        """The samples the run applies, every one once: every worker's share of every epoch."""
        return self.epochs * (self.train_samples // self.workers) * self.workers

    @property
    def member_role(self) -> str:
        """The role of the processes that train: `worker` (PS) or `rank` (DDP)."""
        return "worker" if self.command == "ps" else "rank"

    def sizes(self) -> tuple[int, ...]:
        """The numbers of workers (ranks) a preempted run may resume on: those that keep
        its global batch and split the data set evenly (so every epoch has the same steps
        and samples whatever the size), up to 4 (two cores run them). Only its own size
        for a scenario that is not `resizable`."""
        if not self.resizable:
            return (self.workers,)
        global_batch = self.batch_size * self.workers
        return tuple(size for size in range(1, 5)
                     if global_batch % size == 0 and self.train_samples % size == 0)

    def processes(self) -> dict[str, int]:
        """role -> how many processes of it the run has (faults may target each)."""
        if self.command == "ps":
            return {"worker": self.workers, "server": self.servers, "coordinator": 1}
        return {"rank": self.workers}

    def role_step(self, role: str, step: int) -> int:
        """The step a fault on `role` names for the moment workers reach `step`: a
        shard's (and the coordinator's) steps are versions, one per push in async mode."""
        if role in ("server", "coordinator") and self.mode == "async":
            return step * self.workers
        return step

    def command_line(self, log_dir: Path, checkpoint_dir: Path, seed: int, workers: int | None = None
                     ) -> list[str]:
        """The `disttrain` command of a run of this scenario, faults aside; `workers`: the
        workers (ranks) of a resumed launch, when not the scenario's (`--batch-size` stays
        the first launch's: a resumed run keeps its checkpoint's global batch)."""
        workers = self.workers if workers is None else workers
        line = [sys.executable, "-m", "disttrain", self.command, "--dataset", "digits", "--model", "mlp",
                "--num-epochs", str(self.epochs), "--max-train-samples", str(self.train_samples),
                "--batch-size", str(self.batch_size), "--checkpoint-interval", str(self.checkpoint_interval),
                "--num-threads", "1", "--seed", str(seed), "--max-restarts", str(self.max_restarts),
                "--log-dir", str(log_dir), "--checkpoint-dir", str(checkpoint_dir),
                "--set", f"coordinator.heartbeat_interval={self.heartbeat_interval_s}",
                "--set", f"coordinator.heartbeat_timeout={self.heartbeat_timeout_s}",
                "--learning-rate", str(self.learning_rate), "--set", "training.lr_schedule=cosine",
                "--set", f"training.lr_decay_steps={self.total_steps}"]
        if self.command == "ps":
            size = f"{workers}:{self.max_workers}" if self.max_workers else str(workers)
            line += ["--workers", size, "--servers", str(self.servers),
                     "--aggregation-mode", self.mode]
            if self.reassign:
                line += ["--reassign-after", "2"]
        else:
            size = f"{workers}:{self.max_workers}" if self.max_workers else str(workers)
            line += ["--world-size", size, "--ddp-recovery", self.mode]
        return line + list(self.flags)


def _ps(name: str, mode: str = "sync", *flags: str, **fields) -> Scenario:
    return Scenario(name, "ps", mode, tuple(flags), servers=fields.pop("servers", 2), **fields)


# A live elastic group's model (and the streamed push's: one shard of it is over 4 MB):
# wider than the others' MLP (1.1M parameters, not 10k), so a step is real work (about 20
# ms on a quiet core, not 2) and a change sent from outside at a drawn step, a heartbeat
# late, lands a few steps after it, inside the run. (A straggler's slowdown would pace it
# too, but a live straggler's steps count its waits for peers, and every hold of the group
# for an arrival would come back to it tenfold.)
WIDE_MLP = "training.model_args={hidden_size: 1024, num_layers: 2}"

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    _ps("ps-sync", preemptible=True, resizable=True, exact_resume=True),
    _ps("ps-ssp", "ssp", "--staleness", "2", preemptible=True, resizable=True),
    _ps("ps-async", "async", preemptible=True, resizable=True),
    _ps("ps-sync-overlap", "sync", "--set", "ps.overlap=true", "--set", "ps.overlap_trial_steps=0"),
    _ps("ps-sync-topk", "sync", "--compression-enabled", "--compression-type", "topk",
        "--compression-ratio", "0.1"),
    _ps("ps-sync-pull", "sync", "--pull-compression", "topk", "--pull-ratio", "0.1"),
    _ps("ps-async-int8", "async", "--compression-enabled", "--compression-type", "quantization"),
    _ps("ps-local", "sync", "--sync-every", "4"),
    _ps("ps-reassign", "sync", reassign=True, max_restarts=1),
    _ps("ps-3shards", "sync", servers=3, preemptible=True, resizable=True, exact_resume=True),
    # One shard of 4.5 MB through gRPC, overlapped: each push streams its pieces during
    # backward (buckets finer than the shard), faults cutting streams mid-push. The wider
    # MLP ends further from its fault-free run: a block redone after a fault is applied as
    # an update of its own, and seed 4404 (the shard killed twice, the workers four times)
    # ended at 98.05-98.61% in five runs against the fault-free 97.49%, streamed or not
    # (98.61% with `ps.overlap: false` too), every sample applied once.
    _ps("ps-sync-streamed", "sync", "--set", "ps.overlap=true", "--set", "ps.overlap_trial_steps=0",
        "--set", "ps.payload_transport=grpc", "--set", WIDE_MLP, servers=1, accuracy_gap=0.02),
    Scenario("ddp-restart", "ddp", "restart", group_restart=True, exact=True, preemptible=True,
             resizable=True, exact_resume=True, preempt_before=0.75, preempted_slowdown=10.0),
    Scenario("ddp-live", "ddp", "live"),
    # Local updates on both recovery policies: restart resumes mid-round from a checkpoint
    # (bit-identical); a live group sends its survivors back to the round's start. A live
    # group that shrank trains another algorithm until it grows again: one member's model
    # over each whole global batch where two members' models, each over half of it, were
    # averaged. Seed 1203 (a member lost at step 27 of 176, back at step 60) ended at
    # 98.33% against the fault-free 97.21% (4 of the 359 test samples), every global batch
    # applied once.
    Scenario("ddp-restart-local", "ddp", "restart", ("--sync-every", "4"), group_restart=True, exact=True),
    Scenario("ddp-live-local", "ddp", "live", ("--sync-every", "4"), accuracy_gap=0.02),
)}
# Run only when named (`--scenarios`), not by the default campaign: an elastic PS run restarts
# every process at each change of size (about 11 s each on 2 cores), slower than the others;
# a live elastic DDP run's arrivals start a launcher each, on a wider model.
# ps-elastic's global batch of 24 (12 a worker on 2) splits evenly on 2, 3 and 4 workers, and
# so does each epoch of 1,320 samples (55 steps at every size, five checkpoint intervals); a
# live group keeps its global batch of 32 at every size (11,11,10 on 3: 44 steps an epoch).
ON_REQUEST: dict[str, Scenario] = {s.name: s for s in (
    _ps("ps-elastic", max_workers=4, train_samples=1320, batch_size=12, accuracy_gap=0.02),
    Scenario("ddp-elastic", "ddp", "live", ("--set", WIDE_MLP), max_workers=4),
)}
# A few minutes inside the test suite: one of each strategy's recoveries.
QUICK = ("ps-sync", "ddp-live")


def scenario(name: str) -> Scenario:
    """The scenario called `name`.

    Raises:
        ValueError: no such scenario (the known ones are named).
    """
    try:
        return {**SCENARIOS, **ON_REQUEST}[name]
    except KeyError:
        raise ValueError(f"no scenario {name!r}; choose among "
                         f"{', '.join([*SCENARIOS, *ON_REQUEST])}") from None
