"""`disttrain status`: the cluster at a glance, from a running coordinator or its registry file."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from disttrain.cli.flags import add_tls_flags, add_token_flag, tls_from_args, token_from_args
from disttrain.coordinator.client import CoordinatorClient
from disttrain.coordinator.registry import RegistryError, read_status
from disttrain.core.addresses import parse_address
from disttrain.core.errors import DisttrainError, error_lines
from disttrain.core.refusal_log import printable
from disttrain.proto import coordinator_pb2 as pb

HELP = "show the cluster: every node, its state, progress, loss and speed, recoveries and events"
DESCRIPTION = """Show every process of a run as the coordinator sees it: role, rank, address,
machine (CPUs, memory, GPUs), state (alive, failed, done), time since its last
heartbeat, restarts, epoch, step, its latest training loss, and under proportional work
(--balance) its current batch and the speed it measured in its warm-up, beside the
throughput it has now, with stragglers marked; then the latest recoveries (how long each
failure took to detect, and the process to be back at work) and the latest events
(joined, failed, restarted, recovered, done, straggler, rebalanced). --json adds every
node's latest metrics (loss/train, accuracy/test, ...). Ask a running coordinator, or
read its registry file (works while no coordinator runs; never writes to the file).

    disttrain status --coordinator node0:50050
    disttrain status --registry logs/cluster.db
    disttrain status --coordinator node0:50050 --watch      # redraw every 2 s until Ctrl-C
    disttrain status --registry logs/cluster.db --json"""

NODE_KEYS = [f.name for f in pb.NodeStatus.DESCRIPTOR.fields]
EVENT_KEYS = [f.name for f in pb.ClusterEvent.DESCRIPTOR.fields]
COLUMNS = ("NODE", "ROLE", "RANK", "ADDRESS", "MACHINE", "STATE", "HEARTBEAT", "RESTARTS",
           "EPOCH", "STEP", "LOSS", "BATCH", "SAMPLES/S", "WARM-UP/S")
LOSS_KEY = "loss/train"  # the LOSS column: the latest training loss a node reported
BALANCE_LEGEND = ("BATCH: its batch now (plan N: after N-1 re-plans); SAMPLES/S: since its last "
                  "heartbeat; WARM-UP/S: before training")
RECOVERY_COLUMNS = ("TIME", "NODE", "DETECTED IN", "BACK IN", "REASON")
NUM_EVENTS = 10
NUM_RECOVERIES = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--coordinator", metavar="HOST:PORT", help="ask the coordinator running there")
    source.add_argument("--registry", metavar="PATH", help="read a coordinator's registry file")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="redraw every SECONDS (default 2) until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="print one JSON object (one per redraw)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_token_flag(parser)  # --coordinator only: --registry reads the file, no token needed
    add_tls_flags(parser)  # likewise


def run(args: argparse.Namespace) -> None:
    if args.coordinator:
        parse_address(args.coordinator, "--coordinator")
    if args.watch is not None and args.watch <= 0:
        raise DisttrainError("--watch SECONDS must be > 0, e.g. --watch 2")
    if args.watch is None:
        show(collect(args), args.json)
        return
    # Ctrl-C ends the watch between frames: a frame is never cut short mid-read (an
    # interrupted registry read would show as an error, or escape as a traceback).
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        _redraw(args)
        while not stop.wait(args.watch):  # the refresh period of a display
            _redraw(args)
    finally:
        signal.signal(signal.SIGINT, previous)


def _redraw(args: argparse.Namespace) -> None:
    """One frame of --watch; an error is shown and the next frame tries again."""
    if not args.json and sys.stdout.isatty():
        print("\033[H\033[2J", end="")
    try:
        show(collect(args), args.json)
    except DisttrainError as e:
        for line in error_lines(e):
            print(f"error: {line}", flush=True)


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """The cluster as one dict: source, generation, nodes, stragglers, recoveries, events.

    Raises:
        RegistryError: the registry file is missing, not a registry, or locked.
        CoordinatorError: the coordinator cannot be reached.
    """
    if args.coordinator:
        client = CoordinatorClient(args.coordinator, timeout_s=5.0, token=token_from_args(args),
                                   tls=tls_from_args(args))
        try:
            status = client.status()
        finally:
            client.close()
        nodes = [_message_dict(node) for node in status.nodes]
        events = [_message_dict(event) for event in status.events][-NUM_EVENTS:]
        recoveries = [_message_dict(recovery) for recovery in status.recoveries][-NUM_RECOVERIES:]
        generation, source = status.generation, f"coordinator {args.coordinator}"
        omitted = status.omitted_nodes
    else:
        snapshot = read_status(args.registry, NUM_EVENTS, NUM_RECOVERIES)
        nodes = [_registry_node(row, time.time(), args.registry) for row in snapshot.nodes]
        events = [{key: event[key] for key in EVENT_KEYS} for event in snapshot.events]
        recoveries = [asdict(recovery) for recovery in snapshot.recoveries]
        generation, source = snapshot.generation, f"registry {args.registry}"
        omitted = 0
    stragglers = [node["node_id"] for node in nodes if node["straggler"]]
    return {"source": source, "generation": generation, "nodes": nodes, "stragglers": stragglers,
            "recoveries": recoveries, "events": events, "omitted_nodes": omitted}


def _message_dict(message) -> dict[str, Any]:
    """A message as a dict: nested messages as dicts, maps as plain dicts."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = dict(value)
        elif field.message_type is not None:
            out[field.name] = _message_dict(value)
        else:
            out[field.name] = value
    return out


