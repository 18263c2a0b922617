"""`disttrain ddp --ddp-recovery live`: the launcher starts the ranks itself (no elastic
agent), hosts the store they agree through, and starts a dead rank again, which then
joins the running group (`rank`).

The store lives in this process, so it outlives every rank. Each rank is a child
process (`python -m disttrain.torchrun --rank R [--attempt A]`) under the supervisor,
restarted as its restart budget allows (`coordinator.budget`: a rank that died after the
group's step passed its furthest is restarted for free, `ddp.max_restarts` failures in a
row without progress are allowed); the store's address reaches the ranks in
their environment (`LIVE_STORE_ENV`). The run ends when every rank has finished. The
summary gains the launcher's view: each rank's process ids in order, and for each
recovery the seconds from the death of a process to its detection, to the re-formed
group training again, and (a rejoin) from the restart to the group training with it.

On several nodes (`ddp.num_nodes`), every node runs this launcher for its share of the
ranks, and the store is at `ddp.rdzv_endpoint`: the launcher of the machine that has the
endpoint's address hosts it (node 0, slots 0..k-1), the others reach it and take the
next node numbers in the order they come. Each launcher restarts its own ranks and marks
their deaths in the shared store; the host keeps the store up until every node's ranks
have ended. The last leader's node writes the summary.

An elastic run (`--world-size MIN:MAX`, `ddp.max_world_size`) starts MIN ranks and counts
its places in the store (`places`). A launcher started with `--join` reaches that store
at `--rdzv-endpoint`, takes a new slot and a free place (`claim_arrival`), and runs that
one rank, which joins the group at a step boundary. With hot spares (`ddp.spares`, in an
elastic run or one of fixed size) the launcher also starts that many ranks on new slots
that hold no place: each starts up and waits, and takes a place freed by a member that
left or died (here the place is freed at once, and the dead rank's process started again
waits as a spare). A rank that exits with 143 left the group on SIGTERM (`rank`): it is
not started again, its restart budget is untouched, and its place is free. A SIGTERM to
an arrival's launcher is passed to its rank (a leave); one to the host launcher stops the
run as before (its ranks die with it; `--resume` goes on from the newest checkpoint).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from disttrain.config import Config
from disttrain.coordinator.supervisor import Managed, Supervisor
from disttrain.core.auth import TOKEN_ENV
from disttrain.core.errors import (
    CheckpointStoreError,
    ConfigError,
    DistributedError,
    Preempted,
    store_failure,
)
from disttrain.core.identity import node_token
from disttrain.core.process_spec import RANK_ENTRY, ProcessSpec
from disttrain.core.processes import Cluster, sigterm_handled_by, thread_count
from disttrain.metrics.summary import SUMMARY_FILE, RunSummary
from disttrain.strategies.ddp.coordination import RunCoordinator, run_coordinator
from disttrain.strategies.ddp.heartbeats import node_id
from disttrain.strategies.ddp.live.group import DONE_KEY, mark_dead
from disttrain.strategies.ddp.live.membership import format_members
from disttrain.strategies.ddp.live.places import (
    claim_arrival,
    free_places,
    has_spares,
    left,
    num_places,
    open_places,
    spare_slots,
)
from disttrain.training.options import RunOptions

logger = logging.getLogger(__name__)

LIVE_STORE_ENV = "DISTTRAIN_LIVE_STORE"  # HOST:PORT of the launcher's store, for the ranks
STORE_HOST = "127.0.0.1"
NODES_KEY = "launcher/nodes"  # nodes other than the store's host count themselves in here
NODE_DONE_PREFIX = "launcher/done/"  # + node number: that node's ranks have all ended
EVENT_WAIT_S = 1.0


def live_problems(config: Config) -> list[str]:
    """What live recovery does not offer yet, each with the way out. (`resume` is offered:
    the group's leader writes checkpoints, see `live.checkpoints`; so are compression,
    PowerSGD included, see `compression.ddp_hooks`, gradient accumulation, loader workers,
    bf16 mixed precision, `ddp.lr_scaling`, measured `system.balance` and local updates,
    see `live.trainer`.)"""
    training, ddp = config.training, config.ddp
    rules = [
        (training.local_update_mode and config.system.balance != "none", "system.balance with local "
         "updates (training.sync_every)"),
        (bool(config.system.balance_batches), "system.balance_batches: a fixed plan (one batch per rank of "
         "the run, while a live group's size changes; system.balance proportional or auto measures instead)"),
        (training.precision == "fp16", "training.precision: fp16 (its loss scaling runs on CUDA GPUs; live "
         "groups train on the CPU, where bf16 is offered)"),
        (ddp.backend == "nccl", "ddp.backend: nccl (live groups are gloo, on the CPU)"),
    ]
    return [f"{what} is not offered with ddp.recovery live; leave it out or use ddp.recovery restart"
            for broken, what in rules if broken]


def rank_spec(config_path: Path, summary_path: Path, options: RunOptions, slot: int,
              attempt: int) -> ProcessSpec:
    """Slot `slot`'s process on its `attempt`-th start (> 0: it joins the running group)."""
    return ProcessSpec("", entry=RANK_ENTRY, config=config_path, summary_json=summary_path,
                       quiet_summary=True, faults=options.faults, verbose=options.verbose,
                       tls=options.tls, rank=slot, attempt=attempt, resume=options.resume)


