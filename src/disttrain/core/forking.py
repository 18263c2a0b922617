"""Start a launcher's children by forking a process that has imported torch already.

A child of a cluster (a shard, a worker, a DDP rank, a run of `compare`) spends about two
seconds of CPU importing torch, and `torch._dynamo`, which torch imports on an optimizer's
first `step`, before its first line of work; a two-worker parameter server starts four or
five of them. A launcher instead starts its children through a fork server: one process
(`main`) that imports those modules once, then forks one child for each
`python -m MODULE ARGS` it is asked to run (the figures: docs/testing.md). The layer that
knows what its children run names more modules for it to import (`preload`: the command
line's own, the worker's, the shard's, TensorBoard's, another half second of CPU a child).

A forked child is the fork server's child, not the launcher's, so `ForkedProcess` gives the
launcher what `subprocess.Popen(start_new_session=True)` gave it: the child's pid, in a
session of its own before `ForkedProcess` returns (a signal to its process group reaches
it), its stdout as a pipe, its stderr in its log, its exit status (negative for a signal),
its command line in `ps`, and its death with the launcher's: the fork server exits when the
launcher's end of their socket closes, however the launcher died, and the kernel kills a
child with its fork server (`die_with_parent`, asked for right after the fork). The fork
server runs nothing but imports (no gRPC, no torch operation, one thread of Python), so a
fork carries nothing over half-made; and
it never reads what a child is to run or its environment (a token among it), which the
launcher writes to the child alone, so no child's memory holds another's credentials.

Written here rather than taken from `multiprocessing`'s fork server, which runs the
launcher's main script again in every child (a user's script calling `disttrain.fit`
without a `__main__` guard would train again in each) and reaps a child from whichever
thread starts the next process.

A launcher that was forked itself (a run of `compare`, a command a test runs) asks its own
fork server for a fork of it to serve as its fork server (`_Server.for_env`): torch imported
already, and no request read, so no credential in it either.

`DISTTRAIN_FORK_SERVER=0` starts every child as a fresh interpreter instead, as does a
platform without `os.pidfd_open` (Linux before 5.3, or not Linux).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import importlib
import json
import logging
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Any

logger = logging.getLogger(__name__)

FORK_SERVER_ENV = "DISTTRAIN_FORK_SERVER"  # "0": every child a fresh interpreter
PRELOAD = ("torch", "torch._dynamo")  # what every child imports first (see the module's doc)
# More modules the children of this process's fork servers import, named by a layer above
# (`preload`): a fork server started after imports them too.
_preloads: list[str] = []
_PR_SET_PDEATHSIG = 1
_FORK = b"fork"  # a child: with the request, its stdout, stderr, exit-status and request pipes
_SERVE = b"serve"  # a fork server for a child (JSON follows: its pid, what it shows), with its socket

# What a new interpreter reads from its environment before its first line runs (the
# interpreter, the dynamic loader, the OpenMP and BLAS runtimes torch loads, torch's
# import): a fork server starts with a child's values of these and nothing else, so a
# child's start-up settings are its own (a fork server for each set of them), and no
# credential of the launcher's environment reaches a fork server, whose memory every
# child it forks copies.
# gRPC and protobuf read theirs as a fork server imports them for its children (`preload`).
STARTUP_ENV = ("PATH", "HOME", "USER", "LANG", "LC_", "TZ", "TMPDIR", "PYTHON", "VIRTUAL_ENV",
               "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH_", "GRPC_",
               "PROTOCOL_BUFFERS_")
_ARGV_ROOM = 4096  # bytes a child's command line may take in /proc/PID/cmdline (see `_Server`)
# Variables a forked child shows in /proc/PID/environ as a new interpreter started with its
# environment would: a `chaos` run finds every process of a launch by its tag there
# (`DISTTRAIN_CHAOS_RUN`, a new one each launch). A forked child's /proc/PID/environ is its
# fork server's start-up block, so a fork server starts with room in it (`_ENV_ROOM`, found
# once, `_room`), which each child, and each fork server forked for a launcher, writes its
# own of these over (`_show`): one fork server serves every launch of a campaign.
SHOWN_ENV = ("DISTTRAIN_CHAOS_RUN",)  # by name: never a credential (the fork server reads them)
_ENV_ROOM = "DISTTRAIN_FORK_ROOM"
_ENV_ROOM_BYTES = 512
_room: tuple[int, int] | None = None  # in a fork server and its children: the room's address and size

_servers_lock = threading.Lock()
_servers: dict[tuple[tuple[str, str], ...], _Server] = {}
# Set in a forked child only: its socket to the fork server it was forked from, and that
# server's environment (`_Server.for_env`).
_parent: _Parent | None = None
_started_with: dict[str, str] = {}  # in a fork server: the environment it was started with
# Start-up variables whose effect a forked child has whatever its fork server started with,
# from its own environment (set before its code runs): a fork server runs with -u, and torch
# reads the other two (a DDP launcher's and its elastic agent's for the ranks) only when a
# rendezvous or a process group is made, never at its import.
_READ_AT_RUN = ("PYTHONUNBUFFERED", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def preload(*modules: str) -> None:
    """Have each fork server this process starts from now on import `modules` (after
    PRELOAD) before its first fork: a module every child would import is then imported
    once, not once a child. Only modules whose import starts no thread and reads no
    variable of a child's environment but a start-up one (STARTUP_ENV), or whose readings
    `_read_settings_again` takes from the child's: a child gets them as its fork server made
    them."""
    _preloads.extend(name for name in modules if name not in _preloads)


def forking() -> bool:
    """Whether a launcher's children are forked from the fork server."""
    return hasattr(os, "pidfd_open") and os.environ.get(FORK_SERVER_ENV, "1") != "0"


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when the thread that forked it ends (its
    parent's death, SIGKILL included); False where there is no such call (not Linux)."""
    libc_name = ctypes.util.find_library("c")
    if not (sys.platform.startswith("linux") and libc_name):
        return False
    return ctypes.CDLL(libc_name, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


class ForkServerError(RuntimeError):
    """The fork server could not start a child (it exited, or its fork failed)."""


def startup_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` a fork server starts with (STARTUP_ENV, less _READ_AT_RUN)."""
    return {name: value for name, value in env.items()
            if name.startswith(STARTUP_ENV) and name not in _READ_AT_RUN}


@dataclass
class _Parent:
    """A forked child's end of its own fork server (see `_Server.for_env`)."""

    socket: socket.socket
    env: dict[str, str]
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Server:
    """The launcher's end of one fork server: one request (and its reply) at a time.
    `process`: the fork server, where this process started it as a new interpreter (else
    it is a child of this process's own fork server)."""

    def __init__(self, sock: socket.socket, pid: int, process: subprocess.Popen | None = None) -> None:
        self.socket, self.pid, self.process = sock, pid, process
        self.exited = os.pidfd_open(pid)  # readable once it has exited
        self.lock = threading.Lock()

    @classmethod
    def for_env(cls, env: dict[str, str]) -> _Server:
        """A fork server started with the start-up variables `env`. A launcher that was
        forked itself (a run of `compare`, a command a test runs) asks its own fork server
        for a fork of it: its imports done, in milliseconds rather than the seconds a new
        interpreter takes to import torch, and as free of credentials (it has read no
        request). Elsewhere, or when `env` differs from that server's, a new interpreter."""
        parent = _parent
        if parent is not None and env == startup_env(parent.env):
            try:
                return cls._forked(parent)
            except (OSError, ForkServerError) as e:
                logger.debug("a new fork server: %s", e)  # that fork server is gone
        elif parent is not None:
            differing = {name for name, _ in set(env.items()) ^ set(startup_env(parent.env).items())}
            logger.debug("a new fork server: start-up variables %s differ from this process's "
                         "fork server's", sorted(differing))
        return cls._started(env)

    @classmethod
    def _started(cls, env: dict[str, str]) -> _Server:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # A child writes its command line where the fork server's was: the code's trailing
        # comment makes room for it.
        modules = (*PRELOAD, *_preloads)
        code = f"from {__name__} import main; main({theirs.fileno()}, {modules!r})  #" + " " * _ARGV_ROOM
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-u", "-c", code], pass_fds=[theirs.fileno()],
                # (it shows this process's own: a process of the same chaos run as this one)
                env={**env, **shown_env(os.environ), _ENV_ROOM: " " * _ENV_ROOM_BYTES},
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        return cls(ours, process.pid, process)

    @classmethod
    def _forked(cls, parent: _Parent) -> _Server:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs, parent.lock:
            # It serves this process: it shows this process's variables (its chaos run's tag).
            serve = {"launcher": os.getpid(), "shown": shown_env(os.environ)}
            socket.send_fds(parent.socket, [_SERVE + json.dumps(serve).encode()], [theirs.fileno()])
            reply = parent.socket.recv(4096)
        if not reply or "error" in (answer := json.loads(reply)):
            ours.close()
            raise ForkServerError(f"this process's fork server did not fork one for it: {reply!r}")
        return cls(ours, int(answer["pid"]))

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None  # (and reaps it once it has exited)
        return not select.select([self.exited], [], [], 0)[0]

    def fork(self, fds: list[int]) -> int:
        with self.lock:
            try:
                socket.send_fds(self.socket, [_FORK], fds)
                reply = self.socket.recv(4096)
            except OSError as e:
                raise ForkServerError(f"the fork server (pid {self.pid}) is gone: {e}") from e
        if not reply:
            raise ForkServerError(f"the fork server (pid {self.pid}) exited")
        answer = json.loads(reply)
        if "error" in answer:
            raise ForkServerError(f"the fork server could not fork: {answer['error']}")
        return int(answer["pid"])


def _fork(fds: list[int], env: dict[str, str]) -> int:
    """The pid of the child forked with `fds` by the fork server for `env`'s start-up
    settings (started, or started again, when there is none alive)."""
    settings = startup_env(env)
    key = tuple(sorted(settings.items()))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            if server is not None:
                server.socket.close()
                os.close(server.exited)
            server = _servers[key] = _Server.for_env(settings)
    return server.fork(fds)


class ForkedProcess:
    """`python -u -m MODULE ARGS` forked from the fork server, with the part of
    `subprocess.Popen`'s interface a launcher uses: `pid`, `stdout`, `poll`, `wait`,
    `returncode`, `send_signal`, `terminate`, `kill`.

    Args:
        command: the module to run as `__main__`, then its arguments (`sys.argv[1:]`).
        env: the child's whole environment.
        stderr: the file descriptor its stderr goes to (its log).
        parent_env: a variable the child finds set to its parent's pid (the fork
            server's), for `processes.bind_to_parent`.
        cwd: the folder it starts in (None: this process's).
        stdout: the file descriptor its stdout goes to (None: a pipe, read from `stdout`).
    Raises:
        ForkServerError: no child was started.
    """

    def __init__(self, command: list[str], env: dict[str, str], stderr: int,
                 parent_env: str | None = None, cwd: str | os.PathLike | None = None,
                 stdout: int | None = None):
        module, *args = command
        self.args = [module, *args]
        out_read, out_write = os.pipe() if stdout is None else (None, stdout)
        status_read, status_write = os.pipe()
        request_read, request_write = os.pipe()
        try:
            self.pid = _fork([out_write, stderr, status_write, request_read], env)
        except BaseException:
            if out_read is not None:
                os.close(out_read)
            os.close(status_read)
            os.close(request_write)
            raise
        finally:
            if out_read is not None:
                os.close(out_write)
            os.close(status_write)
            os.close(request_read)
        # What to run, and with which environment (its token among it), goes to the child
        # alone, never through the fork server, whose memory every later child copies.
        request = {"module": module, "args": list(args), "env": dict(env),
                   "cwd": os.fspath(cwd or os.getcwd()), "parent_env": parent_env}
        try:
            with os.fdopen(request_write, "wb") as pipe:
                pipe.write(json.dumps(request).encode())
        except BrokenPipeError:
            pass  # it died before it read it: its exit status tells
        self.stdout: IO[bytes] | None = None if out_read is None else os.fdopen(out_read, "rb")
        self.returncode: int | None = None
        self._exited = threading.Event()
        threading.Thread(target=self._reap, args=(status_read,), name=f"reap-{self.pid}", daemon=True).start()

    def _reap(self, status: int) -> None:
        """Its exit status, which the fork server writes when it reaps it. Without one
        (the fork server was killed), the child was too: the kernel kills it with its
        parent (`processes.bind_to_parent`)."""
        with os.fdopen(status, "rb") as pipe:
            text = pipe.read()
        self.returncode = int(text) if text else -signal.SIGKILL
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode if self._exited.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if not self._exited.is_set():
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(command: list[str], env: dict[str, str], stdout: int | None, stderr: int,
          parent_env: str | None = None, cwd: str | os.PathLike | None = None
          ) -> subprocess.Popen | ForkedProcess:
    """Start `command`, this interpreter running a module (`python [-u] -m MODULE ARGS`),
    as `subprocess.Popen(command, env=env, stdin=DEVNULL, stdout=stdout, stderr=stderr,
    start_new_session=True, cwd=cwd)` would (`stdout` None: a pipe): forked from the fork
    server where it can be (`forking()`, and the fork server started), else a new
    interpreter. `parent_env`: as for `ForkedProcess`."""
    flags = command[1:command.index("-m")] if "-m" in command else None
    if forking() and command[0] == sys.executable and flags is not None and set(flags) <= {"-u"} \
            and len(command) > len(flags) + 2:
        try:
            return ForkedProcess(command[len(flags) + 2:], env, stderr, parent_env=parent_env, cwd=cwd,
                                 stdout=stdout)
        except ForkServerError as e:
            logger.warning("%s; starting %s as a new interpreter", e, command[len(flags) + 2])
    return subprocess.Popen(command, stdout=subprocess.PIPE if stdout is None else stdout, stderr=stderr,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True, cwd=cwd)


# The fork server's side.

def serve(fd: int, modules: tuple[str, ...]) -> dict[str, Any] | None:
    """Import `modules` (PRELOAD and the launcher's `preload`s), then serve the launcher on
    socket `fd` (`_serve`). In a child, returns what it is to run, its process set up; None
    once the launcher is gone."""
    global _started_with
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher alone hears a Ctrl-C, as before
    _set_command_line(["disttrain-fork-server", f"--launcher={os.getppid()}"])
    _make_room()
    _started_with = dict(os.environ)  # (an import may set more: torch's inductor its cache folder)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a child that needs it imports it again and says why
            pass
    # What was imported stays for good: out of the collector's sight, a child's collections
    # never write to (and so copy) the pages it shares with this process.
    gc.freeze()
    return _serve(socket.socket(fileno=fd))


def _serve(launcher: socket.socket) -> dict[str, Any] | None:
    """Answer the requests of the launcher and of each child still running, until the
    launcher's end closes: b"fork" (with the child's stdout, stderr, exit-status and
    request pipes) forks a child, which gets a socket of its own to this process; b"serve"
    and a pid (with a socket) forks a fork server for that child, a launcher itself, to
    serve on the socket. Each child's exit status goes to its pipe once it is reaped."""
    selector = selectors.DefaultSelector()
    selector.register(launcher, selectors.EVENT_READ, None)
    while True:
        for key, _ in selector.select():
            if isinstance(key.data, tuple):  # a child's pidfd: it exited
                pid, status = key.data
                selector.unregister(key.fd)
                os.close(key.fd)
                _, wait_status = os.waitpid(pid, 0)
                if status is not None:  # (a fork server's has none)
                    with os.fdopen(status, "wb") as pipe:
                        pipe.write(str(os.waitstatus_to_exitcode(wait_status)).encode())
                continue
            caller: socket.socket = key.fileobj  # type: ignore[assignment]
            message, fds, _, _ = socket.recv_fds(caller, 4096, 4)
            if not message and caller is launcher:
                return None  # the launcher is gone: so are this process and its children
            if not message:  # a child is gone, or closed its end
                selector.unregister(caller)
                caller.close()
                continue
            serving = message.startswith(_SERVE)
            ours, theirs = (None, None) if serving else socket.socketpair(socket.AF_UNIX,
                                                                          socket.SOCK_SEQPACKET)
            try:
                pid = _fork_child(fds, status_fd=None if serving else fds[2])
            except OSError as e:
                for fd_ in fds:
                    os.close(fd_)
                for end in (ours, theirs):
                    if end is not None:
                        end.close()
                caller.send(json.dumps({"error": str(e)}).encode())
                continue
            if pid == 0:  # the child: nothing of this process's callers and children stays open
                for other in list(selector.get_map().values()):
                    if isinstance(other.data, tuple):
                        os.close(other.fd)
                        if other.data[1] is not None:
                            os.close(other.data[1])
                    else:
                        other.fileobj.close()  # type: ignore[union-attr]
                selector.close()
                if serving:
                    served = json.loads(message[len(_SERVE):])
                    _set_command_line(["disttrain-fork-server", f"--launcher={int(served['launcher'])}"])
                    _show(served["shown"])
                    return _serve(socket.socket(fileno=fds[0]))
                assert ours is not None and theirs is not None
                ours.close()
                return _become_child(fds, theirs)
            for fd_ in fds if serving else (fds[0], fds[1], fds[3]):
                os.close(fd_)
            if theirs is not None:
                theirs.close()
                selector.register(ours, selectors.EVENT_READ, None)
            selector.register(os.pidfd_open(pid), selectors.EVENT_READ,
                              (pid, None if serving else fds[2]))
            caller.send(json.dumps({"pid": pid}).encode())


def _fork_child(fds: list[int], status_fd: int | None) -> int:
    """Fork; returns once the child is in a session of its own (0 in the child)."""
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_read)
        die_with_parent()  # with the fork server, which dies with its launcher
        if os.getppid() == 1:  # the fork server died before the line above took effect
            os._exit(1)
        os.setsid()
        os.close(ready_write)  # the fork server reads the end of the pipe: ready
        if status_fd is not None:
            os.close(status_fd)  # the exit status is the fork server's to write
        return 0
    os.close(ready_write)
    with os.fdopen(ready_read, "rb") as ready:
        ready.read()
    return pid


def _become_child(fds: list[int], server: socket.socket) -> dict[str, Any]:
    """Set up the forked child as `python -u -m MODULE ARGS` started with the request's
    environment, folder, stdout and stderr, stdin from /dev/null, would be; returns the
    request, read from its pipe. `server` is its socket to its fork server (`_parent`)."""
    global _parent
    _parent = _Parent(server, _started_with)
    with os.fdopen(fds[3], "rb") as pipe:
        request = json.loads(pipe.read())
    parent = os.getppid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, standard in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
        os.dup2(fd, standard)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    if request["parent_env"]:
        os.environ[request["parent_env"]] = str(parent)
    _read_settings_again()
    _show(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [request["module"], *request["args"]]
    _set_command_line([sys.executable, "-u", "-m", *sys.argv])
    return request


def _read_settings_again() -> None:
    """Read again, from this child's environment, what a library its fork server imported
    read from the fork server's: fsspec's config (`FSSPEC_<PROTOCOL>_<KWARG>`, such as an
    S3-compatible server's address, or its keys, which no fork server may hold), read at
    fsspec's import (TensorBoard's writer imports it), updated in place as fsspec built it."""
    config = sys.modules.get("fsspec.config")
    if config is None:
        return
    config.conf.clear()
    config.conf_dir = os.environ.get("FSSPEC_CONFIG_DIR", config.default_conf_dir)
    config.set_conf_files(config.conf_dir, config.conf)
    config.set_conf_env(config.conf, os.environ)


def _set_command_line(words: list[str]) -> None:
    """Make /proc/PID/cmdline (what `ps` shows, and what `chaos` and operators find a
    run's processes by) read `words`, NUL-separated as a new interpreter's would, by
    writing them over this process's own command line (the room the fork server's left;
    longer ones are cut). Written here rather than with setproctitle, which joins the
    words with spaces and clears the environment's block beside them."""
    start, end = _proc_stat_fields(48, 49)  # arg_start, arg_end (proc(5))
    line = b"\0".join(os.fsencode(word) for word in words)[:end - start - 1]
    ctypes.memmove(start, line.ljust(end - start, b"\0"), end - start)


def shown_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` a forked child shows in /proc/PID/environ (SHOWN_ENV)."""
    return {name: value for name, value in env.items() if name in SHOWN_ENV}


def _make_room() -> None:
    """In a fork server started as a new interpreter: find the room its launcher left in
    its environment's block (`_ENV_ROOM`), take the variable out of its environment and
    show nothing there yet."""
    global _room
    os.environ.pop(_ENV_ROOM, None)
    start, end = _proc_stat_fields(50, 51)  # env_start, env_end (proc(5))
    block = ctypes.string_at(start, end - start)
    at = (b"\0" + block).find(b"\0" + _ENV_ROOM.encode() + b"=")  # (the entry's offset in the block)
    if at < 0:
        return  # started without it: its children show its environment
    _room = (start + at, block.index(b"\0", at) - at)
    _show({})


def _show(env: Mapping[str, str]) -> None:
    """Write the variables of `env` that a child shows (SHOWN_ENV) in this process's room
    in /proc/PID/environ, NUL-separated as there, over whatever was shown there before."""
    if _room is None:
        return
    address, size = _room
    shown = b"".join(f"{name}={value}".encode() + b"\0" for name, value in sorted(shown_env(env).items()))
    if len(shown) > size:
        logger.warning("%d bytes of %s do not fit in /proc/%d/environ's %d; not shown",
                       len(shown), ", ".join(shown_env(env)), os.getpid(), size)
        shown = b""
    ctypes.memmove(address, shown.ljust(size, b"\0"), size)


def _proc_stat_fields(*numbers: int) -> list[int]:
    """Fields of /proc/self/stat by their numbers in proc(5) (from 1), as integers."""
    with open("/proc/self/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # from field 3, the state, on
    return [int(fields[number - 3]) for number in numbers]


def main(fd: int, modules: tuple[str, ...]) -> None:
    """The fork server's process (`python -u -c`): serves until its launcher is gone; in
    each child, runs the child's module as `python -m` would, and leaves the interpreter as
    that would (exit status, traceback, threads and atexit functions as usual)."""
    child = serve(fd, modules)
    if child is not None:
        code = _run(child["module"])
        if code == -signal.SIGINT:  # as an interpreter ends on a Ctrl-C nobody caught
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _run(module: str) -> int:
    """Run `module` as `python -m` would and end as its interpreter would: the exit status
    (of `sys.exit`, 1 with the traceback printed, -SIGINT for a KeyboardInterrupt), once the
    non-daemon threads ended, the atexit functions ran and the standard streams are flushed.
    What the interpreter's own finalization adds is left out (the caller `os._exit`s): its
    last collection and the teardown of every module write to each page a child shares
    with its fork server, and copying them kept a finished worker alive for seconds, past
    the heartbeat timeout of a coordinator that was waiting to hear it leave."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_status(e.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls first
    except KeyboardInterrupt:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _exit_status(code: object) -> int:
    """The status `sys.exit(code)` ends an interpreter with (a message is printed, then 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
