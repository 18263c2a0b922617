"""A real full disk and a real read-only one under the checkpoint folder: small tmpfs mounts
made here (skipped, with the reason, where mounting is not allowed). A save that finds no
space is retried, then stops with one line naming the folder, ENOSPC and the newest
complete checkpoint; nothing complete is damaged, and once space is freed a resume goes on
from that checkpoint. A read-only location is refused before the run starts (exit 2)."""

import json
import subprocess
import uuid

import pytest
import torch

from disttrain.core import checkpoint as ckpt
from disttrain.core import store_retry
from disttrain.core.errors import CheckpointStoreError, ConfigError
from disttrain.core.store_check import check_checkpoint_dir

pytestmark = pytest.mark.timeout(180)


class SmallDisk:
    """A tmpfs of `size` mounted at `path`; `resize` grows or shrinks it, `read_only` too."""

    def __init__(self, path, size):
        self.path = path
        path.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            reason = mounted.stderr.strip() or "mount refused"
            pytest.skip(f"cannot mount a small tmpfs here to fill ({reason})")

    def remount(self, options):
        subprocess.run(["mount", "-o", f"remount,{options}", str(self.path)], check=True, capture_output=True)

    def unmount(self):
        subprocess.run(["umount", str(self.path)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    disks = []

    def make(size):
        disks.append(SmallDisk(tmp_path / f"disk{len(disks)}", size))
        return disks[-1]

    yield make
    for disk in disks:
        disk.unmount()


def state(step):
    return {"step": step, "w": torch.full((75_000,), float(step))}  # 300 KB each


def test_a_full_disk_stops_with_one_line_and_keeps_what_was_complete(small_disk, monkeypatch):
    disk = small_disk("800k")
    folder = disk.path / "run" / "ckpt"  # made as needed
    monkeypatch.setattr(store_retry, "FIRST_WAIT_S", 0.01)
    store_retry.set_window(0.3)
    try:
        ckpt.save_checkpoint(folder, 5, state(5), keep=3)
        ckpt.save_checkpoint(folder, 10, state(10), keep=3)
        with pytest.raises(CheckpointStoreError) as raised:
            ckpt.save_checkpoint(folder, 15, state(15), keep=3)
    finally:
        store_retry.set_window(store_retry.DEFAULT_WINDOW_S)
    line = str(raised.value)
    assert line.startswith(f"checkpoint store {folder}: writing checkpoint_step00000015.pt failed for ")
    assert "[Errno 28] No space left on device" in line and "\n" not in line
    assert line.endswith("the newest complete checkpoint there is step 10; once the store works again, run "
                         "the same command with --resume")
    assert sorted(p.name for p in folder.iterdir()) == [  # no temporary file left, nothing torn
        "checkpoint_step00000005.pt", "checkpoint_step00000005.pt.sha256",
        "checkpoint_step00000010.pt", "checkpoint_step00000010.pt.sha256"]
    disk.remount("size=4m")  # space freed: the run resumes where it stopped
    path, loaded = ckpt.open_checkpoint_dir(folder, resume=True)
    assert ckpt.checkpoint_step(path) == 10 and torch.equal(loaded["w"], state(10)["w"])
    ckpt.save_checkpoint(folder, 15, state(15), keep=3)
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(folder)] == [5, 10, 15]


def test_a_read_only_location_is_refused_before_the_run(small_disk):
    disk = small_disk("64k")
    (disk.path / "existing").mkdir()
    disk.remount("ro")
    for folder in (disk.path / "existing", disk.path / "new" / "folder", f"file://{disk.path}/new/folder"):
        with pytest.raises(ConfigError, match=r"^system.checkpoint_dir: cannot write checkpoints to .* "
                                              r"\(OSError: \[Errno 30\] Read-only file system"):
            check_checkpoint_dir(folder, "baseline", in_this_process=True)


@pytest.mark.slow
def test_a_baseline_run_on_a_full_disk_stops_and_resumes_once_freed(small_disk, cli, tmp_path):
    """The whole path: the run stops with exit code 74 and the line as its last, the
    checkpoint it names resumes once the disk has room, and the run finishes."""
    disk = small_disk("2600k")  # two checkpoints of this MLP (about 1 MB each), not three
    folder = disk.path / f"run-{uuid.uuid4().hex[:6]}"
    args = ["baseline", "--dataset", "digits", "--model", "mlp", "--num-epochs", "1",
            "--max-train-samples", "512", "--batch-size", "32", "--num-threads", "1",
            "--checkpoint-interval", "2", "--checkpoint-dir", folder, "--log-dir", tmp_path / "logs",
            "--summary-json", tmp_path / "summary.json", "--set", "system.checkpoint_retry_s=1"]
    stopped = cli(*args, timeout=120)
    last = stopped.stderr.strip().splitlines()[-1]
    assert stopped.returncode == 74, stopped.stderr[-3000:]
    assert last.startswith(f"error: checkpoint store {folder}: writing checkpoint_step00000006.pt "), last
    assert "No space left on device" in last and "step 4;" in last and last.endswith("--resume")
    assert "Traceback" not in stopped.stderr
    disk.remount("size=8m")
    resumed = cli(*args, "--resume", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 16