@dataclass
class RankProcesses:
    """What the launcher saw of each slot: its process ids and start times, when each
    process died (wall-clock seconds), the slots that left, and the spares it started."""

    pids: dict[int, list[int]] = field(default_factory=dict)
    started_at: dict[int, list[float]] = field(default_factory=dict)
    deaths: list[tuple[float, int]] = field(default_factory=list)  # (when, slot)
    left: list[int] = field(default_factory=list)  # slots SIGTERMed that left the group
    spares: list[int] = field(default_factory=list)  # slots started as hot spares
    num_spares_started: int = 0  # spare processes: the spares, and lost members started again as spares
    lost_at: list[float] = field(default_factory=list)  # when a member died or left (a spare's cue)

    def started(self, slot: int, pid: int) -> None:
        self.pids.setdefault(slot, []).append(pid)
        self.started_at.setdefault(slot, []).append(time.time())

    def summary_fields(self, recoveries: list[dict[str, Any]], num_spares: int = 0) -> dict[str, Any]:
        """`rank_pids`, each recovery with its seconds (see `recovery_times`), and with hot
        spares the spares' fields (see `spare_fields`)."""
        timed = [recovery_times(r, self.deaths, self.started_at) for r in recoveries]
        shrinks = [r for r in timed if r["kind"] == "shrink"]
        grows = [r for r in timed if r["kind"] == "grow"]
        return {"rank_pids": {str(slot): pids for slot, pids in sorted(self.pids.items())},
                "live_recoveries": timed, "num_rejoins": len(grows),
                "live_detect_s": max((r["detect_s"] for r in shrinks if r.get("detect_s") is not None),
                                     default=None),
                "live_reform_s": max((r["reform_s"] for r in shrinks), default=None),
                "live_resume_s": max((r["resume_s"] for r in shrinks if r.get("resume_s") is not None),
                                     default=None),
                "live_rejoin_s": max((r["rejoin_s"] for r in grows if r.get("rejoin_s") is not None),
                                     default=None),
                **(self.spare_fields(timed) if num_spares else {})}

    def spare_fields(self, recoveries: list[dict[str, Any]]) -> dict[str, Any]:
        """`num_spares` (started beside the group), `num_spares_started` (with the lost
        members' processes started again as spares), and `spare_step_ins`: each spare that
        stepped in, with the step, the generation, and `after_loss_s` (from the latest
        death or leave before it to the group training with it)."""
        step_ins = []
        for recovery in recoveries:
            for slot in recovery.get("spares", []):
                before = [when for when in self.lost_at if when <= recovery["resumed_at"]]
                step_ins.append({"slot": slot, "step": recovery["step"], "generation": recovery["generation"],
                                 "at": recovery["resumed_at"],
                                 "after_loss_s": recovery["resumed_at"] - max(before) if before else None})
        return {"num_spares": len(self.spares), "num_spares_started": self.num_spares_started,
                "spare_step_ins": step_ins}


