"""A checkpoint store that fails: store errors retried with back-off for the retry window,
then one line naming the store, the operation, the error, the newest complete checkpoint
and `--resume`; other errors raised at once; the background writer's two ways of
reporting it; `file://` folders made and written as local files are; the checks a run
makes of its store before it starts."""

import errno
import logging
import socket
import threading
import uuid

import fsspec
import pytest
import torch

from disttrain.core import checkpoint as ckpt
from disttrain.core import failpoints, object_store, store_retry
from disttrain.core.atomic_files import HashingWriter
from disttrain.core.errors import CheckpointError, CheckpointStoreError, ConfigError, store_failure
from disttrain.core.saver import CheckpointWriter
from disttrain.core.store_check import check_checkpoint_dir
from disttrain.training.checkpoints import LocalCheckpoints

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def folder():
    """A fresh folder of the in-memory store (shared by the whole process: a unique name)."""
    url = f"memory://disttrain-retry-{uuid.uuid4().hex}/ckpt"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    """Back-off from 10 ms (the schedule's shape is tenacity's; its scale is not under test)."""
    monkeypatch.setattr(store_retry, "FIRST_WAIT_S", 0.01)


@pytest.fixture
def window():
    """Set this process's retry window for one test: `window(seconds)`."""
    yield store_retry.set_window
    store_retry.set_window(store_retry.DEFAULT_WINDOW_S)


def state(step):
    return {"step": step, "w": torch.full((100,), float(step))}


class Outage:
    """The memory store's `open` for writing (or `cat_file` for reading) fails `times`
    times with `error`, then works again."""

    def __init__(self, monkeypatch, method, times, error):
        self.calls, self.times, self.error = 0, times, error
        real = getattr(fsspec.implementations.memory.MemoryFileSystem, method)

        def failing(fs, path, *args, **kwargs):
            if method == "_open" and "w" not in (args[0] if args else kwargs.get("mode", "rb")):
                return real(fs, path, *args, **kwargs)
            self.calls += 1
            if self.calls <= self.times:
                raise self.error
            return real(fs, path, *args, **kwargs)

        monkeypatch.setattr(fsspec.implementations.memory.MemoryFileSystem, method, failing)


def test_a_store_error_is_retried_until_the_store_heals(folder, monkeypatch, caplog):
    ckpt.save_checkpoint(folder, 5, state(5))
    outage = Outage(monkeypatch, "_open", 3, ConnectionResetError(errno.ECONNRESET, "Connection reset"))
    with caplog.at_level(logging.INFO, logger="disttrain.core.store_retry"):
        ckpt.save_checkpoint(folder, 10, state(10))
    assert outage.calls == 5  # three failed opens of step 10's data, then it and its sidecar went up
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(folder)] == [5, 10]
    assert torch.equal(ckpt.load_checkpoint(ckpt.latest_checkpoint(folder))["w"], state(10)["w"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "writing checkpoint_step00000010.pt failed (ConnectionResetError" in warnings[0]
    assert "succeeded at attempt 4" in caplog.text


def test_a_store_that_stays_down_stops_with_one_line(folder, monkeypatch, window):
    ckpt.save_checkpoint(folder, 5, state(5))
    window(0.5)
    Outage(monkeypatch, "_open", 10**6, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointStoreError) as raised:
        ckpt.save_checkpoint(folder, 10, state(10))
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith(f"checkpoint store {folder}: writing checkpoint_step00000010.pt failed for ")
    assert "system.checkpoint_retry_s=0.5): OSError: [Errno 28] No space left on device" in line
    assert line.endswith("the newest complete checkpoint there is step 5; once the store works again, run "
                         "the same command with --resume")
    assert isinstance(raised.value.__cause__, OSError)
    assert raised.value.exit_code == 74 and not isinstance(raised.value, CheckpointError)
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(folder)] == [5]  # nothing half-written
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(folder))["step"] == 5


def test_window_zero_tries_once_and_says_no_checkpoint_is_complete_yet(folder, monkeypatch):
    ckpt.list_checkpoints(folder)  # what a run's start does: the folder holds none
    outage = Outage(monkeypatch, "_open", 10**6, TimeoutError("timed out"))
    with pytest.raises(CheckpointStoreError, match="no checkpoint is complete there yet") as raised:
        store_retry.retried(lambda: object_store.StoreFolder(folder).write_once("x", lambda h: h.write(b"x")),
                            folder, "writing x", window=0)
    assert outage.calls == 1 and "(1 attempt(s)" in str(raised.value)


