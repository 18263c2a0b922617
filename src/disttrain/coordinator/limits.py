"""What the coordinator accepts at its door: the bounds of every string, list and figure
a caller sends, checked before anything is decided, so one call can neither bloat the
membership (and its registry, and every status answer) nor put control characters into
logs and terminals.

Each check raises ValueError naming the field and its limit (the servicer answers
INVALID_ARGUMENT); `printable` (core's) escapes the refused value it quotes.
"""

from __future__ import annotations

import math
import re

from disttrain.core.refusal_log import CONTROL, printable
from disttrain.proto import coordinator_pb2 as pb

MAX_ID_CHARS = 128
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]*")  # worker-0, rank-3, server-1, ...
MAX_ADDRESS_CHARS = 256  # address, hostname
MAX_TEXT_CHARS = 256  # the GPU name
MAX_REASON_CHARS = 1024  # an exit reason
MAX_RANK = 65535
MAX_METRIC_KEY_CHARS = 128
MAX_COUNT = 2**53  # steps, memory bytes: far beyond any real one, exact in a double


def check_node_id(node_id: str, field: str = "node_id") -> None:
    """Raises ValueError unless `node_id` is 1..MAX_ID_CHARS of letters, digits and ._:@+/-"""
    if not node_id:
        raise ValueError(f"{field} is empty; give every process a unique id, e.g. worker-0")
    if len(node_id) > MAX_ID_CHARS:
        raise ValueError(f"{field} has {len(node_id)} characters, at most {MAX_ID_CHARS} are allowed")
    if not ID_PATTERN.fullmatch(node_id):
        raise ValueError(f"{field} '{printable(node_id)}' has characters other than letters, digits "
                         "and ._:@+/- (or does not start with a letter or digit)")


def check_text(value: str, field: str, limit: int) -> None:
    """Raises ValueError when `value` is longer than `limit` or holds control characters."""
    if len(value) > limit:
        raise ValueError(f"{field} has {len(value)} characters, at most {limit} are allowed")
    if CONTROL.search(value):
        raise ValueError(f"{field} '{printable(value)}' holds control characters; send printable text")


def check_figure(value: float, field: str, limit: float = float(MAX_COUNT)) -> None:
    """Raises ValueError unless `value` is finite and in [0, limit]."""
    if not (math.isfinite(value) and 0 <= value <= limit):
        raise ValueError(f"{field} is {value}; it must be a finite number in [0, {limit:g}]")


def check_registration(request: pb.RegisterNodeRequest) -> None:
    """Raises ValueError for a field of `request` out of bounds (the role is the
    membership's to check)."""
    check_node_id(request.node_id)
    check_text(request.role, "role", MAX_ID_CHARS)
    if not -1 <= request.rank <= MAX_RANK:
        raise ValueError(f"rank is {request.rank}; it must be -1 (not known yet) or in [0, {MAX_RANK}]")
    check_text(request.address, "address", MAX_ADDRESS_CHARS)
    check_text(request.hostname, "hostname", MAX_ADDRESS_CHARS)
    _check_pid(request.pid)
    capabilities = request.capabilities
    check_text(capabilities.gpu, "capabilities.gpu", MAX_TEXT_CHARS)
    for name in ("cpus", "memory_bytes", "gpu_count"):
        check_figure(getattr(capabilities, name), f"capabilities.{name}")


def check_heartbeat(request: pb.HeartbeatMessage) -> None:
    """Raises ValueError for a field of `request` out of bounds: a figure negative or not
    finite (throughput NaN would be stored as NULL), or no pid."""
    check_node_id(request.node_id)
    check_text(request.role, "role", MAX_ID_CHARS)
    _check_pid(request.pid)
    for name in ("epoch", "step", "batch_size", "plans", "throughput", "step_time_s", "warmup_speed"):
        check_figure(getattr(request, name), name)


def check_metrics(request: pb.MetricsReport) -> None:
    """Raises ValueError for an id, step or metric key out of bounds (values: the membership's)."""
    check_node_id(request.node_id)
    check_figure(request.step, "step")
    for key in request.scalars:
        check_text(key, "scalars key", MAX_METRIC_KEY_CHARS)


def check_exit(request: pb.ExitReport) -> None:
    """Raises ValueError for an id or reason out of bounds."""
    check_node_id(request.node_id)
    check_text(request.reason, "reason", MAX_REASON_CHARS)


def _check_pid(pid: int) -> None:
    # A pid is how the coordinator tells a node's process from an old or a foreign one:
    # without it a heartbeat would keep any node alive.
    if pid <= 0:
        raise ValueError(f"pid is {pid}; send the process id of the node (os.getpid())")