def recovery_times(recovery: dict[str, Any], deaths: list[tuple[float, int]],
                   started_at: dict[int, list[float]]) -> dict[str, Any]:
    """A recovery with its seconds. A shrink: `detect_s` (the death of the latest process
    that died before the group trained again, to the survivors noticing; 0 when they
    noticed before the launcher saw the exit), `reform_s` (noticing to training again)
    and `resume_s` (the death to training again). A grow: `rejoin_s` (the latest restart
    of a member before it, to the group training with it) and `reform_s`."""
    timed = dict(recovery)
    failed_at, resumed_at = recovery["failed_at"], recovery["resumed_at"]
    timed["reform_s"] = resumed_at - failed_at
    if recovery["kind"] == "shrink":
        before = [when for when, _ in deaths if when <= resumed_at]
        timed["detect_s"] = max(0.0, failed_at - max(before)) if before else None
        timed["resume_s"] = resumed_at - max(before) if before else None
    else:
        starts = [when for slot in recovery["members"] for when in started_at.get(slot, [])[1:]
                  if when <= resumed_at]
        timed["rejoin_s"] = resumed_at - max(starts) if starts else None
    return timed


def launch_live(config: Config, options: RunOptions, preflight) -> RunSummary | None:
    """Run this node's ranks with live recovery; return the summary (None on a node of a
    multi-node run where the last leader did not run).

    Args:
        preflight: the DDP launcher's checks (`launcher.preflight`).
    Raises:
        ConfigError: a setting live recovery does not offer, or bad input found by a rank.
        DistributedError: a rank failed more than `ddp.max_restarts` times.
    """
    started = time.perf_counter()
    problems = live_problems(config)
    if problems:
        raise ConfigError("; ".join(problems))
    joining = config.ddp.join
    preflight(config, options.resume or joining)  # an arrival leaves the run's checkpoints alone
    world_size, log_dir = config.system.num_workers, Path(config.system.log_dir)
    store, store_at, node = node_store(config)
    spares: list[int] = []
    if joining:
        slots = [claim_arrival(store, config)]
    else:
        per_node = world_size // config.ddp.num_nodes
        slots = list(range(node * per_node, (node + 1) * per_node))
        if num_places(config) and node == 0:
            open_places(store, config, store_at)
            spares = spare_slots(store, config)
    processes = RankProcesses(spares=list(spares))
    # The ranks' thread count (as the restart-mode launcher's), set before the coordinator
    # starts, so that one fork server starts them both.
    os.environ["OMP_NUM_THREADS"] = str(thread_count(config.system.num_threads, len(slots)))
    with tempfile.TemporaryDirectory(prefix="disttrain-ddp-live-") as folder:
        config_path, summary_path = Path(folder) / "config.yaml", Path(folder) / SUMMARY_FILE
        config.save(config_path)
        with arrival_coordinator(config) if joining else run_coordinator(
                config, config_path, options.token, options.tls, options.faults) as coordinator:
            coordinator.config.save(config_path)
            env = {LIVE_STORE_ENV: store_at}
            logger.info("starting rank(s) %d-%d of %s with live recovery (store %s), up to %d restart(s) "
                        "each%s", slots[0], slots[-1], f"{world_size}-{config.ddp.max_world_size}"
                        if config.ddp.max_world_size else world_size, store_at, config.ddp.max_restarts,
                        f", and {len(spares)} hot spare(s) (slot(s) {format_members(spares)}) that wait "
                        "and step in when a member is lost" if spares else "")
            try:
                with Cluster(log_dir, env=env, env_of=rank_tokens(coordinator.token)) as cluster, \
                        sigterm_handled_by(leave_on_sigterm(cluster) if joining else None):
                    start = RankStart(config, options, config_path, summary_path)
                    supervise(cluster, start, processes, store, slots + spares)
            except (ConfigError, CheckpointStoreError, DistributedError) as e:
                coordinator.stopped(str(e).splitlines()[0])
                raise
            finally:
                nodes_done(store, node, config.ddp.num_nodes, config.ddp.timeout_s)
            coordinator.finished()
        if not summary_path.is_file():
            return without_summary(config, store, processes, log_dir)
        summary = RunSummary.read(summary_path)
    recoveries = summary.extra.get("live_recoveries", [])
    summary.extra.update(processes.summary_fields(recoveries, config.ddp.spares))
    summary.total_time_s = time.perf_counter() - started
    summary.write(log_dir)
    return summary