def test_an_error_of_the_state_itself_is_not_retried(folder, monkeypatch):
    calls = []

    class Unsavable:
        def __reduce__(self):
            calls.append(1)
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        ckpt.save_checkpoint(folder, 5, {"v": Unsavable()})
    with pytest.raises(TypeError):
        store_retry.retried(lambda: calls.append(2) or int([]), folder, "a bug")
    assert calls == [1, 2]  # each tried once


def test_a_read_is_retried_but_an_absent_object_is_an_answer(folder, monkeypatch):
    ckpt.save_checkpoint(folder, 5, state(5))
    outage = Outage(monkeypatch, "cat_file", 2, ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    path, loaded = ckpt.open_checkpoint_dir(folder, resume=True)
    assert ckpt.checkpoint_step(path) == 5 and loaded["step"] == 5
    assert outage.calls == 4  # the sidecar twice refused, then it and the data
    with pytest.raises(FileNotFoundError):
        object_store.read_bytes(f"{folder}/worker.key")
    assert outage.calls == 5


def test_a_read_that_keeps_failing_at_resume_is_one_line_not_a_skip(folder, monkeypatch, window):
    """A store that cannot be read is not a damaged checkpoint: a resume stops, it does not
    fall back to an older checkpoint (or to none)."""
    ckpt.save_checkpoint(folder, 5, state(5))
    window(0.3)
    Outage(monkeypatch, "cat_file", 10**6, ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    with pytest.raises(CheckpointStoreError, match=r"reading checkpoint_step00000005\.pt\.sha256 failed "
                                                   r"for .*ConnectionRefusedError.*step 5.*--resume"):
        ckpt.open_checkpoint_dir(folder, resume=True)


def test_a_full_disk_that_torch_reports_as_its_own_error_is_the_disks():
    """`torch.save` turns a failed write into RuntimeError("unexpected pos"); the writer
    keeps the file's OSError and raises that, so it is retried as a store error."""

    class FullDisk:
        def __init__(self):
            self.written = 0

        def write(self, data):
            if self.written + len(data) > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(data)
            return len(data)

        def flush(self):
            pass

    hashing = HashingWriter(FullDisk())
    with pytest.raises(OSError) as raised:
        hashing.fill(lambda handle: torch.save({"w": torch.ones(10_000)}, handle))
    assert raised.value.errno == errno.ENOSPC
    with pytest.raises(RuntimeError, match="mine"):  # an error of the caller's own stays its own
        HashingWriter(FullDisk()).fill(lambda handle: (_ for _ in ()).throw(RuntimeError("mine")))


def test_the_newest_checkpoint_named_is_the_folders_or_the_newest_below_it(folder):
    store_retry.remember(f"{folder}/worker0", [10, 15])
    store_retry.completed(f"{folder}/worker0", 20)
    store_retry.remember(f"{folder}/worker1/", [10, 15])
    store_retry.completed(f"{folder}/worker1", 20)
    store_retry.incomplete(f"{folder}/worker1", 20)  # being overwritten: its sum is removed first
    store_retry.remember(f"{folder}/server0", [])
    newest = store_retry.newest_checkpoint
    assert newest(f"{folder}/worker1") == "the newest complete checkpoint there is step 15"
    assert newest(f"{folder}/server0") == "no checkpoint is complete there yet"
    assert newest(folder) == f"the newest complete checkpoint is step 20, in {folder}/worker0"
    assert store_retry.newest_checkpoint(f"{folder}-elsewhere") == \
        "no checkpoint of this process is known to be complete there"


def test_transient_errors_are_told_from_those_that_need_someone():
    botocore = pytest.importorskip("botocore.exceptions")
    assert store_retry.is_transient(ConnectionRefusedError())
    assert store_retry.is_transient(TimeoutError())
    wrapped = object_store.StoreError("EndpointConnectionError: no")
    wrapped.__cause__ = botocore.EndpointConnectionError(endpoint_url="http://x")
    assert store_retry.is_transient(wrapped)
    for error in (FileNotFoundError("no such bucket"), PermissionError("denied"),
                  OSError(errno.EROFS, "Read-only file system"), OSError(errno.ENOSPC, "full")):
        assert not store_retry.is_transient(error)
    refused = object_store.StoreError("NoCredentialsError: Unable to locate credentials")
    refused.__cause__ = botocore.NoCredentialsError()
    assert not store_retry.is_transient(refused)
    assert store_retry.describe(refused) == "NoCredentialsError: Unable to locate credentials"


def test_a_backends_own_error_is_a_store_error(folder, monkeypatch):
    """A backend's exception that is no OSError (botocore's) is retried as a store error."""
    botocore = pytest.importorskip("botocore.exceptions")
    Outage(monkeypatch, "_open", 1, botocore.EndpointConnectionError(endpoint_url="http://store"))
    ckpt.save_checkpoint(folder, 5, state(5))
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(folder))["step"] == 5


def test_the_writer_raises_the_stores_line_as_it_is(folder, monkeypatch, window):
    writer = CheckpointWriter(folder, keep=2)
    window(0)
    Outage(monkeypatch, "_open", 10**6, ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    writer.submit(5, state(5))
    with pytest.raises(CheckpointStoreError, match=r"^checkpoint store memory://.*--resume$"):
        writer.flush(timeout_s=30)
    writer.close(timeout_s=30)  # raised once: nothing new failed since


def test_a_writer_with_an_owner_hands_the_failure_over_once(folder, monkeypatch, window):
    """A shard's writer: the failure goes to `on_failure` (which stops the process); later
    snapshots are dropped, and `close` returns without raising it again."""
    handed, seen = [], threading.Event()
    writer = CheckpointWriter(folder, keep=2, on_failure=lambda e: (handed.append(e), seen.set()))
    window(0)
    outage = Outage(monkeypatch, "_open", 10**6, ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    writer.submit(5, state(5))
    assert seen.wait(30)
    writer.submit(10, state(10))  # the process is stopping: nothing more goes to the store
    writer.close(timeout_s=30)
    assert len(handed) == 1 and isinstance(handed[0], CheckpointStoreError)
    assert "checkpoint_step00000005.pt" in str(handed[0]) and outage.calls == 1


def test_a_file_url_makes_its_folders_and_writes_private_files(tmp_path):
    """The bug of `--checkpoint-dir file:///a/new/folder`: the folder was never made."""
    url = f"file://{tmp_path}/a/new/folder"
    store = LocalCheckpoints(url, keep=2)
    assert store.choose(resume=False) is None
    for step in (5, 10, 15):
        store.save(step, state(step))
    local = tmp_path / "a" / "new" / "folder"
    assert sorted(p.name for p in local.iterdir()) == [
        "checkpoint_step00000010.pt", "checkpoint_step00000010.pt.sha256",
        "checkpoint_step00000015.pt", "checkpoint_step00000015.pt.sha256"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in local.iterdir())
    object_store.write_bytes(f"{url}/worker0/worker.key", b"k" * 32, mode=0o600)
    assert (local / "worker0" / "worker.key").stat().st_mode & 0o777 == 0o600
    (local / ".checkpoint_step00000020.pt.a1b2.tmp").write_bytes(b"cut short")  # a crash mid-write
    again = LocalCheckpoints(url, keep=2)
    chosen = again.choose(resume=True)
    assert chosen == f"{url}/checkpoint_step00000015.pt" and again.load(chosen)["step"] == 15
    assert not list(local.glob(".*.tmp"))


def test_a_process_local_store_is_refused_where_the_run_trains_elsewhere(folder, caplog):
    with pytest.raises(ConfigError, match=r"^system.checkpoint_dir: 'memory://.*' lives in one process's "
                                          r"memory, and a ps run trains in processes of its own"):
        check_checkpoint_dir(folder, "ps", in_this_process=False)
    check_checkpoint_dir(folder, "baseline", in_this_process=True)
    assert "a later --resume finds none there" in caplog.text
    assert fsspec.filesystem("memory").ls(folder) == []  # the test object was removed


@pytest.mark.parametrize("where", ["under-a-file", "read-only"])
def test_a_folder_that_cannot_be_written_is_refused_before_the_run(tmp_path, where):
    if where == "under-a-file":
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "ckpt"
    else:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(0o500)
        try:
            (target / "probe").touch()
        except PermissionError:
            pass
        else:
            pytest.skip("this user writes into folders without write permission (root); the read-only "
                        "mount of the full-disk tests covers it")
    for location in (target, f"file://{target}"):
        with pytest.raises(ConfigError, match=r"^system.checkpoint_dir: cannot write checkpoints to .* "
                                              r"\((NotADirectoryError|PermissionError): .*\); check the"):
            check_checkpoint_dir(location, "baseline", in_this_process=True)


def test_a_folder_another_hosts_check_removes_is_made_again(tmp_path, monkeypatch):
    """Two hosts sharing a checkpoint folder check it at once, and each removes the folders
    it made: one's removal may fall between the other making the folder and writing its
    probe there (FileNotFoundError; a DDP node refused the run for it). The check makes
    the folder again; it leaves nothing behind."""
    from disttrain.core import store_check

    real, calls = store_check.write_bytes_atomic, []

    def raced(path, data, mode):
        calls.append(path)
        if len(calls) == 1:  # as tempfile.mkstemp raised when the folder had gone
            path.parent.mkdir(parents=True)
            path.parent.rmdir()
            raise FileNotFoundError(2, "No such file or directory", str(path.parent))
        return real(path, data, mode=mode)

    monkeypatch.setattr(store_check, "write_bytes_atomic", raced)
    check_checkpoint_dir(tmp_path / "shared" / "ckpt", "ddp", in_this_process=False)
    assert len(calls) == 2 and not (tmp_path / "shared").exists()


def test_a_launcher_names_the_process_and_keeps_its_line():
    output = "INFO starting\nerror: checkpoint store s3://b/run: writing x failed ...; --resume\nbye\n"
    error = store_failure("worker1", output, "logs/worker1.log")
    assert str(error) == "worker1: checkpoint store s3://b/run: writing x failed ...; --resume"
    assert str(store_failure("rank 1", "error: rank 1: checkpoint store b: ...", "x")) == \
        "rank 1: checkpoint store b: ..."
    assert "see its log logs/w.log" in str(store_failure("w", "Traceback ...", "logs/w.log"))


@pytest.mark.parametrize("where", ["local", "file-url", "memory"])
def test_an_injected_store_error_is_retried_like_a_real_one(tmp_path, folder, monkeypatch, window, where):
    """`store-error` faults (`core.failpoints`) fail every checkpoint write with ENOSPC for a
    while: within the window the write goes through once they stop; past it, the line."""
    location = {"local": tmp_path / "ckpt", "file-url": f"file://{tmp_path}/ckpt", "memory": folder}[where]
    monkeypatch.setattr(failpoints.checkpoints, "fail_until", 0.0)
    window(30)
    failpoints.fail_checkpoints(0.2)
    ckpt.save_checkpoint(location, 5, state(5))
    assert steps(location) == [5]
    window(0.1)
    failpoints.fail_checkpoints(30)
    full = r"writing checkpoint_step00000010\.pt failed .*No space left on device \(injected fault\).*step 5"
    with pytest.raises(CheckpointStoreError, match=full):
        ckpt.save_checkpoint(location, 10, state(10))
    assert steps(location) == [5]


def steps(location):
    return [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(location)]


class ClosingServer:
    """A socket that accepts each connection and closes it at once (a store's server going
    away), counting them."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.connections = self.listener.getsockname()[1], 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            client.close()


@pytest.fixture
def closing_s3(monkeypatch):
    """An s3:// store whose server closes every connection; AWS_MAX_ATTEMPTS unset."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (the `s3` extra)")
    import s3fs
    server = ClosingServer()
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": f"http://127.0.0.1:{server.port}"})
    s3fs.S3FileSystem.clear_instance_cache()
    yield server
    server.listener.close()
    s3fs.S3FileSystem.clear_instance_cache()


def test_an_s3_outage_reaches_the_retry_window_at_once(closing_s3):
    """botocore's and s3fs's own retries would hide it (60 connections, 83 s for a listing):
    the request is tried once (aiohttp reconnects a few times), and the error is the
    store's, for `store_retry` to retry within its window."""
    store = object_store.StoreFolder(f"s3://bucket-{uuid.uuid4().hex[:8]}/run")
    with pytest.raises(OSError) as raised:
        store.names_once()
    assert store_retry.is_transient(raised.value), raised.value
    assert closing_s3.connections <= 5
    assert store.fs.retries == 1


def test_the_users_own_s3_retries_are_kept(closing_s3, monkeypatch):
    conf = dict(fsspec.config.conf["s3"], config_kwargs={"retries": {"max_attempts": 3}, "read_timeout": 7})
    monkeypatch.setitem(fsspec.config.conf, "s3", conf)
    store = object_store.StoreFolder(f"s3://bucket-{uuid.uuid4().hex[:8]}/run")
    assert store.fs.config_kwargs == {"retries": {"max_attempts": 3}, "read_timeout": 7}
    assert store.fs.retries == 5
    monkeypatch.setitem(fsspec.config.conf, "s3", {**conf, "config_kwargs": {"read_timeout": 7}})
    assert object_store.StoreFolder("s3://other/run").fs.config_kwargs == {
        "retries": {"max_attempts": 1}, "read_timeout": 7}
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    assert object_store.StoreFolder("s3://third/run").fs.config_kwargs == {"read_timeout": 7}
