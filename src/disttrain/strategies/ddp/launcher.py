"""`disttrain ddp` on one node or many: checks, then torch's elastic agent starts the ranks.

The ranks are started by `torch.distributed.launcher.api.elastic_launch`, the engine
behind torchrun: a c10d rendezvous (a private TCP store on a free port for a single node,
or the `HOST:PORT` of `ddp.rdzv_endpoint` shared by all nodes), one process per rank
running `python -m disttrain.torchrun`, monitoring, and restarts of the whole group when
a rank dies, as the restart budget grants them (`agent`: free when the group checkpointed
past its newest checkpoint before it died, else one of `ddp.max_restarts` in a row; none
after a user's error). A preempted group (SIGTERM to a rank, or to this launcher, which
the agent forwards to every rank) is not restarted: the ranks stop at a step they agree
on with its checkpoint (`preemption`), and the launcher exits with code 143 and one line
saying where to resume from. Each rank is then the same program torchrun would
start, so one code path serves both. A coordinator watches the ranks (`coordination`):
each registers and heartbeats, so `disttrain status` shows the run and its restarts.

Everything that can be checked before any process starts is checked here, so a bad
world size, backend or checkpoint folder fails at once with one line rather than after
the ranks have started (and perhaps been restarted).

The ranks inherit `OMP_NUM_THREADS` set to the thread count each rank gives torch. A
rank's main thread sets its count, but the backend's threads, which run communication
hooks' callbacks (PowerSGD's matrix products), start from this variable's default, and
MKL follows the calling thread's: without it, a product's rounding depended on which
thread ran it, and runs (a resumed one against an uninterrupted one) came apart.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.elastic.rendezvous import api as rendezvous_api
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from disttrain.config import Config, DDPConfig, SystemConfig
from disttrain.core import checkpoint as ckpt
from disttrain.core.addresses import unclaimed_port
from disttrain.core.auth import TOKEN_ENV
from disttrain.core.errors import CheckpointStoreError, ConfigError, DistributedError, Preempted
from disttrain.core.process_spec import RANK_ENTRY, ProcessSpec, command_line
from disttrain.core.processes import thread_count
from disttrain.core.store_check import check_checkpoint_dir
from disttrain.data import load_datasets
from disttrain.metrics.summary import SUMMARY_FILE, RunSummary
from disttrain.strategies.ddp import resize
from disttrain.strategies.ddp import runtime as rt
from disttrain.strategies.ddp.agent import GroupBudget, PreemptibleAgent, budgeted_agent
from disttrain.strategies.ddp.coordination import RunCoordinator, run_coordinator
from disttrain.strategies.ddp.endpoint import wait_for_endpoint
from disttrain.strategies.ddp.live import launch_live
from disttrain.strategies.ddp.preemption import NOT_SAVED, GroupStop, error_file_messages, group_stop
from disttrain.strategies.ddp.rank_tokens import RANK_TOKENS_ENV, write_rank_tokens
from disttrain.training.first_step import check_first_step
from disttrain.training.options import RunOptions
from disttrain.training.precision import plan_precision

logger = logging.getLogger(__name__)

# With the agent's rendezvous store shared with the ranks (torch's default), a restarted
# group reads the dead group's keys and cannot connect (pytorch/pytorch#135712); with
# sharing off, each rendezvous round gets a fresh store hosted by its rank 0.
FRESH_STORE_PER_ROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
STANDALONE_ENDPOINT = "localhost:0"  # this node hosts the rendezvous store on a free port
MONITOR_INTERVAL_S = 0.1
# After its own grace period a rank ends itself, leaving a line; the agent kills the ranks
# this much later than that (after forwarding a SIGTERM), so that line is there to read.
SHUTDOWN_MARGIN_S = 5
_NO_ERROR_FILE = "To enable traceback"  # torch's text when a rank left no error file
_EXCEPTION_PREFIX = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): ")


@dataclass(frozen=True)
class LaunchPlan:
    """What the checks decided: ranks on this node and the backend they will use."""

    ranks_per_node: int
    backend: str


def preflight(config: Config, resume: bool) -> LaunchPlan:
    """Check what can be checked before starting processes.

    Raises:
        ConfigError: world size not divisible by nodes or larger than the data, NCCL
            without (enough) GPUs, mixed precision on CPU, or a fresh run over old checkpoints.
        DataError: the data set cannot be loaded.
    """
    ddp, system, training = config.ddp, config.system, config.training
    rt.check_supported(config)
    check_checkpoint_dir(system.checkpoint_dir, "ddp", in_this_process=False)
    if system.num_workers % ddp.num_nodes:
        raise ConfigError(f"system.num_workers: world size {system.num_workers} does not split evenly "
                          f"over ddp.num_nodes={ddp.num_nodes}; use a multiple of {ddp.num_nodes}")
    ranks_per_node = system.num_workers // ddp.num_nodes
    backend = rt.node_backend(ddp.backend, ranks_per_node,
                              torch.cuda.device_count() if torch.cuda.is_available() else 0)
    device = rt.select_device(backend, 0)
    # Asked only for bf16: the question starts a CUDA context in this (launcher) process.
    plan_precision(training.precision, device.type, training.precision == "bf16"
                   and device.type == "cuda" and torch.cuda.is_bf16_supported())
    # an unknown model, or one that cannot take the data (or leaves DDP a parameter without
    # a gradient), fails here, once
    check_first_step(training, every_gradient=rt.needs_every_gradient(config))
    train_set, _ = load_datasets(training)
    rt.check_world_size(len(train_set), system.num_workers)
    del train_set  # the ranks load their own copies
    if not resume:
        ckpt.prepare_checkpoint_dir(system.checkpoint_dir, resume=False)  # a path or a store's URL
    return LaunchPlan(ranks_per_node, backend)


def launch_config(ddp: DDPConfig, ranks_per_node: int, error_dir: Path,
                  grace_s: float = SystemConfig.preemption_grace_s) -> LaunchConfig:
    """The elastic agent's settings: c10d rendezvous, restarts and timeouts from `ddp`.

    Args:
        error_dir: where the agent keeps the ranks' error files (read when a rank fails).
        grace_s: `system.preemption_grace_s`: how long the ranks have to stop after the
            agent forwards a SIGTERM to them, before it kills them.
    """
    timeout_s = max(1, math.ceil(ddp.timeout_s))
    endpoint = ddp.rdzv_endpoint or STANDALONE_ENDPOINT
    run_id = ddp.rdzv_id or ("disttrain" if ddp.rdzv_endpoint else uuid.uuid4().hex)
    rdzv_configs = {"join_timeout": timeout_s, "read_timeout": timeout_s, "timeout": timeout_s}
    if not ddp.rdzv_endpoint:
        rdzv_configs["is_host"] = True
    return LaunchConfig(
        min_nodes=ddp.num_nodes, max_nodes=ddp.num_nodes, nproc_per_node=ranks_per_node,
        run_id=run_id, role="rank", rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs, max_restarts=ddp.max_restarts,
        monitor_interval=MONITOR_INTERVAL_S, start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(error_dir)),
        shutdown_timeout=math.ceil(grace_s) + SHUTDOWN_MARGIN_S,
    )


def rank_spec(config_path: Path, summary_path: Path, options: RunOptions) -> ProcessSpec:
    """Every rank's process (the torchrun entry point). Rank 0 also writes the summary at
    `summary_path`, where only the launcher of its node finds it."""
    return ProcessSpec("", entry=RANK_ENTRY, config=config_path, summary_json=summary_path,
                       quiet_summary=True, resume=options.resume, faults=options.faults,
                       verbose=options.verbose, tls=options.tls)


def launch(config: Config, options: RunOptions) -> RunSummary | None:
    """Start the ranks of this node and wait for them; return the summary (None on a node
    without rank 0).

    Raises:
        ConfigError: bad input found before or by the ranks (exit code 2).
        CheckpointStoreError: a rank's checkpoint store failed for good (exit code 74).
        DistributedError: a rank failed after its restarts, or the rendezvous failed.
        Preempted: a SIGTERM (to a rank, or to this launcher) stopped the ranks (exit code 143).
    """
    started = time.perf_counter()
    plan = preflight(config, options.resume)
    if options.resume:  # a checkpoint of another number of ranks keeps its global batch
        config = resize.resumed_config(config)
    if config.ddp.rdzv_endpoint:
        wait_for_endpoint(config.ddp.rdzv_endpoint, config.ddp.timeout_s)
    log_dir = Path(config.system.log_dir)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.INFO if options.verbose
                                                            else logging.WARNING)
    logger.info("starting %d rank(s) on this node (%s), up to %d restart(s)", plan.ranks_per_node,
                plan.backend, config.ddp.max_restarts)
    # The ranks' thread count (see the module's doc), set before the coordinator starts: its
    # process and the ranks then share their start-up settings, so one fork server (one
    # import of torch) starts them all.
    os.environ["OMP_NUM_THREADS"] = str(thread_count(config.system.num_threads, plan.ranks_per_node))
    with tempfile.TemporaryDirectory(prefix="disttrain-ddp-") as folder:
        config_path, summary_path = Path(folder) / "config.yaml", Path(folder) / SUMMARY_FILE
        config.save(config_path)
        with run_coordinator(config, config_path, options.token, options.tls,
                             options.faults) as coordinator:
            coordinator.config.save(config_path)  # the ranks find the coordinator here
            args = command_line(rank_spec(config_path, summary_path, options))
            try:
                run_ranks(coordinator, plan, Path(folder) / "agent", args, Path(folder) / "tokens")
            except Preempted:
                if not summary_path.is_file():  # rank 0 writes it only once the run has ended
                    raise
                logger.warning("SIGTERM came too late to stop the run early: its ranks reached the last "
                               "step before they agreed on a stop, so it ended as a whole")
        if coordinator.registry is not None:
            logger.info("every rank's state, restarts and progress: disttrain status --registry %s",
                        coordinator.registry)
        if not summary_path.is_file():
            logger.info("rank 0 ran on another node; its summary is in its log dir")
            return None
        summary = RunSummary.read(summary_path)
    summary.total_time_s = time.perf_counter() - started  # the whole command, start-up included
    summary.write(log_dir)
    return summary


def run_ranks(coordinator: RunCoordinator, plan: LaunchPlan, error_dir: Path, args: list[str],
              tokens_dir: Path) -> None:
    """Run the elastic agent until the ranks end; then report to the coordinator how they
    ended (the ranks report it themselves, but a killed or stopped rank cannot). The ranks
    get their own node tokens (`rank_tokens`, written into the new private folder
    `tokens_dir`), never the run's secret: the agent hands them its environment, from which
    the secret is kept out while it runs.

    Raises:
        ConfigError, DistributedError: see `launch`.
    """
    config = coordinator.config
    given_token = os.environ.pop(TOKEN_ENV, None)  # the user's secret, if given so: not the ranks'
    # Restarts the budget grants (`agent`): free after progress, none after a user's error.
    ddp = config.ddp
    budget = GroupBudget(ddp.max_restarts, config.system.checkpoint_dir) if ddp.max_restarts else None
    agents: list[PreemptibleAgent] = []
    try:
        os.environ.update(FRESH_STORE_PER_ROUND)
        unclaimed_store_ports()
        if coordinator.token is not None:  # the agent hands its environment to the ranks (never argv)
            os.environ[RANK_TOKENS_ENV] = str(write_rank_tokens(tokens_dir, coordinator.token,
                                                                config.system.num_workers))
        with budgeted_agent(budget) as made:
            agents = made
            elastic_launch(launch_config(config.ddp, plan.ranks_per_node, error_dir,
                                         config.system.preemption_grace_s), sys.executable)(*args)
    except ChildFailedError as e:
        stop = group_stop(failure.message for failure in e.failures.values())
        if stop is not None:
            raise preempted(coordinator, stop) from None
        error = (budget and budget.stop_error()) or child_failure(e, config.ddp.max_restarts)
        coordinator.stopped("stopped by the elastic agent after another rank failed",
                            {rank: (failure.exitcode or 1, _exit_reason(failure))
                             for rank, failure in e.failures.items()})
        raise error from None
    except RendezvousError as e:
        coordinator.stopped("the rendezvous failed")
        raise DistributedError(
            f"ddp.rdzv_endpoint: no rendezvous at {config.ddp.rdzv_endpoint or STANDALONE_ENDPOINT} "
            f"within {config.ddp.timeout_s:g}s ({_first_line(e.__cause__ or e)}); check the host "
            "and port, that every node was started, and that they share ddp.rdzv_id") from None
    except SignalException as e:
        # The agent forwarded the signal to the ranks and waited for them (the grace period).
        stop = group_stop(error_file_messages(error_dir))
        if e.sigval == signal.SIGTERM:
            killed = any(agent.second_signal for agent in agents)
            raise preempted(coordinator, stop or GroupStop(None, (
                "a second SIGTERM came before the ranks stopped, and they were killed" if killed else
                "the ranks left no line within the grace period (system.preemption_grace_s)")
                + f"; {NOT_SAVED}")) from None
        coordinator.stopped(f"the launcher was stopped by {e.sigval.name}")
        raise DistributedError(f"stopped by {e.sigval.name}; the ranks were stopped too") from None
    finally:  # this launch's tokens stay out of later commands run in this process
        os.environ.pop(RANK_TOKENS_ENV, None)
        if given_token is not None:
            os.environ[TOKEN_ENV] = given_token
    coordinator.finished()


def unclaimed_store_ports() -> None:
    """Have the agent pick rank 0's store port below the ephemeral range (`unclaimed_port`).

    With a fresh store per round, the agent chooses that port with torch's `get_free_port`
    (bind port 0, close) and rank 0 listens on it only once its process has started: another
    socket of the machine could take it in between, and the group failed to form with
    EADDRINUSE. torch offers no setting for the choice, so the agent's module-level name is
    replaced (tests/unit/test_unclaimed_port.py fails if torch stops looking it up there).
    """
    rendezvous_api.get_free_port = unclaimed_port


def preempted(coordinator: RunCoordinator, stop: GroupStop) -> Preempted:
    """The launcher's error for a preempted group, told to the coordinator too."""
    line = stop.line(coordinator.config.system.checkpoint_dir)
    coordinator.report({rank: (Preempted.exit_code, line) for rank in coordinator.local_ranks})
    return Preempted(line)


