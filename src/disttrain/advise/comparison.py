"""The advice section of a comparison's report: each run's configuration predicted by the
cost model at 1 to 64 workers, from what the comparison itself measured.

The step comes from the baseline run: its compute per step (`time/compute_s`) is one
worker's forward and backward at the comparison's batch (split a third forward, two
thirds backward, as `Workload.with_step_time` splits a given step), and the rest of its
step (`time/step_s` less compute) stands for the optimizer and the loop's own work. A
compressor's encode time and payload come from the run that used it (`time/compression_s`
and `compression/ratio` of its workers or ranks); what no run measured (a decoder's time,
a compressor only a DDP run used) is timed here on the model's gradient. The model is
built from the baseline's resolved config (its sizes, not its speed). Nothing is
re-trained and no step re-timed. The overlap's contention (`Workload.overlap_contention_s`)
is not measured by a run: it is taken as 0 there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from disttrain.advise.costmodel import OUTER_COMPRESSIONS, Candidate, CostModel
from disttrain.advise.link import Link
from disttrain.advise.probe import measure_loopback
from disttrain.advise.workload import CompressionCost, Workload, measure_compressor, measure_powersgd
from disttrain.compression import Compressor
from disttrain.compression.dgc import DgcRules
from disttrain.config import Config, config_from_dict
from disttrain.core.errors import ConfigError, DisttrainError, InputFileError
from disttrain.report.advice import AdviceSection, Advisor, ScalingCurve
from disttrain.report.figures import OK
from disttrain.report.files import read_json_file
from disttrain.training import init_model

Row = dict[str, Any]
MAX_WORKERS = 64
BACKWARD_SHARE = 2 / 3


def comparison_advisor(link: Link | None = None, max_workers: int = MAX_WORKERS) -> Advisor:
    """The advisor `render_comparison` takes: predictions on `link` (None: this machine's
    loopback, measured when the report is rendered) up to `max_workers`."""

    def advisor(folder: Path, rows: Sequence[Row]) -> AdviceSection:
        return advise_comparison(folder, rows, link or measure_loopback(), max_workers)

    return advisor


def advise_comparison(folder: Path, rows: Sequence[Row], link: Link,
                      max_workers: int = MAX_WORKERS) -> AdviceSection:
    """The section for the comparison in `folder` whose report rows are `rows`."""
    baseline = next((r for r in rows if r["strategy"] == "baseline" and r["status"] == OK
                     and r["step_time"]["compute_s"] and r["samples_per_s"]), None)
    if baseline is None:
        return AdviceSection(unavailable="the comparison has no finished baseline run, whose step the "
                                         "predictions start from (add baseline to --strategies)")
    try:
        config = run_config(folder, baseline)
        workload = comparison_workload(config, baseline, rows, folder)
    except DisttrainError as e:  # the config unreadable, the model's plug-in gone since the run
        return AdviceSection(unavailable=f"the baseline's model cannot be built from its config: {e}")
    model = cost_model(config, workload, link)
    measured_counts = {r["workers"] for r in rows if r["status"] == OK}
    top = max(max_workers, *measured_counts)
    counts = tuple(sorted({2**i for i in range(top.bit_length()) if 2**i <= top} | measured_counts))
    single = workload.batch_size / model.single_step_s()
    curves, skipped = [], {}
    for row in rows:
        if row["strategy"] == "baseline" or row["status"] != OK:
            continue
        try:
            candidate = candidate_of(row, run_config(folder, row))
            predictions = [model.predict(candidate, n) for n in counts]
        except (InputFileError, ConfigError, ValueError) as e:
            skipped[row["name"]] = str(e)
            continue
        curves.append(ScalingCurve(
            row["name"], candidate.label(), counts, tuple(p.samples_per_s for p in predictions),
            tuple(p.samples_per_s / single for p in predictions), row["workers"], row["samples_per_s"],
            row["speedup"]))
    inputs = {"workload": workload.to_dict(), "link": link.to_dict(),
              "baseline": baseline["name"],
              "description": f"predicted for {workload.model} at batch {workload.batch_size} per worker "
                             f"from {baseline['name']}'s step ({workload.compute_s * 1e3:.3g} ms compute, "
                             f"{workload.optimizer_s * 1e3:.3g} ms more per step) on "
                             f"{link.describe()}"}
    return AdviceSection(tuple(curves), inputs, skipped)


def run_config(folder: Path, row: Row) -> Config:
    """The resolved config a run's summary.json holds.

    Raises:
        InputFileError: the summary is missing or unreadable; ConfigError: its config is invalid.
    """
    summary = read_json_file(folder / row["log_dir"] / "summary.json", "run summary")
    if not isinstance(summary, dict) or not isinstance(summary.get("config"), dict):
        raise InputFileError(f"{folder / row['log_dir'] / 'summary.json'}: holds no resolved config")
    return config_from_dict(summary["config"])


def candidate_of(row: Row, config: Config) -> Candidate:
    """The cost model's configuration of a run: its strategy, compression, shards and
    local steps.

    Raises:
        ValueError: a strategy or compression the cost model does not predict.
    """
    strategy = row["strategy"]
    if strategy == "ps":
        strategy = f"ps-{config.ps.aggregation_mode}"
    if strategy == "ps-ssp":
        strategy = "ps-async"  # SSP's best case: nobody waits for the slowest
    compression = compression_of(config)
    sync_every = config.training.sync_every if strategy != "ps-async" else 1
    servers = config.ps.num_servers if strategy.startswith("ps") else 0
    pull = config.compression.pull if strategy.startswith("ps") and sync_every == 1 else "none"
    local = strategy != "ps-async" and sync_every > 1
    training = config.training
    return Candidate(strategy, compression, servers, sync_every, pull,
                     training.outer_fragments if local else 1,
                     training.outer_compression if local and strategy == "ddp" else "none",
                     training.outer_delay if local else 0)


def cost_model(config: Config, workload: Workload, link: Link, compute_cv: float = 0.0) -> CostModel:
    """The cost model of `workload` on `link` under a run's config: DDP's buckets, the
    parameter server's overlap, its trial and the contention measured with the workload,
    pull compression, DGC's rules."""
    return CostModel(workload, link, config.ddp.bucket_cap_mb * 2**20, config.ps.overlap, compute_cv,
                     config.compression.pull_ratio, config.compression.pull_dense_every,
                     config.ps.overlap_trial_steps > 0, workload.overlap_contention_s, dgc_rules(config))


