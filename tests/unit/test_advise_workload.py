"""Measuring one worker's step: the model comes from the project's builders (a user's file
among them), its gradient's bytes are the parameters', and each compressor's payload is
what the compressor writes."""

from __future__ import annotations

import math

import pytest
from plugin_files import write_plugin

from disttrain.advise import Workload, measure_workload
from disttrain.advise.payloads import compact_topk_nbytes, powersgd_numel
from disttrain.compression import Compressor
from disttrain.config import load_config
from disttrain.core.errors import ConfigError


def config(**keys):
    return load_config(None, {f"training.{k}": v for k, v in keys.items()}, [])


def test_measures_the_shipped_model_and_every_compressor():
    workload = measure_workload(config(model_architecture="mlp", dataset="digits", batch_size=8), repeats=1)
    assert workload.source == "measured" and workload.batch_size == 8
    assert workload.gradient_bytes == 4 * workload.num_parameters
    assert workload.forward_s > 0 and workload.backward_s > 0 and workload.optimizer_s > 0
    assert workload.overlap_contention_s >= 0  # measured: 0 where a core was free for the push
    assert set(workload.compression) == {"quantization", "topk", "topk-compact", "fp16", "bf16", "powersgd"}
    assert set(workload.pull_compression) == {"quantization", "topk", "fp16", "bf16"}
    assert workload.shapes and sum(math.prod(s) for s in workload.shapes) == workload.num_parameters
    powersgd = workload.compression["powersgd"]
    assert powersgd.payload_bytes == 4 * powersgd_numel(workload.shapes, 2) < workload.gradient_bytes
    assert powersgd.encode_s > 0 and powersgd.decode_s > 0
    topk = workload.compression["topk"]
    whole = [("all", workload.num_parameters)]
    assert topk.payload_bytes == Compressor("topk", 0.01).payload_nbytes(whole, 4)
    assert workload.compression["fp16"].payload_bytes < workload.gradient_bytes
    # the compact block as the compressor wrote it on the model's gradient: its top 1% lie
    # closer together than at random, so a little under the formula's 3.3 bytes each
    compact = workload.compression["topk-compact"]
    assert compact.payload_bytes < 0.5 * topk.payload_bytes
    assert 0.85 < compact.payload_bytes / compact_topk_nbytes(workload.num_parameters, 0.01) < 1.02
    given = workload.with_step_time(0.5)
    assert given.compute_s == pytest.approx(0.5) and given.source == "given" and given.compute_std_s == 0


def test_measures_a_language_model_on_token_batches():
    workload = measure_workload(config(model_architecture="gpt_small", dataset="synthetic:text", seq_len=16,
                                       batch_size=1, model_args={"n_layer": 1, "n_embd": 32, "n_head": 2}),
                                repeats=1)
    assert isinstance(workload, Workload) and workload.num_parameters > 0


def test_measures_a_users_model_file(tmp_path):
    plugin = write_plugin(tmp_path)
    workload = measure_workload(config(model_architecture=f"{plugin}:model", dataset=f"{plugin}:data",
                                       batch_size=4, model_args={"hidden": 5}), repeats=1)
    assert workload.num_parameters == 8 * 5 + 5 + 5 * 2 + 2


def test_a_model_that_fails_to_build_or_to_step_is_one_line(tmp_path):
    plugin = write_plugin(tmp_path)
    with pytest.raises(ConfigError, match="the factory says no"):
        measure_workload(config(model_architecture=f"{plugin}:raises", dataset="digits"), repeats=1)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("from torch import nn\n\ndef build(description):\n    return nn.Linear(3, 2)\n")
    with pytest.raises(ConfigError) as raised:
        measure_workload(config(model_architecture=f"{wrong}:build", dataset="digits", batch_size=2),
                         repeats=1)
    assert "failed a step on a batch of (2, 1, 8, 8)" in str(raised.value)
    assert "\n" not in str(raised.value)
