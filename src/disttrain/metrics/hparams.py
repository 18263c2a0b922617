"""A run's hyper-parameters and final figures for TensorBoard's HPARAMS tab.

Each run writes them once, into `<log_dir>/hparams/` (a TensorBoard run folder of its
own beside the processes' `baseline/`, `worker0/`, `rank0/`), so pointing TensorBoard at
a folder holding several runs' log dirs compares them side by side. The values come
from the run summary alone: its resolved config and its final figures.

The process that first writes the summary writes them (the baseline; PS worker 0; DDP
rank 0), right after it: the launchers only re-write the summary's total time, which is
not a figure here. Writing them is a convenience beside summary.json, the record of the
run: a failure is logged as a warning and the run goes on.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from disttrain.metrics.summary import RunSummary

logger = logging.getLogger(__name__)

HPARAMS_FOLDER = "hparams"
METRIC_PREFIX = "hparam/"  # apart from the scalars the processes log under their own keys
FINAL_FIGURES = ("final_accuracy", "final_loss", "train_time_s", "throughput_samples_per_s")


def hparam_values(summary: RunSummary) -> dict[str, str | int | float | bool]:
    """The hyper-parameters to compare runs by, flat, from the summary's resolved config.

    The training features (schedule, weight decay, clipping, precision) appear when the
    config has them. The aggregation mode and staleness appear for parameter-server runs;
    the compression scheme for runs that compressed (`compression` is "none" otherwise),
    with the top-k ratio or PowerSGD rank where the scheme uses one. Values other than str, int, float
    and bool are left out (TensorBoard takes no others).
    """
    config = summary.config
    training, ps, compression = config["training"], config.get("ps", {}), config.get("compression", {})
    values: dict[str, Any] = {
        "strategy": summary.strategy, "dataset": summary.dataset,
        "model": training.get("model_architecture"), "batch_size": training.get("batch_size"),
        "learning_rate": training.get("learning_rate"), "optimizer": training.get("optimizer"),
        "world_size": summary.world_size, "seed": training.get("seed"),
        "num_epochs": training.get("num_epochs"),
        # The training features (absent from configs of before them: left out).
        **{key: training.get(key) for key in ("lr_schedule", "weight_decay", "clip_grad_norm", "precision")},
    }
    if summary.strategy.startswith("ps"):
        values.update(aggregation_mode=ps.get("aggregation_mode"), staleness=ps.get("staleness"))
    compressed = "compression_bytes_sent" in summary.extra  # present when compression was on
    scheme = compression.get("type") if compressed else "none"
    values["compression"] = scheme
    if scheme == "topk":
        values["compression_topk_ratio"] = compression.get("ratio")
    elif scheme == "powersgd":
        values["compression_powersgd_rank"] = compression.get("powersgd_rank")
    return {k: v for k, v in values.items() if isinstance(v, str | int | float | bool)}


def metric_values(summary: RunSummary) -> dict[str, float]:
    """The final figures, `hparam/<summary field>`, and each time to a target reached as
    `hparam/time_to_accuracy_<threshold>_s`, or a language model's
    `hparam/time_to_perplexity_<target>_s` (TensorBoard takes no None: one never reached
    is left out, as is any non-finite figure)."""
    figures: dict[str, Any] = {name: getattr(summary, name) for name in FINAL_FIGURES}
    figures["final_perplexity"] = summary.extra.get("final_perplexity")  # a language model's
    target, times = summary.time_to_target
    figures.update({f"time_to_{target.name}_{key}_s": seconds for key, seconds in times.items()})
    return {METRIC_PREFIX + name: float(value) for name, value in figures.items()
            if isinstance(value, int | float) and math.isfinite(value)}


def write_hparams(summary: RunSummary, log_dir: str | Path) -> Path | None:
    """Write the run's hyper-parameters and final figures to `<log_dir>/hparams/` with
    `SummaryWriter.add_hparams`, replacing event files an earlier run in the same log dir
    left there. Call once per run, after the summary is final but for its total time.

    Returns:
        The folder, or None when writing failed (logged as a warning; never raises).
    """
    folder = Path(log_dir) / HPARAMS_FOLDER
    try:
        from torch.utils.tensorboard import SummaryWriter

        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("events.out.tfevents.*"):
            old.unlink()
        with SummaryWriter(str(folder)) as writer:
            # run_name "." keeps the session in this folder, not a timestamped subfolder.
            writer.add_hparams(hparam_values(summary), metric_values(summary), run_name=".")
    except Exception as e:  # TensorBoard and protobuf raise many types; none may end the run
        logger.warning("could not write the hyper-parameters for TensorBoard to %s: %s", folder, e)
        return None
    return folder


def read_hparams(folder: str | Path) -> tuple[dict[str, str | float | bool], dict[str, float]]:
    """Read back what `write_hparams` wrote in `folder` as TensorBoard's HPARAMS tab sees
    it: the hyper-parameters (numbers come back as float) and the metrics by name with
    their values.

    Raises:
        ValueError: no folder, or no hparams plugin data in its event files.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    if not Path(folder).is_dir():
        raise ValueError(f"{folder} is not a folder")
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    try:
        content = accumulator.PluginTagToContent(metadata.PLUGIN_NAME)
        start = HParamsPluginData.FromString(content[metadata.SESSION_START_INFO_TAG]).session_start_info
        experiment = HParamsPluginData.FromString(content[metadata.EXPERIMENT_TAG]).experiment
    except KeyError as e:
        raise ValueError(f"{folder} holds no TensorBoard hparams data") from e
    values = {name: getattr(value, value.WhichOneof("kind")) for name, value in start.hparams.items()}
    metrics = {info.name.tag: accumulator.Scalars(info.name.tag)[-1].value
               for info in experiment.metric_infos}
    return values, metrics
