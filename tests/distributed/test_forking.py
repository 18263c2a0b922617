"""The fork server: a child forked from it behaves as `python -u -m MODULE ARGS` started by
`subprocess.Popen(start_new_session=True)` would (arguments, environment, folder, stdin,
stdout, stderr, exit status, signals, threads and atexit functions, its command line in
/proc/PID/cmdline and `ps`, a chaos run's tag in /proc/PID/environ), holds no other child's
credentials, and dies with its launcher however the launcher dies."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest
from process_memory import memory_holds

from disttrain import cli
from disttrain.chaos.outside import TAG_ENV, tagged_pids
from disttrain.core import forking
from disttrain.core.forking import ForkedProcess
from tests.live_runs import parent_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.skipif(not forking.forking(), reason="no fork server on this platform")]

CHILD = textwrap.dedent("""
    import atexit, os, signal, sys, threading
    print("argv", sys.argv[1:])
    print("env", os.environ.get("FORK_TEST"), os.environ.get("FORK_PARENT") == str(os.getppid()))
    print("folder", os.getcwd())
    print("session", os.getsid(0) == os.getpid())
    print("stdin", repr(sys.stdin.read()))
    print("command", open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").split(b"\\0"))
    sys.stderr.write("to the log\\n")
    atexit.register(lambda: print("atexit"))
    late = threading.Thread(target=lambda: print("thread"))  # not a daemon: exit waits for it
    mode = sys.argv[1]
    if mode == "wait":
        print("ready")
        signal.pause()
    late.start()
    if mode == "exit":
        sys.exit(7)
    if mode == "raise":
        raise ValueError("boom")
    if mode == "message":
        sys.exit("bad input: boom")
    if mode == "interrupt":
        raise KeyboardInterrupt
""")


@pytest.fixture
def child_module(tmp_path, monkeypatch):
    (tmp_path / "forkchild.py").write_text(CHILD)
    monkeypatch.chdir(tmp_path)
    return "forkchild"


def start(module: str, mode: str, log, **env) -> ForkedProcess:
    return ForkedProcess([module, mode, "--flag"], {**os.environ, **env}, log.fileno(),
                         parent_env="FORK_PARENT")


@pytest.mark.parametrize("mode, code", [("exit", 7), ("raise", 1), ("ok", 0), ("message", 1),
                                        ("interrupt", -signal.SIGINT)])
def test_a_forked_child_runs_as_a_new_interpreter_would(tmp_path, child_module, mode, code):
    with open(tmp_path / "child.log", "wb") as log:
        child = start(child_module, mode, log, FORK_TEST="passed")
    out = child.stdout.read().decode().splitlines()
    command = (sys.executable, "-u", "-m", "forkchild", mode, "--flag")  # NUL-separated, as exec's
    assert child.wait(timeout=60) == code and child.poll() == code
    assert out[:6] == [f"argv ['{mode}', '--flag']", "env passed True", f"folder {tmp_path}",
                       "session True", "stdin ''", f"command {[w.encode() for w in command]}"]
    assert out[6:] == ["thread", "atexit"]  # its threads, then its atexit functions, as at any exit
    log_text = (tmp_path / "child.log").read_text()
    assert log_text.startswith("to the log\n")
    assert ("ValueError: boom" in log_text) == (mode == "raise")
    assert ("bad input: boom" in log_text) == (mode == "message")
    assert ("KeyboardInterrupt" in log_text) == (mode == "interrupt")


def test_a_forked_childs_collections_leave_what_the_fork_server_imported_alone(tmp_path):
    # torch's objects, imported once, are frozen out of the collector's sight: a child's
    # collections (and its exit) do not write to, and so copy, the pages it shares
    (tmp_path / "frozen.py").write_text("import gc, sys; print(gc.get_freeze_count() > 100_000, "
                                        "'torch' in sys.modules)")
    with open(tmp_path / "child.log", "wb") as log:
        child = ForkedProcess(["frozen"], dict(os.environ), log.fileno(), cwd=str(tmp_path))
    assert child.stdout.read().decode().split() == ["True", "True"]
    assert child.wait(timeout=60) == 0


def test_a_chaos_run_finds_a_forked_child_by_its_tag(tmp_path, child_module):
    tag = os.urandom(8).hex()
    with open(tmp_path / "child.log", "wb") as log:
        child = start(child_module, "wait", log, **{TAG_ENV: tag})
    try:
        assert child.stdout.readline().startswith(b"argv")
        assert tagged_pids(tag) == [child.pid]
    finally:
        child.kill()
        child.wait(timeout=60)


def test_children_of_one_fork_server_each_show_their_own_chaos_runs_tag(tmp_path, child_module):
    # The tag is no start-up setting: one fork server forks the launches of a whole chaos
    # campaign, each showing its own tag in /proc/PID/environ, where chaos looks for it.
    tags = [os.urandom(16).hex() for _ in range(3)]
    with open(tmp_path / "child.log", "wb") as log:
        children = [start(child_module, "wait", log, **{TAG_ENV: tag}) for tag in tags]
    try:
        for child in children:
            assert child.stdout.readline().startswith(b"argv")
        assert len({parent_of(child.pid) for child in children}) == 1
        assert [tagged_pids(tag) for tag in tags] == [[child.pid] for child in children]
        with open(f"/proc/{children[0].pid}/environ", "rb") as environ:
            entries = environ.read().split(b"\0")
        assert not any(entry.startswith(forking._ENV_ROOM.encode()) for entry in entries)
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=60)


def test_a_signal_to_its_process_group_stops_it_with_a_negative_status(tmp_path, child_module):
    with open(tmp_path / "child.log", "wb") as log:
        child = start(child_module, "wait", log)
    os.killpg(child.pid, signal.SIGSTOP)  # its own group, from the moment it was returned
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.01)
    assert child.poll() is None
    os.killpg(child.pid, signal.SIGCONT)
    assert any(line.startswith(b"ready") for line in child.stdout)  # (ends at its exit, if it is never ready)
    os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM


LAUNCHER = textwrap.dedent("""
    # No `__main__` guard, as in a user's script: a child must not run this again.
    import os, sys
    from disttrain.core.forking import ForkedProcess
    import disttrain.core.forking as forking
    child = ForkedProcess(["forkchild", "wait"], dict(os.environ), 2)
    assert any(line.startswith(b"ready") for line in child.stdout)
    server, = forking._servers.values()
    print(child.pid, server.pid, flush=True)
    sys.stdin.read()
""")


def gone_within(pid: int, timeout_s: float) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def test_its_children_die_with_a_launcher_killed_outright(tmp_path, child_module):
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    launcher = subprocess.Popen([sys.executable, "launcher.py"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
    try:
        child_pid, server_pid = map(int, launcher.stdout.readline().split())
        assert not gone_within(child_pid, 0)
        launcher.kill()
        launcher.wait()
        assert gone_within(server_pid, 30) and gone_within(child_pid, 30)
    finally:
        launcher.kill()
        launcher.wait()


NESTED = textwrap.dedent("""
    # A launcher that was forked itself: its children come from a fork server forked from
    # its own, not from a new interpreter.
    import json, os, signal
    import disttrain.core.forking as forking
    env = {**os.environ, "FORK_TEST": os.environ["GRANDCHILD_TOKEN"], **json.loads(os.environ["CHILD_ENV"])}
    del env["GRANDCHILD_TOKEN"], env["CHILD_ENV"]
    child = forking.ForkedProcess(["forkchild", "wait"], env, 2)
    assert any(line.startswith(b"ready") for line in child.stdout)
    server, = forking._servers.values()
    print(child.pid, server.pid, server.process is None, flush=True)
    signal.pause()
""")


def test_a_forked_launcher_forks_its_children_from_a_fork_of_its_own_fork_server(tmp_path, child_module):
    (tmp_path / "nested.py").write_text(NESTED)
    launcher_token, child_token = ("token-" + os.urandom(8).hex() for _ in range(2))
    tag = os.urandom(16).hex()  # a chaos run's
    with open(tmp_path / "launcher.log", "wb") as log:
        env = {**os.environ, "DISTTRAIN_TOKEN": launcher_token, "GRANDCHILD_TOKEN": child_token,
               "CHILD_ENV": "{}", TAG_ENV: tag}
        launcher = ForkedProcess(["nested"], env, log.fileno())
    try:
        line = launcher.stdout.readline().split()
        assert line, (tmp_path / "launcher.log").read_text()
        child, server = int(line[0]), int(line[1])
        assert line[2] == b"True"  # not a new interpreter
        ours = forking._servers[server_key()].pid
        assert parent_of(server) == ours and parent_of(child) == server
        with open(f"/proc/{server}/cmdline", "rb") as cmdline:
            words = cmdline.read().split(b"\0")[:2]
        assert words == [b"disttrain-fork-server", f"--launcher={launcher.pid}".encode()]
        # every process of the launch shows its tag, its fork server's fork included
        assert sorted(tagged_pids(tag)) == sorted([launcher.pid, server, child])
        try:  # a fork of a fork server: it holds no credential of the launcher or of its children
            assert memory_holds(child, child_token.encode())
            assert memory_holds(launcher.pid, launcher_token.encode())
            assert not any(memory_holds(server, token.encode()) for token in (launcher_token, child_token))
        except PermissionError:
            pass  # this user may not read another process's memory: the lifetimes below still hold
        launcher.kill()  # SIGKILL: its fork server sees its socket close, and its child goes with it
        assert launcher.wait(timeout=60) == -signal.SIGKILL
        assert gone_within(server, 30) and gone_within(child, 30)
        assert not gone_within(ours, 0)  # the test's own fork server serves on
    finally:
        launcher.kill()
        launcher.wait(timeout=60)


@pytest.mark.parametrize("child_env, forked", [
    # What a DDP launcher and torch's elastic agent add for the ranks: read by torch only
    # when a rendezvous or a process group is made, so the ranks fork from the same server.
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
      "PYTHONUNBUFFERED": "0"}, True),
    ({"OMP_NUM_THREADS": "3"}, False),  # read as OpenMP loads: a new interpreter with it
])
def test_only_a_start_up_variable_makes_a_forked_launchers_fork_server_a_new_interpreter(
        tmp_path, child_module, child_env, forked):
    (tmp_path / "nested.py").write_text(NESTED)
    env = {**os.environ, "GRANDCHILD_TOKEN": "token", "CHILD_ENV": json.dumps(child_env)}
    with open(tmp_path / "launcher.log", "wb") as log:
        launcher = ForkedProcess(["nested"], env, log.fileno())
    try:
        line = launcher.stdout.readline().split()
        assert line, (tmp_path / "launcher.log").read_text()
        assert line[2] == str(forked).encode()
        assert (parent_of(int(line[1])) == forking._servers[server_key()].pid) == forked
    finally:
        launcher.kill()
        launcher.wait(timeout=60)


def test_a_fork_server_that_died_is_started_again(tmp_path, child_module):
    with open(tmp_path / "child.log", "wb") as log:
        start(child_module, "ok", log).wait(timeout=60)
        first = forking._servers[server_key()]
        first.process.kill()
        first.process.wait()
        child = start(child_module, "exit", log)
        assert child.wait(timeout=60) == 7
    assert forking._servers[server_key()] is not first


def test_the_variable_turns_it_off(monkeypatch):
    monkeypatch.setenv(forking.FORK_SERVER_ENV, "0")
    assert not forking.forking()
    monkeypatch.setenv(forking.FORK_SERVER_ENV, "1")
    assert forking.forking()


def server_key() -> tuple:
    return tuple(sorted(forking.startup_env(dict(os.environ)).items()))


def test_no_fork_server_holds_a_credential(tmp_path, child_module, monkeypatch):
    """Neither a child's environment (its token) nor the launcher's (the run's secret, as a
    user exports it) reaches a fork server, whose memory every later child copies: each
    child holds its own token, and no other."""
    launcher_secret = "secret-" + os.urandom(8).hex()
    monkeypatch.setenv("DISTTRAIN_TOKEN", launcher_secret)
    tokens = ["token-" + os.urandom(8).hex() for _ in range(2)]
    children = []
    with open(tmp_path / "child.log", "wb") as log:
        for token in tokens:
            env = {k: v for k, v in os.environ.items() if k != "DISTTRAIN_TOKEN"}
            children.append(ForkedProcess([child_module, "wait"], {**env, "FORK_TEST": token}, log.fileno()))
    try:
        for child, token in zip(children, tokens, strict=True):
            assert child.stdout.readline() == b"argv ['wait']\n"
            assert child.stdout.readline() == f"env {token} False\n".encode()
        server = forking._servers[server_key()].pid
        try:
            assert memory_holds(children[0].pid, tokens[0].encode())  # the search finds what is there
            assert not memory_holds(children[0].pid, tokens[1].encode())
            assert not memory_holds(children[1].pid, tokens[0].encode())
            for pid in (server, *(child.pid for child in children)):
                assert not memory_holds(pid, launcher_secret.encode())
            assert not any(memory_holds(server, token.encode()) for token in tokens)
        except PermissionError:
            pytest.skip("this user may not read another process's memory")
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=60)


def test_what_the_fork_server_imports_for_the_children_starts_no_thread(tmp_path, child_module):
    # a fork copies the forking thread alone: a thread started by an import would be
    # missing, its locks possibly held, in every child
    with open(tmp_path / "child.log", "wb") as log:
        assert start(child_module, "ok", log).wait(timeout=60) == 0
    assert set(cli.CHILD_MODULES) <= set(forking._preloads)
    server = forking._servers[server_key()]
    assert len(os.listdir(f"/proc/{server.pid}/task")) == 1


def test_a_child_reads_fsspecs_settings_from_its_own_environment_though_its_fork_server_imported_it(
        tmp_path):
    # fsspec reads FSSPEC_* as it is imported, and the fork server imports it for the
    # children (TensorBoard's writer does): each child must see its own, and no other's
    (tmp_path / "settings.py").write_text(
        "import sys; preloaded = 'fsspec.config' in sys.modules\n"
        "import fsspec.config; print(preloaded, fsspec.config.conf.get('s3', {}).get('endpoint_url'))")
    outputs = []
    for env in ({"FSSPEC_S3_ENDPOINT_URL": "http://127.0.0.1:9"}, {}):
        base = {k: v for k, v in os.environ.items() if not k.startswith("FSSPEC_")}
        with open(tmp_path / "child.log", "wb") as log:
            child = ForkedProcess(["settings"], {**base, **env}, log.fileno(), cwd=str(tmp_path))
        outputs.append(child.stdout.read().decode().split())
        assert child.wait(timeout=60) == 0, (tmp_path / "child.log").read_text()
    assert outputs == [["True", "http://127.0.0.1:9"], ["True", "None"]]


def test_a_rank_handler_closes_a_rank_that_ended_since_torch_saw_it_running(tmp_path, child_module):
    # torch's agent closes each rank it last saw running by signalling its process group; a
    # forked rank is reaped by its fork server at once, so its group may be gone by then
    from disttrain.strategies.ddp.agent import ForkedRankHandler

    handler = ForkedRankHandler(sys.executable, ("-u", "-m", child_module, "ok"), {},
                                str(tmp_path / "out.log"), str(tmp_path / "err.log"), 0, None)
    assert isinstance(handler.proc, ForkedProcess) and handler.proc.wait(timeout=60) == 0
    assert gone_within(handler.proc.pid, 30)
    handler.close(signal.SIGTERM)
    assert handler._stdout.closed and handler._stderr.closed
    assert (tmp_path / "out.log").read_text().startswith("argv ['ok']")
