"""`pip install .` into a fresh virtual environment, then train from outside the source tree:
what a user does on a machine of their own. Slow: it installs every dependency.

The new environment gets torch at the lock's version from a wheel pip already has at hand
(pip's find-links), and so downloads nothing large; without such a wheel the test skips.
Both installs skip pip's byte-compilation of every module (`--no-compile`): what is tested
is what gets installed and that it runs; compiling torch's thousands of modules is pip's own
work: the two installs took 90 s with it and 39 s without (2 cores, quiet machine).
"""

from __future__ import annotations

import re
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements.lock"
INSTALL_TIMEOUT_S = 900

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def pinned(name: str) -> str:
    match = re.search(rf"^{re.escape(name)}==(\S+)$", LOCK.read_text(), re.M)
    assert match, f"{name} is not pinned in {LOCK.name}"
    return match.group(1)


def run(command: list[str], cwd: Path, timeout: float = INSTALL_TIMEOUT_S) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n"
                                    f"{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh environment with disttrain installed from the source tree, not editable."""
    root = tmp_path_factory.mktemp("install")
    venv.create(root / "venv", with_pip=True)
    python = str(root / "venv" / "bin" / "python")
    torch_pin = f"torch=={pinned('torch')}"
    pip = [python, "-m", "pip", "install", "--quiet", "--no-compile"]
    local = subprocess.run([*pip, "--no-index", "--no-deps", torch_pin],
                           capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if local.returncode != 0:
        pytest.skip(f"no {torch_pin} wheel at hand in pip's find-links (the test would download one)")
    run([*pip, "-c", str(LOCK), str(REPO)], cwd=root)
    return root


def test_pip_install_then_train_on_digits(installed):
    disttrain = str(installed / "venv" / "bin" / "disttrain")
    out = run([disttrain, "baseline", "--dataset", "digits", "--num-epochs", "1",
               "--checkpoint-dir", "ckpt", "--log-dir", "logs"], cwd=installed, timeout=300).stdout
    accuracy = float(re.search(r"Final Accuracy: ([\d.]+)%", out).group(1))
    assert accuracy > 50, out  # one epoch on digits: well above chance (10%)
    assert (installed / "ckpt" / "baseline_final.pt").is_file()
    assert (installed / "logs" / "summary.json").is_file()


def test_installed_package_is_complete_and_lean(installed):
    python = str(installed / "venv" / "bin" / "python")
    probe = ("import importlib.util, pathlib, disttrain\n"
             "root = pathlib.Path(disttrain.__file__).parent\n"
             "print(root)\n"
             "print((root / 'py.typed').is_file(), (root / 'data' / 'digits.csv.gz').is_file())\n"
             "print(importlib.util.find_spec('sklearn') is None)\n")
    lines = run([python, "-c", probe], cwd=installed, timeout=60).stdout.split()
    assert "site-packages" in lines[0], "disttrain was imported from the source tree, not the install"
    assert lines[1:] == ["True", "True", "True"], "py.typed, the digits file, no scikit-learn"
    disttrain = str(installed / "venv" / "bin" / "disttrain")
    listing = run([disttrain, "configs"], cwd=installed, timeout=60).stdout
    assert "example" in listing and "ps_sync_mnist" in listing
    check = run([disttrain, "baseline", "--config", "example", "--check-config"], cwd=installed, timeout=60)
    assert "config OK" in check.stdout
    assert run([disttrain, "completion", "bash"], cwd=installed, timeout=60).stdout.count("disttrain") > 5