def without_summary(config: Config, store: dist.Store, processes: RankProcesses, log_dir: Path) -> None:
    """This launcher's ranks have ended and none wrote the summary: the run's last leader
    ran under another launcher (another node, an arrival, or the host when this launcher
    is an arrival), or every rank left.

    Raises:
        Preempted: every rank of this launcher (not an arrival's, whose leave is its end)
            left (SIGTERM) before the run ended.
        DistributedError: the ranks finished but none wrote the summary.
    """
    if processes.left and config.ddp.join:
        logger.info("rank(s) %s left the run (SIGTERM); it goes on without them",
                    format_members(processes.left))
        return None
    if processes.left and not run_done(store):
        raise Preempted(f"rank(s) {format_members(processes.left)} left (SIGTERM) before the run ended; "
                        f"`--resume` goes on from the newest checkpoint in {config.system.checkpoint_dir}")
    if config.ddp.num_nodes > 1 or config.ddp.join or processes.left:
        logger.info("the run's last leader ran under another launcher; its summary is in that launcher's "
                    "log dir")
        return None
    raise DistributedError("the ranks finished but the last leader wrote no summary; see "
                           f"{log_dir}/rank*.log")


def run_done(store: dist.Store) -> bool:
    """Whether the run's last group finished (its ranks said so in the store)."""
    try:
        return store.check([DONE_KEY])
    except (RuntimeError, dist.DistError):  # the store's host is gone: the run is over
        return True


@contextmanager
def arrival_coordinator(config: Config) -> Iterator[RunCoordinator]:
    """An arrival's coordinator: the run's (`--coordinator`), else none (one of its own
    would watch this rank alone, and take the run's registry in a shared log dir)."""
    if not config.coordinator.address:
        logger.info("no coordinator watches this arrival; pass the run's --coordinator HOST:PORT to see it "
                    "in `disttrain status`")
    yield RunCoordinator(config, ())


def leave_on_sigterm(cluster: Cluster) -> Callable[[int, Any], None]:
    """An arrival's launcher SIGTERMed (a scheduler taking its machine back): each of its
    ranks is SIGTERMed too, so it leaves the group at a step boundary; the launcher ends
    when they have."""
    def handler(signum: int, frame: Any) -> None:
        for child in cluster.alive():
            os.kill(child.process.pid, signal.SIGTERM)
    return handler


def rank_tokens(secret: str | None) -> Callable[[ProcessSpec], dict[str, str]]:
    """The token each rank gets in its environment: its own node token (`core.identity`,
    node `rank<R>` in role rank), so it calls the coordinator in its own name only, not as
    the operator (none when the coordinator runs open)."""
    def env(spec: ProcessSpec) -> dict[str, str]:
        return {} if secret is None else {TOKEN_ENV: node_token(secret, node_id(spec.rank), "rank")}
    return env


def node_store(config: Config) -> tuple[dist.TCPStore, str, int]:
    """The store the ranks agree through, its HOST:PORT as the ranks reach it, and this
    node's number. One node: a store of this launcher on loopback (an elastic run given
    `ddp.rdzv_endpoint`: there, for arrivals from other machines). Several: the store at
    `ddp.rdzv_endpoint`, hosted by the launcher of the machine that has its address (node
    0), reached by the others (nodes 1, 2, ... in the order they come). An arrival
    (`ddp.join`) reaches the run's store there (node -1).

    Raises:
        DistributedError: the store could not be hosted or reached within `ddp.timeout_s`.
    """
    timeout = timedelta(seconds=config.ddp.timeout_s)
    ddp = config.ddp
    if ddp.num_nodes == 1 and not ddp.join and not (ddp.max_world_size and ddp.rdzv_endpoint):
        store = hosted_store(STORE_HOST, 0, timeout)
        return store, f"{STORE_HOST}:{store.port}", 0
    endpoint = config.ddp.rdzv_endpoint
    host, port = store_address(endpoint)
    address = None if ddp.join else local_address(host)  # an arrival reaches the run's store
    try:
        store = hosted_store(address, port, timeout) if address else \
            dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    except (OSError, RuntimeError, dist.DistError) as e:
        what = "host the live store on" if address else "reach the live store at"
        raise DistributedError(f"could not {what} ddp.rdzv_endpoint {endpoint} within {timeout.seconds}s "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); start the "
                               f"node that has that address, and check the port is free there") from e
    if ddp.join:
        return store, endpoint, -1  # not a node of the run's first ones
    node = 0 if address else int(store.add(NODES_KEY, 1))
    if node >= config.ddp.num_nodes:
        raise DistributedError(f"node {node + 1} came to the live store at {endpoint}, but ddp.num_nodes is "
                               f"{config.ddp.num_nodes}; give every node the same --nnodes")
    logger.info("node %d of %d (%s the live store at %s)", node, config.ddp.num_nodes,
                "hosting" if address else "using", endpoint)
    return store, endpoint, node


