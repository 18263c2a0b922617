"""Which config keys a run acts on: the keys set away from their defaults that a run of
one strategy ignores, each with the reason, so that the command line can say so instead
of letting a setting pass silently.

Pure: a resolved `Config` and a strategy ("baseline", "ps" or "ddp") in, a list out. Each
rule states what the strategies really read (the section a strategy never opens, the
mode a key belongs to, the model or data set it sizes); a key no rule names is acted on
by every strategy. `system.architecture` is not judged here: a strategy's own command
decides what runs, and `disttrain train` runs what the key names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from disttrain.config.schema import DATASETS, SECTIONS, Config

STRATEGIES = ("baseline", "ps", "ddp")
NOT_JUDGED = ("system.architecture",)


@dataclass(frozen=True)
class IgnoredKey:
    """A key set away from its default that the run does not act on."""

    key: str  # section.key
    value: Any
    reason: str

    def line(self, by: str = "this run") -> str:
        """The one line the command line logs for it (the value as YAML writes it)."""
        return f"{self.key} = {_shown(self.value)} is ignored by {by}: {self.reason}"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value) if value == "" else str(value)


@dataclass(frozen=True)
class Rule:
    """The keys `pattern` names (`section.key`, or a prefix ending in `*` such as `ddp.*`)
    are ignored when `reason(config, strategy)` gives a reason (None: acted on)."""

    pattern: str
    reason: Callable[[Config, str], str | None]
    unless: str = ""  # a prefix of keys the pattern does not cover

    def covers(self, key: str) -> bool:
        if self.unless and key.startswith(self.unless):
            return False
        if self.pattern.endswith("*"):
            return key.startswith(self.pattern[:-1])
        return key == self.pattern


def _reads_data_dir(dataset: str) -> bool:
    """Whether data set `dataset` is read from (and downloaded into) `training.data_dir`."""
    url_copy = dataset.startswith(("text:", "image-folder:", "shards:")) and "://" in dataset
    return dataset in ("mnist", "fashion_mnist", "cifar10") or dataset.startswith("torchvision:") or url_copy


def _when(condition: Callable[[Config, str], bool], reason: str | Callable[[Config], str]
          ) -> Callable[[Config, str], str | None]:
    def judge(config: Config, strategy: str) -> str | None:
        if not condition(config, strategy):
            return None
        return reason if isinstance(reason, str) else reason(config)
    return judge


BASELINE = "baseline"
HALF_PRECISION = ("fp16", "bf16")

# The first rule that holds gives a key's reason: whole sections come before the keys within one.
RULES: tuple[Rule, ...] = (
    Rule("ddp.*", _when(lambda c, s: s != "ddp", "only DDP reads the ddp section")),
    Rule("ps.*", _when(lambda c, s: s != "ps", "only the parameter server reads the ps section")),
    *(Rule(f"ddp.{key}", _when(lambda c, s: c.training.local_update_mode,
                               "with local updates each rank steps its plain model, without the "
                               "DDP wrapper (training.sync_every > 1)"))
      for key in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters")),
    Rule("coordinator.*", _when(lambda c, s: s == BASELINE, "the baseline runs without a coordinator")),
    Rule("compression.*", _when(lambda c, s: s == BASELINE, "the baseline sends no gradients to compress")),
    Rule("system.num_workers", _when(lambda c, s: s == BASELINE, "the baseline trains in one process")),
    Rule("system.preemption_grace_s", _when(lambda c, s: s == BASELINE, "the baseline's one process "
                                            "stops at the step's end, with no peers to wait for")),
    Rule("system.balance*", _when(lambda c, s: s == BASELINE,
                                  "the baseline's one process takes every batch")),
    Rule("compression.*", _when(lambda c, s: not c.compression.enabled, "compression.enabled is false"),
         unless="compression.pull"),  # pull compression goes on and off by itself
    # Pull compression: the parameter server, in every mode (see server/broadcast.py).
    Rule("compression.pull*", _when(lambda c, s: s != "ps", "only the parameter server pulls parameters")),
    Rule("compression.pull_ratio", _when(
        lambda c, s: c.compression.pull != "topk",
        lambda c: f"only topk sends a share of the elements (compression.pull is {c.compression.pull})")),
    Rule("compression.pull_dense_every", _when(lambda c, s: c.compression.pull == "none",
                                               "compression.pull is none: every pull is dense")),
    Rule("compression.ratio", _when(
        lambda c, s: c.compression.type != "topk",
        lambda c: f"only topk sends a share of each tensor (compression.type is {c.compression.type})")),
    *(Rule(f"compression.{key}", _when(
        lambda c, s: c.compression.type != "topk",
        lambda c: f"only topk applies DGC's rules and compact payloads (compression.type is "
                  f"{c.compression.type})"))
      for key in ("momentum_correction", "momentum_masking", "local_clip_norm", "warmup_steps",
                  "warmup_ratio", "compact")),
    Rule("compression.stochastic_rounding", _when(
        lambda c, s: c.compression.type != "quantization",
        lambda c: f"only quantization rounds (compression.type is {c.compression.type})")),
    Rule("compression.ddp_collective", _when(
        lambda c, s: s != "ddp" or c.compression.type not in ("quantization", "topk"),
        lambda c: "only DDP's quantization and topk combine payloads by a collective of their choice "
                  f"(compression.type is {c.compression.type})")),
    Rule("compression.powersgd_rank", _when(
        lambda c, s: c.compression.type != "powersgd",
        lambda c: f"only powersgd approximates by rank (compression.type is {c.compression.type})")),
    Rule("compression.error_feedback", _when(
        lambda c, s: s == "ddp" and c.compression.type in HALF_PRECISION,
        lambda c: f"DDP's {c.compression.type} hook casts and all-reduces, and keeps no residual")),
    Rule("ps.staleness", _when(
        lambda c, s: c.ps.aggregation_mode != "ssp",
        lambda c: f"only ssp bounds staleness (ps.aggregation_mode is {c.ps.aggregation_mode})")),
    Rule("ps.ssp_clock", _when(
        lambda c, s: c.ps.aggregation_mode != "ssp",
        lambda c: f"only ssp counts its bound in steps or versions (ps.aggregation_mode is "
                  f"{c.ps.aggregation_mode})")),
    Rule("ps.overlap", _when(
        lambda c, s: c.training.local_update_mode,
        "with local updates a worker pushes once per round, after its last inner step "
        "(training.sync_every > 1)")),
    Rule("ps.overlap", _when(
        lambda c, s: c.ps.aggregation_mode != "sync",
        lambda c: f"only a synchronous step overlaps its pushes with backward (ps.aggregation_mode is "
                  f"{c.ps.aggregation_mode})")),
    Rule("ps.overlap_trial_steps", _when(
        lambda c, s: not c.ps.overlap or c.training.local_update_mode or c.ps.aggregation_mode != "sync",
        "only a synchronous step with ps.overlap on (and no local updates) tries its pushes both ways")),
    Rule("ps.backup_workers", _when(
        lambda c, s: c.ps.aggregation_mode != "sync",
        lambda c: f"only a synchronous step has backup workers (ps.aggregation_mode is "
                  f"{c.ps.aggregation_mode})")),
    Rule("system.balance_margin", _when(
        lambda c, s: c.system.balance != "auto",
        lambda c: f"only balance auto compares speeds with a margin (system.balance is {c.system.balance})")),
    Rule("system.balance_interval", _when(
        lambda c, s: c.system.balance == "none",
        "equal batches are never re-planned (system.balance is none)")),
    Rule("coordinator.*", _when(
        lambda c, s: s == "ddp" and c.ddp.num_nodes > 1 and not c.coordinator.address,
        "a DDP run of several nodes without coordinator.address has no coordinator")),
    Rule("coordinator.max_restarts", _when(
        lambda c, s: s == "ddp", "DDP restarts its rank group ddp.max_restarts times")),
    Rule("coordinator.reassign_after", _when(
        lambda c, s: s == "ddp", "only a parameter-server run hands a failed worker's blocks to the others")),
    Rule("coordinator.heartbeat_timeout", _when(
        lambda c, s: bool(c.coordinator.address),
        lambda c: f"the coordinator at {c.coordinator.address} declares failures by its own config")),
    Rule("coordinator.straggler_factor", _when(
        lambda c, s: bool(c.coordinator.address),
        lambda c: f"the coordinator at {c.coordinator.address} flags stragglers by its own config")),
    Rule("training.sync_every", _when(lambda c, s: s == BASELINE, "the baseline's one process has "
                                      "nothing to synchronise")),
    Rule("training.local_updates", _when(lambda c, s: s == BASELINE, "the baseline's one process has "
                                         "nothing to synchronise")),
    Rule("training.outer_*", _when(lambda c, s: s == BASELINE, "the baseline's one process has "
                                   "nothing to synchronise")),
    Rule("training.outer_*", _when(lambda c, s: not c.training.local_update_mode,
                                   "the outer optimizer steps only with local updates "
                                   "(training.sync_every is 1)")),
    Rule("training.momentum", _when(
        lambda c, s: c.training.optimizer != "sgd",
        lambda c: f"only sgd takes momentum (training.optimizer is {c.training.optimizer})")),
    Rule("training.lr_step_size", _when(
        lambda c, s: c.training.lr_schedule != "step",
        lambda c: f"only the step schedule decays every lr_step_size steps (training.lr_schedule is "
                  f"{c.training.lr_schedule})")),
    Rule("training.lr_gamma", _when(
        lambda c, s: c.training.lr_schedule != "step",
        lambda c: f"only the step schedule multiplies by lr_gamma (training.lr_schedule is "
                  f"{c.training.lr_schedule})")),
    Rule("training.lr_decay_steps", _when(
        lambda c, s: c.training.lr_schedule not in ("cosine", "linear"),
        lambda c: f"only cosine and linear decay until a step (training.lr_schedule is "
                  f"{c.training.lr_schedule})")),
    Rule("training.lr_min", _when(
        lambda c, s: c.training.lr_schedule not in ("cosine", "linear"),
        lambda c: f"only cosine and linear decay to a floor (training.lr_schedule is "
                  f"{c.training.lr_schedule})")),
    Rule("training.mlp_*", _when(
        lambda c, s: c.training.model_architecture not in ("mlp", "mlp_bn"),
        lambda c: f"only the mlp model reads it (training.model_architecture is "
                  f"{c.training.model_architecture})")),
    Rule("training.num_samples", _when(
        lambda c, s: c.training.dataset.partition(":")[0] != "synthetic",
        lambda c: f"it sizes the synthetic data set (training.dataset is {c.training.dataset})")),
    Rule("training.seq_len", _when(
        lambda c, s: not c.training.dataset.startswith("text:") and c.training.dataset != "synthetic:text",
        lambda c: f"it cuts text:FILE into windows (training.dataset is {c.training.dataset})")),
    Rule("training.dataset_args", _when(
        lambda c, s: (c.training.dataset in DATASETS or c.training.dataset.startswith(
            ("text:", "image-folder:", "synthetic:", "torchvision:", "shards:"))),
        lambda c: f"only a data-set factory takes them (training.dataset is {c.training.dataset})")),
    *(Rule(f"training.{key}", _when(
        lambda c, s: not c.training.dataset.startswith("shards:") and not (
            c.training.dataset.startswith("image-folder:") and "://" in c.training.dataset),
        lambda c: f"it bounds the reading of shards:DIR and image-folder:URL (training.dataset is "
                  f"{c.training.dataset})"))
      for key in ("shard_cache_bytes", "num_shards_in_memory", "num_shards_ahead")),
    Rule("training.data_dir", _when(
        lambda c, s: not _reads_data_dir(c.training.dataset),
        lambda c: f"{c.training.dataset} is read from no folder (training.dataset is {c.training.dataset})")),
    Rule("training.download", _when(
        lambda c, s: not _reads_data_dir(c.training.dataset),
        lambda c: f"{c.training.dataset} is never downloaded (training.dataset is {c.training.dataset})")),
)


def changed_keys(config: Config) -> dict[str, Any]:
    """`section.key` -> value, for every key whose value differs from its default."""
    defaults = Config()
    changed = {}
    for section in SECTIONS:
        mine, default = getattr(config, section), getattr(defaults, section)
        for field in dataclasses.fields(mine):
            value = getattr(mine, field.name)
            if value != getattr(default, field.name):
                changed[f"{section}.{field.name}"] = value
    return changed


def ignored_keys(config: Config, strategy: str) -> list[IgnoredKey]:
    """The keys set away from their defaults that a run of `strategy` does not act on, in
    the config's order, each with the first reason that holds.

    Raises:
        ValueError: an unknown strategy.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    ignored = []
    for key, value in changed_keys(config).items():
        if key in NOT_JUDGED:
            continue
        reason = next((r for rule in RULES if rule.covers(key) and (r := rule.reason(config, strategy))),
                      None)
        if reason is not None:
            ignored.append(IgnoredKey(key, value, reason))
    return ignored


def ignored_by_every_run(runs: Iterable[tuple[Config, str]]) -> list[IgnoredKey]:
    """The keys that every run of a comparison ignores (each run: its config and strategy),
    with the first run's value and reason: a key one run acts on is not ignored."""
    per_run = [ignored_keys(config, strategy) for config, strategy in runs]
    if not per_run:
        return []
    common = set.intersection(*({k.key for k in keys} for keys in per_run))
    return [k for k in per_run[0] if k.key in common]