def _exit_reason(failure) -> str:
    """How a rank's process ended, for the coordinator's registry."""
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    message = _failure_message(failure)
    return f"exit code {failure.exitcode}" + (f": {message}" if message else "")


def child_failure(error: ChildFailedError, max_restarts: int
                  ) -> ConfigError | CheckpointStoreError | DistributedError:
    """One line naming every rank that failed in the last attempt, a killed one first
    (the others usually only lost contact with it), but a rank the agent stopped itself
    (SIGTERM, once another had failed) last: the cause comes first; a rank whose
    checkpoint store failed for good is the cause, named alone with its line."""
    failures = sorted(error.failures.items(), key=lambda item: (_failure_order(item[1]), item[0]))
    stored = [(rank, f) for rank, f in failures if f.exitcode == CheckpointStoreError.exit_code]
    if stored:
        rank, failure = stored[0]
        return CheckpointStoreError(f"rank {rank}: {_failure_message(failure)}")
    if all(failure.exitcode == ConfigError.exit_code for _, failure in failures):
        rank, failure = failures[0]
        return ConfigError(f"rank {rank}: {_failure_message(failure)}")
    restarts = f" (after {max_restarts} restart(s))" if max_restarts else ""
    parts = []
    for rank, failure in failures:
        if failure.exitcode < 0:
            parts.append(f"rank {rank} was killed by {failure.signal_name()}")
            continue
        message = _failure_message(failure)
        parts.append(f"rank {rank} failed with exit code {failure.exitcode}"
                     + (f": {message}" if message else ""))
    return DistributedError("; ".join(parts) + restarts)


def _failure_order(failure) -> int:
    """0: killed by a signal from outside (a fault); 1: failed with an exit code; 2: stopped
    by the agent (SIGTERM), which tears the other ranks down once one failed."""
    if failure.exitcode >= 0:
        return 1
    return 2 if failure.signal_name() == "SIGTERM" else 0


def _failure_message(failure) -> str:
    """The one-line message a rank left in its error file ("" when it left none)."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = _EXCEPTION_PREFIX.sub("", _first_line(message)) if message else ""
    return "" if message.startswith(_NO_ERROR_FILE) else message


def _first_line(value: object) -> str:
    text = str(value).strip()
    return text.splitlines()[0] if text else type(value).__name__


class DDP:
    name = "ddp"

    def run(self, config: Config, options: RunOptions) -> RunSummary | None:
        if config.ddp.recovery == "live":
            return launch_live(config, options, preflight)
        return launch(config, options)


STRATEGY = DDP()
