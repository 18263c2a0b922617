"""The GPU figures of docs/benchmarks.md are those of the committed GPU check run
(benchmarks/results/gpu_check_h200.json), as tools/gpu_readme.py writes them; every
figure of the section comes from the JSON, so another run's JSON gives other figures."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULT = REPO_ROOT / "benchmarks" / "results" / "gpu_check_h200.json"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gpu_readme(tool):
    return tool("gpu_readme")


@pytest.fixture
def report() -> dict:
    return json.loads(RESULT.read_text())


def test_the_benchmarks_page_holds_the_committed_runs_figures(gpu_readme, report):
    page = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    block = page.split(gpu_readme.BEGIN, 1)[1].split(gpu_readme.END, 1)[0]
    assert block == gpu_readme.render(report), "run: python tools/gpu_readme.py"


def test_the_figures_are_the_jsons(gpu_readme, report):
    text = gpu_readme.render(report)
    assert "One NVIDIA H200 (139.8 GiB)" in text and "NCCL 2.28.9" in text
    assert "| ddp_backends | failed |" in text
    assert "`nccl_1_ranks_powersgd`: the gloo run failed (exit 1)" in text
    assert "`nccl_1_ranks` (nccl on cuda:0, 1 rank, 16 steps) 3.0e-08" in text
    assert "bf16 0.8530 (82.0%)" in text and "fp16 loss scale 65536" in text
    assert ("gRPC 0.68 GB/s from CUDA tensors, 0.46 from CPU ones; shared memory (`auto`) 3.11 "
            "and 0.81") in text
    assert ("| resnet18 | 1893/s (batch 16) | 20144/s (batch 256) | 0.71x | 0.02x | 0.03x | 0.03x "
            "| 0.03x |") in text
    assert "| gpt_small | 824/s (batch 8) | 4229/s (batch 128) | 0.82x |" in text


def test_another_run_gives_other_figures(gpu_readme, report):
    other = copy.deepcopy(report)
    other["host"]["devices"][0]["name"] = "NVIDIA A100"
    other["steps"]["ps_wire"]["figures"]["exchanges"]["grpc_cuda"]["gb_per_s"] = 1.234
    workloads = other["steps"]["workloads"]["figures"]["results"]["resnet18"]
    workloads["plain"]["samples_per_s"] = 999.0
    workloads["strategies"]["ddp_per_gpu"]["ratio_to_plain"] = 0.9
    nccl = other["steps"]["ddp_backends"]["figures"]["nccl_1_ranks_powersgd"]
    nccl["gloo"] = copy.deepcopy(nccl["under_test"]) | {"device": "cpu", "backend": "gloo"}
    nccl["parameters"] = {"max_abs_diff": 2.5e-3}
    text = gpu_readme.render(other)
    assert "One NVIDIA A100" in text and "gRPC 1.23 GB/s" in text
    assert "| resnet18 | 999/s (batch 16) | 20144/s (batch 256) | 0.90x |" in text
    assert ("`nccl_1_ranks_powersgd` (nccl on cuda:0, 1 rank, 16 steps) 2.5e-03, final loss 1.5007 "
            "both") in text


def test_it_writes_between_the_markers_alone(gpu_readme, report, monkeypatch, tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(f"before\n{gpu_readme.BEGIN}stale\n{gpu_readme.END}after\n")
    monkeypatch.setattr(gpu_readme, "PAGE", page)
    assert gpu_readme.main([str(RESULT)]) == 0
    rendered = gpu_readme.render(report)
    assert page.read_text() == f"before\n{gpu_readme.BEGIN}{rendered}{gpu_readme.END}after\n"
    page.write_text("no markers\n")
    assert gpu_readme.main([str(RESULT)]) == 1 and page.read_text() == "no markers\n"
