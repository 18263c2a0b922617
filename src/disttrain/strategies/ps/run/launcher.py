"""The `ps` strategy: a whole parameter-server run on this machine, supervised.

Starts a coordinator (unless `coordinator.address` names a running one), then
`ps.num_servers` shard servers on free ports (each reports the port it bound), then
`system.num_workers` workers pointed at them; shows one progress display for the
cluster; streams every process's output to `<log_dir>/<name>.log`. Every process
registers with the coordinator and heartbeats. A process that fails (exits with an
error, or stops heartbeating) is restarted where it was, while the others train on: for
free when it had made progress, else spending one of `coordinator.max_restarts`
restarts in a row (`coordinator.budget`); one failing with a user's error stops the run
at once. A worker failing past its budget is left out, and the others take over its
blocks once the coordinator reassigns it (`coordinator.reassign_after`; null: the run
stops instead). A coordinator that dies is
restarted on its registry (`<log_dir>/cluster.db`). Worker 0 writes
`parameter_server_final.pt` and `summary.json` (strategy ps-sync, ps-ssp or ps-async)
when every worker is done; the launcher adds each failure and its recovery. Every
server refuses calls without the run's token (the user's, else a random one per run):
the servers and the coordinator get it through their environment, each worker only its
own node token, so it can call only in its own name; with TLS files, every process serves
and connects with the same ones. Each child is described by a `ProcessSpec`. SIGTERM to the
launcher, or to one worker, preempts the run as a whole: every process stops with a
checkpoint, the workers at one step, and the launcher exits 143 (`run.preemption`).
Resumed with another number of workers, the checkpoints are rewritten for them first
(`run.resize`). An elastic run (`--workers MIN:MAX`) goes through that rewrite by itself
when a worker is sent SIGTERM (one fewer, down to MIN) or the launcher SIGUSR1 (one more,
up to MAX), starting every process again on the new size (`run.elastic`). With `ps.spares`, K spare
workers start up beside the run and wait; a lost worker is restarted on one instead of a
fresh process (`run.spares`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from disttrain.config import Config
from disttrain.coordinator.launch import ExitReports, coordinator_spec, run_registry, token_env
from disttrain.coordinator.supervisor import Managed, Supervisor
from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.auth import new_token
from disttrain.core.errors import (
    CheckpointStoreError,
    ConfigError,
    DistributedError,
    Preempted,
    store_failure,
)
from disttrain.core.process_spec import PassedOn, ProcessSpec
from disttrain.core.processes import Cluster, raise_on_sigterm
from disttrain.core.store_check import check_checkpoint_dir
from disttrain.metrics.summary import SUMMARY_FILE, RunSummary
from disttrain.strategies.ps.run.elastic import (
    Range,
    SizeChange,
    check_elastic,
    faults_after,
    grow_on_sigusr1,
    ignore_grow_requests,
    stop_step,
)
from disttrain.strategies.ps.run.layout import run_layout
from disttrain.strategies.ps.run.preemption import preempted, preemption, sigterm_preempts, stop_in_order
from disttrain.strategies.ps.run.progress import ClusterWatch
from disttrain.strategies.ps.run.recovery import FirstSteps, recovery_summary
from disttrain.strategies.ps.run.resize import resize_checkpoints, resumed_config
from disttrain.strategies.ps.run.spares import SpareCluster, check_spares
from disttrain.strategies.ps.wire.sharding import log_plan, plan_shards
from disttrain.training.first_step import check_first_step
from disttrain.training.models import init_model
from disttrain.training.options import RunOptions
from disttrain.training.precision import PrecisionPlan, plan_precision

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 60.0


def run_cluster(config: Config, options: RunOptions) -> RunSummary:
    """Run the coordinator, servers and workers as child processes until the run ends.

    Raises:
        ConfigError: bad input found before any process starts (an unknown model, a
            training set that makes no batch per worker, checkpoints of an earlier run in
            the folder without `--resume`, a checkpoint of another number of workers that
            cannot be resumed on this one: see `run.resize`).
        DataError: the training set cannot be read.
        DistributedError: a process failed more often in a row without progress than
            `coordinator.max_restarts` (its name, exit code and log are named), or did not start.
        ConfigError, DataError, CheckpointError, TrainingError: a process failed with a
            user's error, or with the same unexpected error on a fresh start (not restarted).
        CheckpointStoreError: a process's checkpoint store failed for good (its line, named).
        Preempted: the launcher or a worker was sent SIGTERM; the run stopped with
            checkpoints (see `run.preemption`); in an elastic run, a worker only when the
            run is at its fewest workers.
        ConfigError: an elastic run with state a resize cannot carry over (see
            `run.elastic`), or whose stop left checkpoints that cannot be resized.
    """
    started = time.perf_counter()
    sizes = Range.of(config)
    check_spares(config.ps.spares, sizes is not None)
    if sizes is not None:
        check_elastic(config)
        ignore_grow_requests()  # until the run trains: SIGUSR1 would end this process
    while True:
        run, change = _launch(config, options, sizes)
        if change is None:
            break
        # The run stopped with checkpoints of one stop: go on from them on the new size.
        stopped = stop_step(config.system.checkpoint_dir, config.system.num_workers)
        config = config.replace(system={"num_workers": change.size})
        options = replace(options, resume=True, faults=faults_after(list(options.faults), stopped))
        logger.warning("%s: the run stopped at step %d with its checkpoints; starting it again on %d workers "
                       "from them", change.reason, stopped, change.size)
    log_dir = Path(config.system.log_dir)
    try:
        summary = RunSummary.read(log_dir / SUMMARY_FILE)
    except (OSError, ValueError) as e:
        raise DistributedError(f"worker 0 did not write the run summary in {log_dir}: {e}") from e
    summary.total_time_s = time.perf_counter() - started  # the whole command, start-up included
    summary.extra.update(recovery_summary(run.supervisor.failures, run.registry, run.first_steps))
    if isinstance(run.cluster, SpareCluster):
        summary.extra.update(run.cluster.summary(summary.extra["failures"]))
    summary.write(log_dir)
    return summary


def _launch(config: Config, options: RunOptions, sizes: Range | None) -> tuple[ClusterRun, SizeChange | None]:
    """Start the run's processes and supervise them until the run ends (None) or stops to
    change size (`run.elastic`: the change asked for). Raises as `run_cluster`."""
    if options.resume:  # the batch that keeps a checkpoint's global batch (`run.resize`)
        config = resumed_config(config)
    preflight(config, options)
    log_dir = Path(config.system.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / SUMMARY_FILE).unlink(missing_ok=True)
    registry = run_registry(log_dir)
    raise_on_sigterm()
    # One secret per run unless the user gave one; children get their token through their
    # environment (a command line is readable by every user), restarted ones too.
    options = replace(options, token=options.token or new_token())
    env_of = token_env(options.token)
    with (SpareCluster(log_dir, config.ps.spares, env_of=env_of) if config.ps.spares  # `run.spares`
          else Cluster(log_dir, env_of=env_of)) as cluster:
        sigterm_preempts(cluster)  # the whole run stops at a step, with checkpoints (`run.preemption`)
        if sizes is not None:
            grow_on_sigusr1(cluster)
        run = ClusterRun(cluster, config, options, log_dir / "config.yaml", sizes)
        run.start(registry)
        try:
            run.supervise()
        except SizeChange as change:
            return run, change
        finally:
            if sizes is not None:
                ignore_grow_requests()
    return run, None


def check_supported(config: Config) -> None:
    """Raises ConfigError for settings the parameter server does not offer."""
    if config.compression.enabled and config.compression.type == "powersgd":
        raise ConfigError("compression.type: powersgd compresses DDP's all-reduce and is not "
                          "offered on the parameter server; use quantization, topk, fp16 or bf16")
    worker_precision(config.training.precision)
    if config.training.local_update_mode and config.ps.aggregation_mode != "sync":
        # An asynchronous shard would apply each worker's round alone to a model other
        # rounds moved on: a pseudo-gradient is of the round-start parameters.
        raise ConfigError(f"ps.aggregation_mode: {config.ps.aggregation_mode} is not offered with local "
                          "updates (training.sync_every > 1); use sync, or training.sync_every 1")
    if config.training.local_update_mode and config.system.balance != "none":
        # Rounds and the ledger's one block per round follow equal batches.
        raise ConfigError(f"system.balance: {config.system.balance} batches are not offered with local "
                          "updates (training.sync_every > 1); use system.balance none")
    if config.training.local_update_mode and config.training.outer_compression != "none":
        # The shards decode pushes by the run's compression: pseudo-gradients take the wire's.
        raise ConfigError(f"training.outer_compression: {config.training.outer_compression} is DDP's; on the "
                          "parameter server a fragment's pseudo-gradient is compressed as every push is: "
                          "leave it none and set compression.type (quantization for int8, or fp16)")
    if config.training.local_update_mode and config.training.outer_fragments > config.ps.num_servers:
        # A fragment is a group of whole shards: its push goes to them alone.
        fragments = config.training.outer_fragments
        raise ConfigError(f"training.outer_fragments: {fragments} fragments need as many servers at least "
                          f"(ps.num_servers is {config.ps.num_servers}): each fragment is a group of whole "
                          f"shards; use --servers {fragments}")
    if config.training.local_update_mode and config.training.outer_fragments > 1 and config.ps.backup_workers:
        raise ConfigError(f"ps.backup_workers: {config.ps.backup_workers} is not offered with "
                          "training.outer_fragments > 1 (Streaming DiLoCo); use 0")
    if config.training.local_update_mode and config.compression.pull != "none":
        # A pulled change is added to the copy the worker holds, which its local steps
        # have moved off the shard's broadcast copy.
        raise ConfigError(f"compression.pull: {config.compression.pull} is not offered with local updates "
                          "(training.sync_every > 1); use compression.pull none (the pushes of "
                          "pseudo-gradients can still be compressed)")


def worker_precision(mode: str) -> PrecisionPlan:
    """The workers' mixed precision (they compute on the CPU, and cannot scale the loss:
    the servers apply their gradients). Raises ConfigError for fp16."""
    return plan_precision(mode, "cpu", loss_scaling=False)


def preflight(config: Config, options: RunOptions) -> None:
    """What can be checked before starting processes.

    Raises:
        ConfigError: see `run_cluster`.
    """
    check_supported(config)
    check_first_step(config.training)  # a model that cannot take the data fails here, once
    model = init_model(config.training)
    try:
        plans = plan_shards(model, config.ps.num_servers)
    except ValueError as e:
        raise ConfigError(f"the parameter server cannot shard this model: {e}") from e
    log_plan(plans)
    run_layout(config)  # a training set that makes no batch per worker fails here, once
    folder = config.system.checkpoint_dir  # a path or a store's URL
    check_checkpoint_dir(folder, "ps", in_this_process=False)
    if options.resume:  # a checkpoint of another number of workers, rewritten for this run's
        resize_checkpoints(config)
    for name in [f"server{s}" for s in range(config.ps.num_servers)] + \
            [f"worker{r}" for r in range(config.system.num_workers)]:
        ckpt.prepare_checkpoint_dir(object_store.join(folder, name), resume=options.resume)


class ParameterServer:
    name = "ps"

    def run(self, config: Config, options: RunOptions) -> RunSummary:
        return run_cluster(config, options)


STRATEGY = ParameterServer()


def start_servers(cluster: Cluster, config_path: Path, num_servers: int, bind_host: str = "127.0.0.1"
                  ) -> list[str]:
    """Start `num_servers` shard servers of the config at `config_path` on free ports,
    unsupervised (for runs whose workers are started by hand); their addresses in shard
    order. Raises DistributedError when one exits or does not report its address in time."""
    for shard in range(num_servers):
        cluster.spawn(f"server{shard}", ProcessSpec("ps-server", config=config_path, bind=f"{bind_host}:0",
                                                    shard=(shard, num_servers)))
    return [cluster.wait_listening(f"server{shard}") for shard in range(num_servers)]


@dataclass
class ClusterRun:
    """The processes of one run and the supervisor that keeps them going."""

    cluster: Cluster
    config: Config
    options: RunOptions
    config_path: Path
    sizes: Range | None = None  # an elastic run's (`run.elastic`)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.cluster, self.config.coordinator.max_restarts, self._report_exit)
        self.exits: ExitReports | None = None
        self.registry: Path | None = None  # the launch's, once started
        self.first_steps = FirstSteps()

    def _spec(self, command: str, attempt: int, **fields) -> ProcessSpec:
        """A server or worker of this run (attempt > 0: a restart, resuming)."""
        options = self.options
        return ProcessSpec(command, config=self.config_path, faults=options.faults, attempt=attempt,
                           resume=attempt > 0 or options.resume, verbose=options.verbose, tls=options.tls,
                           **fields)

    def start(self, registry: Path) -> None:
        """Start the coordinator (unless one runs already), the servers, then the workers."""
        self.registry = registry
        config = self.config
        config.save(self.config_path)
        address = config.coordinator.address or self._start_coordinator(registry)
        self.config = config.replace(coordinator={"address": address})
        self.config.save(self.config_path)  # every process finds the coordinator here
        self.exits = ExitReports(address, self.options.token, self.options.tls)
        num_servers = config.ps.num_servers
        binds = {f"server{s}": self._start_server(f"server{s}", lambda attempt, bind, s=s: self._spec(
            "ps-server", attempt, bind=bind, shard=(s, num_servers))) for s in range(num_servers)}
        addresses = [self._listening(name, bind) for name, bind in binds.items()]  # started together
        logger.info("servers listening on %s", ", ".join(addresses))
        # With reassignment, the others take over the blocks of a worker past its restarts.
        expendable = config.coordinator.reassign_after is not None
        for rank in range(config.system.num_workers):
            name = f"worker{rank}"
            self.supervisor.start(Managed(name, name, lambda attempt, r=rank, n=name: self._spec(
                "ps-worker", attempt, servers=tuple(addresses), rank=r, worker_id=n), expendable))
        if isinstance(self.cluster, SpareCluster):  # after the workers: they come first on the cores
            self.cluster.start_spares(self._spec("ps-worker", 0, servers=tuple(addresses)))

    def _start_coordinator(self, registry: Path) -> str:
        options = self.options
        passed = PassedOn(options.faults, options.tls, options.verbose)
        bind = self._start_server("coordinator", lambda attempt, bind: coordinator_spec(
            self.config_path, registry, bind, attempt, passed))
        address = self._listening("coordinator", bind)
        logger.info("coordinator listening on %s (registry %s)", address, registry)
        return address

    def _start_server(self, name: str, spec: Callable[[int, str], ProcessSpec]) -> list[str]:
        """Start server `name` under the supervisor on a free port, `spec(attempt, bind)`
        describing it; the address it binds, as a list `_listening` fills in."""
        bind = [f"{self.config.ps.bind_host}:0"]
        self.supervisor.start(Managed(name, name, lambda attempt: spec(attempt, bind[0])))
        return bind

    def _listening(self, name: str, bind: list[str]) -> str:
        """The address server `name` listens on, once it does; its restarts bind the same.

        Raises:
            DistributedError: it failed more often than allowed before it listened, or did
                not report in time.
        """
        bind[0] = self.cluster.wait_listening(name, restarted=self._exited)
        return bind[0]

    def _exited(self, name: str, code: int) -> bool:
        """The supervisor's handling of an exit (True: restarted), but a process whose
        checkpoint store failed for good stops the run with its line: a restart would
        fail the same way.

        Raises:
            CheckpointStoreError: `name` exited with its code.
            DisttrainError: see `Supervisor.exited`.
        """
        if code == CheckpointStoreError.exit_code:
            child = self.cluster.children[name]
            raise store_failure(name, child.tail(20), child.log_path)
        return self.supervisor.exited(name, code)

    def _report_exit(self, node_id: str, code: int, reason: str) -> None:
        """Tell the coordinator (once it runs), which keeps the news while it is down."""
        if self.exits is not None and node_id != "coordinator":
            self.exits.report(node_id, code, reason)

    def supervise(self) -> None:
        """Show progress until every worker is done and the servers stopped; restart what fails."""
        watch = ClusterWatch(self.config.system.num_workers, f"ps-{self.config.ps.aggregation_mode}")
        running = {name for name in self.supervisor.processes if name != "coordinator"}
        deadline = None
        while running:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            event = self.cluster.next_event(wait_s)
            if event is None:  # the work is done (worker 0 wrote the model): stop what is left
                logger.warning("%s still running %.0fs after the workers finished; stopping them",
                               ", ".join(sorted(running)), SHUTDOWN_TIMEOUT_S)
                break
            change = self.sizes.change(event, self.config.system.num_workers) \
                if self.sizes is not None and deadline is None else None
            if change is not None:
                watch.close()
                self.stop(change[1])
                raise SizeChange(*change)
            reason = preemption(event) if deadline is None else None
            if reason is not None:
                watch.close()
                raise self.preempt(reason)
            if event.kind == "node-failed":
                fields = event.fields
                self.supervisor.declared_failed(str(fields["node"]), str(fields.get("reason")),
                                                int(fields.get("pid", 0)))
            elif event.kind == "exit":
                code = int(event.fields["code"])
                if code == CheckpointStoreError.exit_code:  # even after the work: a checkpoint is missing
                    self._exited(event.child, code)
                if deadline is None and event.child.startswith("server") and code == 0:
                    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S  # worker 0 stopped the servers
                if deadline is not None and event.child != "coordinator":  # nothing left to restart for
                    self.supervisor.ended(event.child, code)  # the registry still hears of it
                    running.discard(event.child)
                elif self._exited(event.child, code) or event.child == "coordinator":
                    continue
                running.discard(event.child)
                if event.child.startswith("worker") and watch.worker_done():
                    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
            else:
                watch.saw(event)
                self.first_steps.saw(event, self.supervisor.failures)
        watch.close()
        if self.exits is not None:
            self.exits.close()  # the registry ends with every exit (the coordinator may be restarting)

    def preempt(self, reason: str) -> Preempted:
        """Stop the run (`stop`); the error to exit with (`Preempted`: see `run.preemption`)."""
        groups = self.stop(reason)
        return preempted(self.config.system.checkpoint_dir, groups[0] + groups[1])

    def stop(self, reason: str) -> list[list[str]]:
        """Stop the workers, then the shards, then the coordinator, each with a checkpoint
        where it keeps one; the names of each group."""
        names = list(self.supervisor.processes)
        groups = [[n for n in names if n.startswith(role)] for role in ("worker", "server", "coordinator")]
        stop_in_order(self.cluster, groups, self.config.system.preemption_grace_s, reason)
        return groups