def dgc_rules(config: Config) -> DgcRules | None:
    """DGC's rules of a run's top-k (None: none, or not top-k)."""
    return DgcRules.of(config.compression) if config.compression.type == "topk" else None


def compression_of(config: Config) -> str:
    """The cost model's name of a run's compression (topk-compact: `compression.compact`)."""
    section = config.compression
    if not section.enabled:
        return "none"
    return "topk-compact" if section.type == "topk" and section.compact else section.type


def comparison_workload(config: Config, baseline: Row, rows: Sequence[Row], folder: Path) -> Workload:
    """One worker's step from the baseline's measurements, and each compressor the runs
    used, as measured by them where they did."""
    model = init_model(config.training)
    params = [p for p in model.parameters() if p.requires_grad]
    compute_s = float(baseline["step_time"]["compute_s"])
    rest_s = max(0.0, float(baseline["step_time"]["step_s"] or compute_s) - compute_s)
    gradient_bytes = sum(p.numel() * p.element_size() for p in params)
    costs: dict[str, CompressionCost] = {}
    pull_costs: dict[str, CompressionCost] = {}
    segments = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(p.shape, generator=generator) for p in params]
    flat = torch.cat([g.reshape(-1) for g in gradients]) if gradients else torch.empty(0)
    for row in rows:
        if row["status"] != OK or row["strategy"] == "baseline":
            continue
        try:
            run = run_config(folder, row)
        except (InputFileError, ConfigError):
            continue
        section, outer = run.compression, OUTER_COMPRESSIONS[run.training.outer_compression]
        if section.pull != "none" and section.pull not in pull_costs:
            pull = Compressor(section.pull, section.pull_ratio)
            pull_costs[section.pull] = measure_compressor(pull, flat, segments, repeats=1)
        if outer != "none" and outer not in costs:  # Streaming DiLoCo's pseudo-gradients
            costs[outer] = measure_compressor(Compressor(outer, section.ratio), flat, segments, repeats=1)
        name = compression_of(run)
        if name == "none" or name in costs:
            continue
        if section.type == "powersgd":
            cost = measure_powersgd(gradients, section.powersgd_rank, repeats=1)
        else:
            compressor = Compressor(section.type, section.ratio, compact=name == "topk-compact")
            cost = measure_compressor(compressor, flat, segments, repeats=1)
        encode_s, ratio = row["step_time"].get("compression_s"), row.get("compression_ratio")
        costs[name] = replace(
            cost, encode_s=float(encode_s) if encode_s else cost.encode_s,
            payload_bytes=round(gradient_bytes / ratio) if ratio else cost.payload_bytes)
    return Workload(config.training.model_architecture, sum(p.numel() for p in params), gradient_bytes,
                    len(params), config.training.batch_size, compute_s * (1 - BACKWARD_SHARE),
                    compute_s * BACKWARD_SHARE, rest_s, 0.0, f"measured by {baseline['name']}", costs,
                    tuple(tuple(p.shape) for p in params), pull_costs)