def hosted_store(address: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A store served on `address` alone (port 0: a free one). torch's own binds every
    interface; it is handed a socket listening on `address` instead, so a store meant for
    this machine (or the cluster's network) is not reachable from any other."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.bind((address, port))
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=listener.fileno())
        listener.detach()  # the store serves on this very socket: it must stay open
    return store


def local_address(host: str) -> str | None:
    """The address of `host` that this machine has (a socket can be bound to it), or None."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return None
    for address in sorted(addresses):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))
                return address
            except OSError:
                continue
    return None


def nodes_done(store: dist.Store, node: int, num_nodes: int, timeout_s: float) -> None:
    """This node's ranks have ended; the host (node 0) keeps the store up until every
    node's have (or `timeout_s` passed: a node that never comes is not waited for longer)."""
    if num_nodes == 1:
        return
    try:
        store.set(f"{NODE_DONE_PREFIX}{node}", "1")
        if node == 0:
            store.wait([f"{NODE_DONE_PREFIX}{n}" for n in range(1, num_nodes)], timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:
        logger.warning("not every node said its ranks ended (%s); stopping the live store", e)


@dataclass(frozen=True)
class RankStart:
    """What this node's rank processes start from: the run's config and options, the
    config file the ranks read, and where the last leader writes the summary."""

    config: Config
    options: RunOptions
    config_path: Path
    summary_path: Path


def supervise(cluster: Cluster, start: RankStart, processes: RankProcesses, store: dist.Store,
              slots: list[int]) -> None:
    """Start this node's ranks (`slots`, hot spares among them), restart each that dies as
    its restart budget allows (`coordinator.budget`: for free when the group's step had
    passed its furthest since it joined, else spending one of `ddp.max_restarts` in a row;
    past that the others finish without it), until all have ended; a death is marked in
    `store` at once (`group.mark_dead`). In a run with spares a dead rank's place is freed
    at once, for a waiting spare, and its process started again waits as a spare.

    Raises:
        ConfigError, DataError, CheckpointError, TrainingError: a rank failed with a user's
            error, or with the same unexpected error on a fresh start: restarting would not help.
    """
    config, options = start.config, start.options
    config_path, summary_path = start.config_path, start.summary_path
    supervisor = Supervisor(cluster, config.ddp.max_restarts, budget_key="ddp.max_restarts",
                            without_it="the others finish the run without it")
    spares = has_spares(store)
    for slot in slots:
        supervisor.start(Managed(f"rank{slot}", node_id(slot), lambda attempt, s=slot: rank_spec(
            config_path, summary_path, options, s, attempt), expendable=True))
        processes.started(slot, cluster.children[f"rank{slot}"].process.pid)
    processes.num_spares_started += len(processes.spares)
    while not all(p.finished or p.given_up for p in supervisor.processes.values()):
        event = cluster.next_event(EVENT_WAIT_S)
        if event is None or event.kind != "exit" or event.child not in supervisor.processes:
            continue
        code, slot = int(event.fields["code"]), int(event.child.removeprefix("rank"))
        if code == CheckpointStoreError.exit_code:  # a restart would fail the same way
            child = cluster.children[event.child]
            raise store_failure(f"rank {slot}", child.tail(20), child.log_path)
        if code == Preempted.exit_code:  # SIGTERMed, it left: not restarted, no budget spent
            left(store, slot)
            processes.left.append(slot)
            processes.lost_at.append(time.time())
            supervisor.processes[event.child].finished = True
            logger.info("rank %d left the run (SIGTERM); it is not started again", slot)
            continue
        if code != 0:
            mark_dead(store, slot)
            processes.deaths.append((time.time(), slot))
            processes.lost_at.append(time.time())
            if spares:  # a waiting spare takes its place now, not after this slot's restart
                free_places(store, slot)
        if supervisor.exited(event.child, code):
            processes.started(slot, cluster.children[event.child].process.pid)
            processes.num_spares_started += int(spares)
        elif supervisor.processes[event.child].given_up:
            free_places(store, slot)  # its place is free for an arrival or a spare


def store_address(value: str) -> tuple[str, int]:
    """(host, port) of `LIVE_STORE_ENV`'s HOST:PORT.

    Raises:
        DistributedError: not HOST:PORT.
    """
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(f"{LIVE_STORE_ENV}={value!r} is not HOST:PORT; a live rank is started by "
                               "`disttrain ddp --ddp-recovery live`")
    return host, int(port)


__all__ = ["LIVE_STORE_ENV", "launch_live", "store_address"]
