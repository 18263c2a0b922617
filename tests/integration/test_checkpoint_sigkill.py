"""A process killed with SIGKILL while saving checkpoints: the next start finds a good one
and no temporary file is left behind."""

import select
import signal
import subprocess
import sys

import pytest

from disttrain.core import checkpoint as ckpt

pytestmark = pytest.mark.timeout(60)

SAVE_IN_A_LOOP = """
import sys, torch
from disttrain.core import checkpoint as ckpt
torch.set_num_threads(1)
state = {"w": torch.randn(4_000_000)}  # 16 MB: most of the loop's time is spent in a save
for step in range(1, 10_000):
    state["step"] = step
    ckpt.save_checkpoint(sys.argv[1], step, state, keep=2)
    print(step, flush=True)
"""

# Saves step 1, then stalls inside the write of step 2 (after its first bytes) until killed.
STALL_IN_SECOND_SAVE = """
import sys, torch
from disttrain.core import atomic_files, checkpoint as ckpt
state = {"w": torch.randn(1_000_000), "step": 1}
ckpt.save_checkpoint(sys.argv[1], 1, state)
real_write = atomic_files.HashingWriter.write
def write_then_stall(self, data):
    written = real_write(self, data)
    self.flush()
    print("stalled", flush=True)
    sys.stdin.readline()
    return written
atomic_files.HashingWriter.write = write_then_stall
state["step"] = 2
ckpt.save_checkpoint(sys.argv[1], 2, state)
"""


def start(script, folder):
    return subprocess.Popen([sys.executable, "-c", script, str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)


def read_line(process, timeout_s=30.0) -> str:
    """The child's next line of output, waiting at most `timeout_s` for it."""
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    line = process.stdout.readline() if ready else b""
    if not line:
        process.kill()
        pytest.fail(f"no output from the saving process within {timeout_s}s: "
                    f"{process.communicate(timeout=10)[1].decode()[-2000:]}")
    return line.decode().strip()


def kill(process):
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=10)
    assert process.returncode == -signal.SIGKILL


@pytest.mark.slow  # a saving process, killed
def test_sigkill_during_a_loop_of_saves_leaves_a_good_checkpoint(tmp_path):
    process = start(SAVE_IN_A_LOOP, tmp_path)
    saved = int(read_line(process))  # killed while the next save is most likely under way
    kill(process)
    path = ckpt.prepare_checkpoint_dir(tmp_path, resume=True)
    assert path is not None and ckpt.checkpoint_step(path) >= saved
    assert ckpt.load_checkpoint(path)["step"] == ckpt.checkpoint_step(path)
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow  # a saving process, killed
def test_sigkill_inside_a_save_leaves_its_temporary_file_until_the_next_start(tmp_path):
    process = start(STALL_IN_SECOND_SAVE, tmp_path)
    assert read_line(process) == "stalled"
    kill(process)
    assert [p.name for p in tmp_path.glob(".*.tmp")] and ckpt.latest_checkpoint(tmp_path).name == \
        ckpt.checkpoint_name(1)
    path = ckpt.prepare_checkpoint_dir(tmp_path, resume=True)
    assert path == tmp_path / ckpt.checkpoint_name(1) and ckpt.load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.checkpoint_name(1),
                                                           ckpt.checkpoint_name(1) + ".sha256"]
