"""Every config under configs/ runs to the end, as shipped, on a tiny sample budget.

Each runs with `disttrain train`, so with the command its `system.architecture` names,
on real MNIST when it is at hand (the shipped digits otherwise: the configs ask for
MNIST or CIFAR-10, which CI machines cannot download; a text the test writes for a
config on `text:FILE`), into a temporary folder, and sets no key its strategy ignores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import VARIANT

from disttrain.config import load_config
from tests.plugin_files import write_text

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
SUMMARY_STRATEGY = {"baseline": "baseline", "parameter_server": "ps-", "ddp": "ddp"}  # ps-sync, ps-async
# make test-extended runs these: each one's keys are validated, and checked to be read by
# its strategy, in tests/unit (test_shipped_config_names, test_config_usage), and its path
# is run end to end in make test by another test: the four-worker twins by their two-worker
# configs here (the same code on more processes); sync PS on MNIST with Adam by ps_sync_topk
# here (MNIST's loading too); two DDP ranks with Adam by test_ddp_cli; the baseline on
# digits (example_config) by test_baseline; gpt_small on a text file by test_plugins_cli
# and under DDP by test_ddp_equivalence. ResNet-18 (its only end-to-end run) and async PS
# with int8 quantization stay in make test.
EXTENDED = {"ps_sync_mnist_4workers.yaml", "ps_async_quantization_4workers.yaml", "ps_sync_mnist.yaml",
            "ddp_mnist.yaml", "example_config.yaml", "gpt_small_text.yaml"}


def data_flags(config: dict, tmp_path: Path, mnist_or_digits: list) -> list:
    """The flags that give a shipped config data at hand."""
    dataset = config["training"]["dataset"]
    if dataset == "digits":
        return []  # digits reads no folder
    if dataset.startswith("text:"):  # the full-size model on shorter windows: a quarter of the work
        return ["--dataset", f"text:{write_text(tmp_path, num_words=15000)}", "--seq-len", "32"]
    if dataset in ("mnist", "fashion_mnist"):
        return mnist_or_digits
    return ["--dataset", "digits"]


def architecture(path: Path) -> str:
    return yaml.safe_load(path.read_text())["system"].get("architecture", "baseline")


# Each is a training run of the command line, tens of seconds: none in the fast selection.
@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", [
    pytest.param(p, id=p.stem, marks=VARIANT if p.name in EXTENDED else pytest.mark.slow) for p in CONFIGS])
def test_shipped_config_runs_to_the_end(cli, tmp_path, path, mnist_or_digits):
    config = yaml.safe_load(path.read_text())
    data = data_flags(config, tmp_path, mnist_or_digits)
    result = cli("train", "--config", path, *data, "--num-epochs", 1,
                 "--max-train-samples", 512, "--max-test-samples", 200,
                 "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt", timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "is ignored by this run" not in result.stderr and "system.architecture is" not in result.stderr
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["strategy"].startswith(SUMMARY_STRATEGY[architecture(path)])
    assert summary["samples_processed"] == 512 and 0 <= summary["final_accuracy"] <= 1
    if load_config(path).compression.enabled:
        assert summary["compression_ratio"] > 1.5 and summary["compression_bytes_sent"] > 0