def _registry_node(row: dict[str, Any], wall_now: float, registry: str) -> dict[str, Any]:
    """A registry row in the shape of the coordinator's answer (heartbeat age from now).

    Raises:
        RegistryError: a figure is NULL (a NaN, which only an earlier disttrain stored).
    """
    node = {key: row.get(key) for key in NODE_KEYS}
    if any(node[key] is None for key in ("throughput", "step_time_s", "warmup_speed")):
        raise RegistryError(f"{registry} was written by an earlier disttrain (node "
                            f"{printable(node['node_id'])} has no throughput figures); pass the "
                            "--registry of a run of this one")
    last = row.get("last_heartbeat")
    node["heartbeat_age_s"] = -1.0 if last is None else max(0.0, wall_now - last)
    return node


def show(cluster: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(cluster), flush=True)
        return
    print("\n".join(render(cluster)), flush=True)


def render(cluster: dict[str, Any]) -> list[str]:
    """The human view: a header, the node table, stragglers, the latest events; characters
    a terminal would act on (a bidirectional override in a reason) escaped."""
    nodes = cluster["nodes"]
    counts = {state: sum(node["state"] == state for node in nodes) for state in ("alive", "failed", "done")}
    lines = [f"cluster generation {cluster['generation']}: {len(nodes)} nodes "
             f"({', '.join(f'{n} {state}' for state, n in counts.items())}), from {cluster['source']}"]
    if cluster.get("omitted_nodes"):
        lines.append(f"({cluster['omitted_nodes']} older ended nodes not shown: the answer is kept small)")
    if cluster["source"].startswith("registry"):
        lines.append("(as the coordinator last recorded it; alive nodes may have stopped since)")
    lines += [""] + _table([COLUMNS] + [_row(node) for node in nodes]) if nodes else ["", "no nodes yet"]
    if any(node["batch_size"] or node["warmup_speed"] for node in nodes):
        lines.append(BALANCE_LEGEND)
    if cluster["stragglers"]:
        slow = {node["node_id"]: node["step_time_s"] for node in nodes}
        lines.append("* straggler: " + ", ".join(f"{n} ({slow[n]:.3f}s/step)" for n in cluster["stragglers"]))
    if cluster["recoveries"]:
        lines += ["", "recoveries (DETECTED IN: from its last heartbeat, 0 when its exit was reported; "
                      "BACK IN: from then to its first heartbeat after):"]
        lines += ["  " + line for line in _table([RECOVERY_COLUMNS] + [_recovery_row(r)
                                                                        for r in cluster["recoveries"]])]
    if cluster["events"]:
        lines += ["", "latest events:"]
        lines += [f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))}  {e['node_id']}  {e['kind']}: "
                  f"{e['detail']}" for e in cluster["events"]]
    return [printable(line) for line in lines]


def _row(node: dict[str, Any]) -> tuple[str, ...]:
    mark = "*" if node["straggler"] else ""
    return (node["node_id"] + mark, node["role"], str(node["rank"]) if node["rank"] >= 0 else "-",
            node["address"] or "-", describe_machine(node), node["state"],
            describe_age(node["heartbeat_age_s"]), str(node["restarts"]), str(node["epoch"]),
            str(node["step"]), describe_loss(node), describe_batch(node), f"{node['throughput']:.1f}",
            f"{node['warmup_speed']:.1f}" if node["warmup_speed"] else "-")


def _recovery_row(recovery: dict[str, Any]) -> tuple[str, ...]:
    return (time.strftime("%H:%M:%S", time.localtime(recovery["time"])), recovery["node_id"],
            f"{recovery['detect_s']:.2f}s", f"{recovery['recover_s']:.2f}s", recovery["reason"])


def describe_loss(node: dict[str, Any]) -> str:
    """The node's latest training loss, e.g. "0.4213"; "-" when it reported none (a server)."""
    loss = (node.get("metrics") or {}).get(LOSS_KEY)
    return "-" if loss is None else f"{loss:.4f}"


def describe_machine(node: dict[str, Any]) -> str:
    """E.g. "vm: 8 CPU, 31.2 GB, no GPU" or "gpu1: 32 CPU, 270.1 GB, 2x NVIDIA H100"."""
    caps = node.get("capabilities") or {}
    memory = f"{caps['memory_bytes'] / 1e9:.1f} GB" if caps.get("memory_bytes") else "? GB"
    text = f"{caps.get('cpus') or '?'} CPU, {memory}, {describe_gpus(caps)}"
    return f"{node['hostname']}: {text}" if node.get("hostname") else text


def describe_gpus(caps: dict[str, Any]) -> str:
    """E.g. "2x NVIDIA H100", "no GPU"; the name alone when the count is unknown (0)."""
    name, count = caps.get("gpu") or "", caps.get("gpu_count") or 0
    if count and name:
        return f"{count}x {name}"
    return name or (f"{count} GPU" if count else "no GPU")


def describe_batch(node: dict[str, Any]) -> str:
    """E.g. "96 (plan 2)" after a re-plan, "64" on the plan it started with, "-" unknown."""
    if not node["batch_size"]:
        return "-"
    return f"{node['batch_size']} (plan {node['plans']})" if node["plans"] > 1 else str(node["batch_size"])


def describe_age(age_s: float) -> str:
    if age_s < 0:
        return "never"
    return f"{age_s:.1f}s ago" if age_s < 60 else f"{age_s / 60:.0f}m ago"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows]
