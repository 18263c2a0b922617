"""Hosts for multi-host tests, made as Linux network namespaces on this machine.

Every host is a namespace with one interface, `eth0`, addressed from 192.0.2.0/24
(reserved for documentation, so it never collides with a real network). The hosts meet
on a bridge that lives in a namespace of its own (the switch), so nothing of the test is
in this machine's own network namespace: deleting the namespaces removes every veth and
the bridge with them. Names start with `dtmh<pid>` so that parallel runs do not collide,
and leftovers of runs whose process is gone are removed before a new network is made.

Each host also has its own host name (`host-<name>`, in a UTS namespace of the process)
and a hosts file naming every host (`/etc/netns/<namespace>/hosts`, which `ip netns exec`
mounts over /etc/hosts), as machines on one network have: torch's rendezvous and gloo
find a node's address from its host name. Processes run through `ip netns exec` and
`unshare`, each of which execs the command itself: the test process stays their parent
(a launched disttrain process dies with it).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.core.processes import EVENT_PREFIX

PREFIX = "dtmh"
_counter = itertools.count()
SUBNET_PREFIX = "192.0.2."
NETNS_ETC = Path("/etc/netns")
# Run as the host: its own host name, then the command (exec'd, so the pid stays).
_AS_HOST = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"']
_COMMAND_TIMEOUT_S = 20


class NamespacesUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no `ip`, a kernel without them)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `ip ARGS`; raise with its stderr when it fails and `check`."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    ip("netns", "delete", probe, check=False)
    return None


def remove_leftovers() -> list[str]:
    """Delete namespaces of earlier runs (our prefix, and a pid no longer alive); their
    names. Namespaces of live runs are left alone."""
    removed = []
    listing = ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{PREFIX}(\d+)\D.*", name)
        if match and not _pid_alive(int(match.group(1))):
            ip("netns", "delete", name, check=False)
            removed.append(name)
    for folder in NETNS_ETC.glob(f"{PREFIX}*") if NETNS_ETC.is_dir() else []:
        match = re.fullmatch(rf"{PREFIX}(\d+)\D.*", folder.name)
        if match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Host:
    """One namespace: its name, its address on the bridge, its port on the switch."""

    name: str
    namespace: str
    address: str
    switch_port: str
    switch: str
    hostname: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *args: str) -> subprocess.CompletedProcess:
        """A short command in this host (`ip netns exec`), checked."""
        result = subprocess.run(self.command(list(args)), capture_output=True,
                                text=True, timeout=_COMMAND_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} in {self.name}: {result.stderr.strip()}")
        return result

    def start(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start a long-running process in this host, its stdout and stderr to `log`."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log, "w") as out:
            process = subprocess.Popen(self.command(args), stdout=out,
                                       stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        self.processes.append(process)
        return process

    def command(self, args: list[str]) -> list[str]:
        """`args` as a command line that runs in this host, under its host name."""
        return ["ip", "netns", "exec", self.namespace, *_AS_HOST, self.hostname, *args]

    def set_link(self, up: bool) -> None:
        """Cut this host's cable (both ends down) or plug it back in."""
        state = "up" if up else "down"
        ip("-n", self.switch, "link", "set", self.switch_port, state)
        ip("-n", self.namespace, "link", "set", "eth0", state)

    def limit_rate(self, rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
        """Limit this host's link to `rate` (tc tbf) in both directions: its own egress and
        the switch port's egress toward it."""
        for namespace, device in ((self.namespace, "eth0"), (self.switch, self.switch_port)):
            subprocess.run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf",
                            "rate", rate, "burst", burst, "latency", latency], check=True,
                           capture_output=True, timeout=_COMMAND_TIMEOUT_S)

    def stop_processes(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process started here (its whole session), SIGKILL what outlives `grace_s`."""
        for process in self.processes:
            _signal_session(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                _signal_session(process, signal.SIGKILL)
                process.wait(timeout=grace_s)


def _signal_session(process: subprocess.Popen, signum: int) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


class Network:
    """Hosts joined by one bridge; a context manager that removes all of it on exit.

    `Network(["a", "b", "c"])` makes hosts a, b, c at 192.0.2.1, .2, .3.
    """

    def __init__(self, names: list[str]):
        self.tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.switch = f"{self.tag}sw"
        self.hosts: dict[str, Host] = {}
        self._names = names

    def __enter__(self) -> Network:
        remove_leftovers()
        try:
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for index, name in enumerate(self._names, start=1):
                self.hosts[name] = self._add_host(name, index)
            names = "".join(f"{h.address} {h.hostname}\n" for h in self.hosts.values())
            for host in self.hosts.values():
                (NETNS_ETC / host.namespace).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / host.namespace / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, name: str, index: int) -> Host:
        namespace, port = f"{self.tag}{name}", f"p{index}"
        ip("netns", "add", namespace)
        host = Host(name, namespace, f"{SUBNET_PREFIX}{index}", port, self.switch, f"host-{name}")
        # Made inside the switch, the host end then moved: no name touches this machine's namespace.
        ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns",
           namespace)
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")
        ip("-n", namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        return host

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process started in a host, then delete every namespace (veths and the
        bridge go with them)."""
        for host in self.hosts.values():
            host.stop_processes()
        for namespace in [h.namespace for h in self.hosts.values()] + [self.switch]:
            ip("netns", "delete", namespace, check=False)
            shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)

    def namespaces(self) -> list[str]:
        return [h.namespace for h in self.hosts.values()] + [self.switch]


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    """Poll `predicate` until it returns something true (returned), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(poll_s)


def read_event(log: Path, kind: str, process=None, timeout_s: float = 60) -> dict:
    """The first event line of `kind` a process printed to `log` (waits for it, at most
    `timeout_s`; fails at once when the process exits first)."""
    def find():
        for line in log.read_text().splitlines():
            if line.startswith(EVENT_PREFIX):
                fields = json.loads(line[len(EVENT_PREFIX):])
                if fields.get("event") == kind:
                    return fields
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{log.name}: exited {process.returncode} before its {kind} event:\n"
                                 + log.read_text()[-3000:])
        return None

    return wait_for(find, timeout_s, f"the {kind} event in {log.name}")
