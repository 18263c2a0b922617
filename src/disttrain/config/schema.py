"""The sections of the run configuration, one per component, with their rules.

Each component reads its own section: `training` (data, model, optimizer, schedule),
`system` (processes and output folders), `ps` (the parameter server), `ddp`,
`compression` and `coordinator`. The original config's `system.*` spelling of
`aggregation_mode`, the compression and the heartbeat keys stays valid (see
`loading.SYSTEM_ALIASES`).

A field's metadata holds its rule (`check`, `rule`). Every key is acted on by some run;
which keys a run of each strategy ignores, and why, is `usage`'s to say.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from disttrain.core import object_store
from disttrain.core.addresses import split_host_port

DATASETS = ("mnist", "fashion_mnist", "cifar10", "digits", "synthetic")
# system.architecture -> the strategy it names, which is also its `disttrain` command.
STRATEGY_OF_ARCHITECTURE = {"baseline": "baseline", "parameter_server": "ps", "ddp": "ddp"}
ARCHITECTURES = tuple(STRATEGY_OF_ARCHITECTURE)
AGGREGATION_MODES = ("sync", "async", "ssp")
SSP_CLOCKS = ("steps", "versions")
COMPRESSION_TYPES = ("quantization", "topk", "fp16", "bf16", "powersgd")
COMPRESSION_TYPES_PULL = ("quantization", "topk", "fp16", "bf16")  # payload schemes: no powersgd
OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "step", "cosine", "linear")
PRECISIONS = ("none", "bf16", "fp16")
BACKENDS = ("auto", "gloo", "nccl")
LR_SCALINGS = ("none", "linear")
DDP_RECOVERIES = ("restart", "live")
# auto: shared memory between processes of one machine, gRPC bytes between machines.
PAYLOAD_TRANSPORTS = ("auto", "grpc", "shared_memory")
# none: equal batches; proportional: batches in proportion to each process's measured
# speed; auto: proportional once the slowest is more than system.balance_margin behind.
BALANCES = ("none", "proportional", "auto")
# Local-update training (LocalSGD / DiLoCo): how the averaged pseudo-gradient is applied.
OUTER_OPTIMIZERS = ("sgd", "nesterov")
OUTER_COMPRESSIONS = ("none", "fp16", "int8")


def _rule(check, text: str, **extra: Any) -> dict[str, Any]:
    return {"check": check, "rule": text, **extra}


def _choice(options: tuple[str, ...], **extra: Any) -> dict[str, Any]:
    return _rule(lambda v: v in options, "must be one of " + ", ".join(options), **extra)


def _address_problems(key: str, address: str, example: str) -> list[str]:
    """The problem of an address key (`key` as the user spelled it) that is set and is not
    HOST:PORT; none when it is empty or well formed."""
    if not address:
        return []
    try:
        split_host_port(address)
    except ValueError:
        return [f"{key}: {address!r} must look like HOST:PORT (port 0-65535), e.g. {example}"]
    return []


POSITIVE = _rule(lambda v: v > 0, "must be > 0")
NON_NEGATIVE = _rule(lambda v: v >= 0, "must be >= 0")
NON_EMPTY = _rule(lambda v: bool(v.strip()), "must not be empty")
MAPPING = _rule(lambda v: all(isinstance(k, str) and k.isidentifier() for k in v),
                "must be a mapping of keyword names to values, e.g. {n_layer: 2}")


def _is_dataset(name: str) -> bool:
    """A built-in set, a `prefix:place` spec (text:, image-folder:, torchvision:, PATH.py:,
    module:), or a name an installed package registers in the `disttrain.datasets` entry
    points."""
    if name in DATASETS or ":" in name.strip(":"):
        return True
    return any(ep.name == name for ep in importlib.metadata.entry_points(group="disttrain.datasets"))


DATASET_RULE = _rule(_is_dataset, "must be one of " + ", ".join(DATASETS) + ", synthetic:CxHxW, "
                     "synthetic:text, text:FILE, image-folder:DIR, shards:DIR, torchvision:NAME, "
                     "PATH.py:FACTORY, module:FACTORY or a disttrain.datasets entry point's name")
OPTIONAL_POSITIVE = _rule(lambda v: v is None or v > 0, "must be a positive integer or null (all)")


@dataclass(frozen=True)
class TrainingConfig:
    """What is trained and how: data, model, optimizer, schedule."""

    batch_size: int = field(default=64, metadata=POSITIVE)
    learning_rate: float = field(default=0.001, metadata=POSITIVE)
    num_epochs: int = field(default=1, metadata=POSITIVE)
    dataset: str = field(default="digits", metadata=DATASET_RULE)
    model_architecture: str = field(default="simplecnn", metadata=NON_EMPTY)
    checkpoint_interval: int = field(default=200, metadata=POSITIVE)
    optimizer: str = field(default="adam", metadata=_choice(OPTIMIZERS))
    momentum: float = field(default=0.9, metadata=_rule(lambda v: 0 <= v < 1, "must be in [0, 1)"))
    weight_decay: float = field(default=0.0, metadata=NON_NEGATIVE)
    seed: int = field(default=42, metadata=NON_NEGATIVE)
    data_dir: str = field(default="data", metadata=NON_EMPTY)
    download: bool = True  # fetch missing data set files from the canonical mirrors
    max_train_samples: int | None = field(default=None, metadata=OPTIONAL_POSITIVE)
    max_test_samples: int | None = field(default=None, metadata=OPTIONAL_POSITIVE)
    num_samples: int = field(default=2048, metadata=POSITIVE)
    eval_batch_size: int = field(default=1000, metadata=POSITIVE)
    log_interval: int = field(default=10, metadata=POSITIVE)
    mlp_hidden_size: int = field(default=256, metadata=POSITIVE)
    mlp_num_layers: int = field(default=2, metadata=POSITIVE)
    # --- A model and a data set of the user's own (plug-ins). `model_architecture` and
    # `dataset` also take PATH.py:FACTORY, module:FACTORY or an entry point's name.
    # Keyword arguments of the model factory (e.g. n_layer: 2 for gpt_small).
    model_args: dict = field(default_factory=dict, metadata=MAPPING)
    # Keyword arguments of a user's data-set factory.
    dataset_args: dict = field(default_factory=dict, metadata=MAPPING)
    # How a user's data set's items become a batch: "" (torch's default collation), pad
    # (fields of different lengths padded to the longest: inputs with 0, targets with
    # -100, which the loss leaves out), or a collate function of your own (PATH.py:FN,
    # module:FN) taking the list of items and returning (inputs, targets) or a mapping.
    collate_fn: str = ""
    # The field of mapping items (the `datasets` library's rows) that holds the targets
    # ("labels", else "label"); the other tensor fields go to forward as keyword arguments.
    target_key: str = field(default="labels", metadata=NON_EMPTY)
    # The loss: task (cross-entropy of the logits against the targets), model (the model's
    # own: the targets passed to forward as labels=..., its output's `loss` used as it is),
    # or a function of your own (PATH.py:FN, module:FN) called as fn(output, targets).
    loss: str = field(default="task", metadata=NON_EMPTY)
    # Tokens per sample of a language-model data set (text:FILE's window).
    seq_len: int = field(default=128, metadata=POSITIVE)
    # -- a data set of array shards read as training reaches them (shards:URL) --
    # Bytes of the shards' copies kept on disk (in data_dir/cache/), the least recently
    # used removed first; 0: no bound.
    shard_cache_bytes: int = field(default=0, metadata=NON_NEGATIVE)
    # Shards held in memory at once, those read ahead included (least recently used dropped).
    num_shards_in_memory: int = field(default=4, metadata=POSITIVE)
    # Shards of this process's order fetched and read ahead by a background thread (0: none);
    # less than num_shards_in_memory.
    num_shards_ahead: int = field(default=2, metadata=NON_NEGATIVE)
    # -- training features: learning-rate schedule, clipping, precision, loader workers --
    # The rate by optimizer step: constant, step (x lr_gamma every lr_step_size steps), or
    # cosine / linear decay to lr_min at step lr_decay_steps; any of them after
    # warmup_steps of linear warm-up. On the parameter server a step is one global batch.
    lr_schedule: str = field(default="constant", metadata=_choice(LR_SCHEDULES))
    warmup_steps: int = field(default=0, metadata=NON_NEGATIVE)
    lr_decay_steps: int = field(default=0, metadata=NON_NEGATIVE)
    lr_min: float = field(default=0.0, metadata=NON_NEGATIVE)
    lr_step_size: int = field(default=1000, metadata=POSITIVE)
    lr_gamma: float = field(default=0.1, metadata=_rule(lambda v: 0 < v <= 1, "must be in (0, 1]"))
    # Scale the applied gradient down to this global L2 norm when above it (0: off).
    clip_grad_norm: float = field(default=0.0, metadata=NON_NEGATIVE)
    # Mixed precision of the forward pass: bf16 autocast (CPU or CUDA), fp16 (CUDA, with
    # loss scaling; not under the parameter server), or none.
    precision: str = field(default="none", metadata=_choice(PRECISIONS))
    # Processes that load training batches ahead of the steps (0: the training process
    # loads each batch itself); pinned memory on CUDA. The order and resume are the sampler's.
    loader_workers: int = field(default=0, metadata=NON_NEGATIVE)
    # -- local updates (LocalSGD / DiLoCo; DDP, and the parameter server in sync mode) --
    # Steps each worker takes with its own (inner) optimizer between two synchronisations
    # (H); 1: every step's gradient is averaged (no local updates). A round also ends at
    # an epoch's last step. At a round's end the pseudo-gradient (round-start parameters
    # minus the worker's current ones) is averaged over the workers and the outer
    # optimizer applies it to the round-start parameters on every worker alike.
    sync_every: int = field(default=1, metadata=_rule(lambda v: v >= 1, "must be >= 1 (1 = every step)"))
    # Take the local-update path even at sync_every 1 (with outer sgd at rate 1, momentum
    # 0 and an inner sgd it then equals per-step averaging: a check of the path).
    local_updates: bool = False
    # sgd (momentum as heavy ball when outer_momentum > 0) or nesterov (DiLoCo's: rate
    # 0.7, momentum 0.9); sgd at rate 1 without momentum averages the models (LocalSGD).
    outer_optimizer: str = field(default="sgd", metadata=_choice(OUTER_OPTIMIZERS))
    outer_learning_rate: float = field(default=1.0, metadata=POSITIVE)
    # null: the outer optimizer's own (nesterov: DiLoCo's 0.9; sgd: 0, plain averaging).
    outer_momentum: float | None = field(default=None, metadata=_rule(
        lambda v: v is None or 0 <= v < 1, "must be in [0, 1), or null (0.9 for nesterov, else 0)"))
    # Streaming DiLoCo: the parameters cut into this many fragments of about equal bytes in
    # the model's order (DDP: whole layers, but a layer larger than a share; the parameter
    # server: groups of whole shards, at most ps.num_servers); fragment f is exchanged
    # every sync_every steps, f * sync_every / outer_fragments steps after fragment 0, so
    # one exchange carries about 1/outer_fragments of the model. 1: the whole model at once.
    outer_fragments: int = field(default=1, metadata=_rule(lambda v: v >= 1, "must be >= 1 (1 = the "
                                                           "whole model at once)"))
    # After a fragment's outer step its parameters become outer_mixing x the worker's own
    # + (1 - outer_mixing) x the outer result (0: the outer result, plain DiLoCo).
    outer_mixing: float = field(default=0.0, metadata=_rule(lambda v: 0 <= v < 1, "must be in [0, 1) "
                                                             "(0 = take the outer result)"))
    # The pseudo-gradients exchanged as none (full precision), fp16 or int8, with error
    # feedback (what a payload leaves out is added to the next one) (DDP; the parameter
    # server compresses pushes by compression.type).
    outer_compression: str = field(default="none", metadata=_choice(OUTER_COMPRESSIONS))
    # Inner steps a fragment's exchange overlaps (Streaming DiLoCo's tau): it starts
    # at the fragment's sync step, training goes on, and outer_delay steps later its outer
    # result is applied, mixed by outer_mixing with the parameters that moved on meanwhile
    # (0.5 is the paper's choice with a delay). Less than sync_every; 0: the step waits.
    outer_delay: int = field(default=0, metadata=NON_NEGATIVE)

    def __post_init__(self) -> None:
        if self.outer_momentum is None:  # frozen: set once, as the config is built
            object.__setattr__(self, "outer_momentum", 0.9 if self.outer_optimizer == "nesterov" else 0.0)

    @property
    def local_update_mode(self) -> bool:
        """Whether workers take local steps between synchronisations (see `sync_every`)."""
        return self.sync_every > 1 or self.local_updates

    @property
    def streaming_mode(self) -> bool:
        """Whether Streaming DiLoCo's keys are set (`outer_fragments`, `outer_mixing`,
        `outer_compression`, `outer_delay`); they act with local updates only."""
        return (self.outer_fragments > 1 or self.outer_mixing > 0 or self.outer_compression != "none"
                or self.outer_delay > 0)

    def cross_problems(self, name: Callable[[str], str]) -> list[str]:
        """Problems between keys; `name(key)` is the key as the user spelled it."""
        problems = []
        if self.lr_schedule in ("cosine", "linear") and self.lr_decay_steps <= self.warmup_steps:
            problems.append(f"{name('lr_decay_steps')}: {self.lr_decay_steps} must be greater than "
                            f"{name('warmup_steps')} ({self.warmup_steps}): the {self.lr_schedule} "
                            "schedule decays until that step (set it to the run's total steps)")
        if self.lr_min > self.learning_rate:
            problems.append(f"{name('lr_min')}: {self.lr_min} must be at most "
                            f"{name('learning_rate')} ({self.learning_rate})")
        if self.num_shards_ahead >= self.num_shards_in_memory:
            problems.append(f"{name('num_shards_ahead')}: {self.num_shards_ahead} must be less than "
                            f"{name('num_shards_in_memory')} ({self.num_shards_in_memory}): the shards read "
                            "ahead are held in memory beside the one being read")
        if self.outer_optimizer == "nesterov" and self.outer_momentum == 0:
            problems.append(f"{name('outer_momentum')}: nesterov needs a momentum in (0, 1), e.g. 0.9 "
                            f"(or set {name('outer_optimizer')} to sgd)")
        if self.outer_fragments > 1 and self.outer_fragments > self.sync_every:
            problems.append(f"{name('outer_fragments')}: {self.outer_fragments} fragments need at least as "
                            f"many steps per round ({name('sync_every')} is {self.sync_every}) to be "
                            f"exchanged at steps of their own; raise {name('sync_every')} or lower "
                            f"{name('outer_fragments')}")
        if self.outer_delay and self.outer_delay >= self.sync_every:
            problems.append(f"{name('outer_delay')}: {self.outer_delay} must be less than "
                            f"{name('sync_every')} ({self.sync_every}): a fragment's exchange lands before "
                            "its next one starts; lower it or raise sync_every")
        return problems


@dataclass(frozen=True)
class SystemConfig:
    """How many processes train, and where a run's outputs go."""

    num_workers: int = field(default=2, metadata=POSITIVE)
    # The strategy the file was written for: `disttrain train` runs it; a strategy's own
    # command runs itself whatever this says (and warns when it names another).
    architecture: str = field(default="baseline", metadata=_choice(ARCHITECTURES))
    # A local folder, or any fsspec URL (`s3://bucket/run`) for every strategy.
    checkpoint_dir: str = field(default="checkpoints", metadata=NON_EMPTY)
    log_dir: str = field(default="logs", metadata=NON_EMPTY)
    checkpoint_keep: int = field(default=3, metadata=POSITIVE)
    # Seconds a failing checkpoint store (unreachable, full) is retried, with back-off,
    # before the run stops with one line saying how to --resume; 0: no retry.
    checkpoint_retry_s: float = field(default=60.0, metadata=NON_NEGATIVE)
    # Seconds a preempted run (SIGTERM) has to stop at a step its processes agree on, with
    # that step's checkpoint, before they are killed (a second SIGTERM kills them at once).
    preemption_grace_s: float = field(default=30.0, metadata=POSITIVE)
    num_threads: int = field(default=0, metadata=_rule(lambda v: v >= 0, "must be >= 0 (0 = auto)"))
    balance: str = field(default="none", metadata=_choice(BALANCES))
    balance_margin: float = field(default=0.2, metadata=_rule(lambda v: 0 < v < 1, "must be in (0, 1)"))
    # Steps between speed checks that may re-plan the batches mid-run (0: plan once).
    balance_interval: int = field(default=25, metadata=_rule(lambda v: v >= 0,
                                                             "must be >= 0 (0 = plan once)"))
    # The first plan instead of a measured one: each rank's batch, e.g. "48,16".
    balance_batches: str = field(default="", metadata=_rule(
        lambda v: not v or all(p.strip().isdigit() and int(p) > 0 for p in v.split(",")),
        "must be empty or comma-separated positive integers, one batch per rank, e.g. 48,16"))

    def cross_problems(self, name: Callable[[str], str]) -> list[str]:
        """Problems a value has beyond its own rule; `name(key)` is the key as the user spelled it."""
        if not object_store.is_url(self.checkpoint_dir):
            return []
        problem = object_store.backend_problem(self.checkpoint_dir)
        return [] if problem is None else [f"{name('checkpoint_dir')}: {problem}"]


@dataclass(frozen=True)
class PSConfig:
    """The parameter server: aggregation rule, shards, deadlines, transport."""

    aggregation_mode: str = field(default="sync", metadata=_choice(AGGREGATION_MODES))
    staleness: int = field(default=2, metadata=NON_NEGATIVE)
    # What ssp's bound counts. steps (SSP as Ho et al. define it): a worker that is
    # `staleness` steps ahead of the slowest live worker still training the epoch waits for
    # it; every gradient is applied, none recomputed (0: lockstep, as sync). versions: a
    # gradient computed on parameters more than `staleness` versions old (every push makes
    # one) is refused, and its worker pulls and computes it again.
    ssp_clock: str = field(default="steps", metadata=_choice(SSP_CLOCKS))
    num_servers: int = field(default=1, metadata=POSITIVE)
    backup_workers: int = field(default=0, metadata=NON_NEGATIVE)
    # A run that grows and shrinks (`--workers MIN:MAX`): system.num_workers is MIN (the
    # workers started, the fewest it trains with, and the scale of the global batch); a
    # worker sent SIGTERM leaves (down to MIN), SIGUSR1 to the launcher adds one (up to
    # this), each through a checkpoint rewritten for the new size. 0: the run's size is fixed.
    max_workers: int = field(default=0, metadata=NON_NEGATIVE)
    # Hot spares (`disttrain ps`): worker processes started ahead that do their whole
    # start-up and wait; a lost worker is restarted on one (its identity handed over)
    # instead of on a fresh process, and a new spare is started in its place. 0: none.
    spares: int = field(default=0, metadata=NON_NEGATIVE)
    rpc_timeout_s: float = field(default=60.0, metadata=POSITIVE)
    bind_host: str = field(default="127.0.0.1", metadata=NON_EMPTY)
    payload_transport: str = field(default="auto", metadata=_choice(PAYLOAD_TRANSPORTS))
    # -- Overlap (issue 26): communication hidden behind the backward pass. --------------
    # Sync mode: push each shard's gradient (and take back the parameters it leads to) as
    # soon as the backward pass has produced all of it, while backward computes the
    # earlier layers; false: push every shard after backward.
    overlap: bool = True
    # With overlap: the first steps (after 2 untimed) run this many ABBA pairs of one
    # overlapped and one plain push, and each worker keeps the overlap only where its
    # median gain beats the pairs' spread and 2% of the step, else the plain push (logged):
    # on saturated cores the overlap's CPU work can slow backward more than it hides.
    # Undecided (a gain, but within the margin), it runs this many pairs again, up to 3
    # rounds, and judges all of them. 0: no trial, always overlap.
    overlap_trial_steps: int = field(default=4, metadata=NON_NEGATIVE)


@dataclass(frozen=True)
class CompressionConfig:
    """Gradient compression on the parameter-server wire and in DDP's all-reduce (the
    original config's `system.compression_*` keys)."""

    enabled: bool = False
    type: str = field(default="quantization", metadata=_choice(COMPRESSION_TYPES))
    # topk: the share of each tensor's elements sent (k = ceil(numel * ratio)).
    ratio: float = field(default=0.01, metadata=_rule(lambda v: 0 < v <= 1, "must be in (0, 1]"))
    # Keep what a payload left out and add it to the next step's gradient.
    error_feedback: bool = True
    # quantization: round up with the fraction's probability, so the gradient stays unbiased.
    stochastic_rounding: bool = False
    # powersgd (DDP): rank of the low-rank approximation of each gradient matrix.
    powersgd_rank: int = field(default=2, metadata=POSITIVE)
    # quantization, topk (DDP): how the ranks' payloads are combined. gather: every rank
    # receives every payload ((n - 1) x the payload); two_phase (quantization): chunks
    # all-to-all, each averaged by its owner, the means all-gathered (about 2x the payload,
    # whatever n; rounds to nearest, no stochastic rounding); auto: the fewest bytes at the
    # run's size, by the rule `advise` predicts with: two_phase for int8 beyond 2 ranks, and a
    # bucket whose gathered payloads outgrow it all-reduced dense (top-k at (n - 1) x k).
    ddp_collective: str = field(default="auto", metadata=_choice(("auto", "gather", "two_phase")))
    # -- topk: Deep Gradient Compression's training rules (docs/compression.md).
    # Momentum correction's factor: each worker accumulates a velocity u = m u + g and sends
    # top-k of the sum of its velocities; 0: off. The applied update is then plain SGD
    # (training.optimizer: sgd, training.momentum: 0), or momentum would count twice.
    momentum_correction: float = field(default=0.0, metadata=_rule(lambda v: 0 <= v < 1,
                                                                   "must be in [0, 1); 0 turns it off"))
    # Momentum factor masking: the entries sent are zeroed in the velocity too.
    momentum_masking: bool = True
    # Local clipping: each tensor's gradient norm on a worker is clipped to this bound
    # times num_workers^-1/2 before it is accumulated; 0: no clipping.
    local_clip_norm: float = field(default=0.0, metadata=NON_NEGATIVE)
    # Sparsity warm-up: over this many steps the share kept falls exponentially from
    # warmup_ratio to ratio; 0: ratio from the first step.
    warmup_steps: int = field(default=0, metadata=NON_NEGATIVE)
    # The share kept at the warm-up's first step.
    warmup_ratio: float = field(default=0.25, metadata=_rule(lambda v: 0 < v <= 1, "must be in (0, 1]"))
    # Compact top-k payloads: values in fp16, indices as varint gaps (about 3 bytes an
    # element kept at ratio 0.01, against 8).
    compact: bool = False
    # -- pull compression (parameter server, sync mode): the shards answer a step with the
    # compressed change of their broadcast copy, which every worker holds exactly.
    # none: dense parameters; topk, quantization, fp16 or bf16 (independent of `enabled`).
    pull: str = field(default="none", metadata=_choice(("none", *COMPRESSION_TYPES_PULL)))
    # topk: the share of each shard's elements a pulled change carries.
    pull_ratio: float = field(default=0.01, metadata=_rule(lambda v: 0 < v <= 1, "must be in (0, 1]"))
    # Every this many versions the broadcast copy is reset to the parameters and sent dense.
    pull_dense_every: int = field(default=100, metadata=POSITIVE)

    def cross_problems(self, name: Callable[[str], str]) -> list[str]:
        """Problems between keys; `name(key)` is the key as the user spelled it."""
        if self.ddp_collective == "two_phase" and self.type == "topk":
            return [f"{name('ddp_collective')}: two_phase carries int8 payloads (compression.type: "
                    "quantization); top-k's payloads take gather or auto"]
        if self.ddp_collective == "two_phase" and self.stochastic_rounding:
            return [f"{name('stochastic_rounding')}: the two-phase collective "
                    f"({name('ddp_collective')}: two_phase) rounds to nearest; turn one of them off"]
        if self.type == "topk" and self.momentum_correction and not self.error_feedback:
            return [f"{name('momentum_correction')}: momentum correction accumulates what was not sent; "
                    f"set {name('error_feedback')}: true"]
        if self.type == "topk" and self.warmup_steps and self.warmup_ratio < self.ratio:
            return [f"{name('warmup_ratio')}: {self.warmup_ratio} is below {name('ratio')} ({self.ratio}); "
                    "the warm-up starts denser: set it above the ratio (e.g. 0.25)"]
        return []


@dataclass(frozen=True)
class CoordinatorConfig:
    """Failure detection by heartbeat and recovery (the original config's `system.heartbeat_*`
    keys)."""

    # Seconds between two heartbeats of every process.
    heartbeat_interval: float = field(default=1.0, metadata=POSITIVE)
    # Seconds without a heartbeat after which a process is declared failed.
    heartbeat_timeout: float = field(default=5.0, metadata=POSITIVE)
    # How often one process is restarted in a row after failures without progress before
    # the run stops (one that died after progress is restarted for free: coordinator.budget);
    # 0: no restarts.
    max_restarts: int = field(default=3, metadata=NON_NEGATIVE)
    # A node whose step time exceeds the median of its role by this factor is a straggler.
    straggler_factor: float = field(default=2.0, metadata=_rule(lambda v: v > 1, "must be > 1"))
    # Seconds a parameter-server worker declared failed may stay away before its blocks of
    # the epoch not yet applied go to the other workers (it takes back what is left if it
    # rejoins); null: never, its blocks wait for it. Several heartbeat timeouts by default,
    # so a restart (seconds) finds its own blocks still waiting.
    reassign_after: float | None = field(default=30.0, metadata=_rule(
        lambda v: v is None or v > 0, "must be > 0 seconds, or null (never reassign)"))
    # Nodes the coordinator holds at most (every id ever registered counts until it is
    # forgotten); past it the oldest ended nodes are forgotten, and a new id is refused
    # when all are alive. Bounds its memory, its registry and its answers (at most 4096:
    # every membership answer stays under the clients' 4 MB receive limit).
    max_nodes: int = field(default=1024, metadata=_rule(lambda v: 1 <= v <= 4096, "must be in [1, 4096]"))
    # HOST:PORT of a running coordinator (`disttrain coordinator`); empty: `disttrain ps`
    # starts its own, and `ps-server` / `ps-worker` run without one.
    address: str = ""

    def cross_problems(self, name: Callable[[str], str]) -> list[str]:
        """Problems between keys; `name(key)` is the key as the user spelled it."""
        problems = []
        if self.heartbeat_timeout <= self.heartbeat_interval:
            problems.append(f"{name('heartbeat_timeout')}: {self.heartbeat_timeout} must be greater "
                            f"than {name('heartbeat_interval')} ({self.heartbeat_interval})")
        return problems + _address_problems(name("address"), self.address, "node0.example.com:50050")


@dataclass(frozen=True)
class DDPConfig:
    """Knobs of the DDP strategy only."""

    backend: str = field(default="auto", metadata=_choice(BACKENDS))
    bucket_cap_mb: float = field(default=25.0, metadata=POSITIVE)
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    # A model whose step may leave a trainable parameter without a gradient (a branch the
    # forward skips): DDP then looks for them in the autograd graph at each step. Off
    # unless needed; the launcher's first-step check names the parameters that need it.
    find_unused_parameters: bool = False
    grad_accumulation_steps: int = field(default=1, metadata=POSITIVE)
    lr_scaling: str = field(default="none", metadata=_choice(LR_SCALINGS))
    max_restarts: int = field(default=0, metadata=NON_NEGATIVE)
    timeout_s: float = field(default=300.0, metadata=POSITIVE)
    rdzv_endpoint: str = ""
    num_nodes: int = field(default=1, metadata=POSITIVE)
    rdzv_id: str = ""
    # What a rank's death does: `restart` stops every rank and torch's elastic agent starts
    # the group again from the newest checkpoint; `live` keeps the survivors training in a
    # group re-formed among themselves, and the restarted rank joins them at a step boundary
    # (see strategies/ddp/live).
    recovery: str = field(default="restart", metadata=_choice(DDP_RECOVERIES))
    # An elastic live run (`--world-size MIN:MAX`): system.num_workers is MIN (the ranks
    # started, the fewest it trains with, and the scale of the global batch); ranks started
    # by hand (`join`) take places up to this. 0: the run's size is fixed.
    max_world_size: int = field(default=0, metadata=NON_NEGATIVE)
    # This launcher adds one rank to the running elastic run whose store is at rdzv_endpoint.
    join: bool = False
    # Hot spares (live recovery): ranks started beside the group that start up and wait,
    # outside it; one steps in at a step boundary when a member dies or leaves and the
    # group is below its maximum. Each costs a process with the model and data in memory.
    # The run's launcher starts them; an arrival (`join`) sharing the run's config starts none.
    spares: int = field(default=0, metadata=NON_NEGATIVE)

    def cross_problems(self, name: Callable[[str], str]) -> list[str]:
        problems = _address_problems(name("rdzv_endpoint"), self.rdzv_endpoint, "node0.example.com:29400")
        if self.num_nodes > 1 and not self.rdzv_endpoint:
            problems.append(f"{name('rdzv_endpoint')}: ddp.num_nodes is {self.num_nodes}, so every "
                            "node needs the HOST:PORT of the rendezvous (pass --rdzv-endpoint)")
        if self.max_world_size and self.recovery != "live":
            problems.append(f"{name('max_world_size')}: a run that grows and shrinks (--world-size MIN:MAX) "
                            "needs ddp.recovery: live (pass --ddp-recovery live)")
        if self.join and not (self.max_world_size and self.rdzv_endpoint):
            problems.append(f"{name('join')}: joining a running run needs its range and its store: pass "
                            "--world-size MIN:MAX and --rdzv-endpoint HOST:PORT as its launcher logged them")
        if self.spares and self.recovery != "live":
            problems.append(f"{name('spares')}: hot spares step into a live group; they need ddp.recovery: "
                            "live (pass --ddp-recovery live)")
        if self.spares and self.num_nodes > 1:
            problems.append(f"{name('spares')}: hot spares of a run of several nodes (ddp.num_nodes "
                            f"{self.num_nodes}) are not offered yet; leave --spares out")
        return problems


@dataclass(frozen=True)
class Config:
    """The whole run config, read-only once built. A component receives its own section."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys changed, e.g. `replace(system={"log_dir": "x"})`."""
        changed = {name: dataclasses.replace(getattr(self, name), **values)
                   for name, values in sections.items()}
        return dataclasses.replace(self, **changed)

    def run_by(self, strategy: str) -> Config:
        """This config as a run of `strategy` (baseline, ps or ddp) records it: its
        `system.architecture` names that strategy, so the run folder's config.yaml runs
        the same strategy again under `disttrain train`."""
        architecture = next(a for a, s in STRATEGY_OF_ARCHITECTURE.items() if s == strategy)
        return self.replace(system={"architecture": architecture})

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML (the run folder keeps what actually ran)."""
        write_config(self.to_dict(), path)

    def cross_problems(self, name: Callable[[str], str]) -> list[str]:
        """Problems between sections; `name("section.key")` is the key as the user spelled it."""
        if self.system.balance_batches and self.system.balance == "none":
            return [f"{name('system.balance_batches')}: a fixed plan needs system.balance: proportional "
                    "(or auto)"]
        if self.ddp.max_world_size and self.ddp.max_world_size < self.system.num_workers:
            return [f"{name('ddp.max_world_size')}: {self.ddp.max_world_size} is less than "
                    f"system.num_workers ({self.system.num_workers}), the run's minimum; give "
                    "--world-size MIN:MAX with MIN <= MAX"]
        if self.ps.max_workers and self.ps.max_workers < self.system.num_workers:
            return [f"{name('ps.max_workers')}: {self.ps.max_workers} is less than system.num_workers "
                    f"({self.system.num_workers}), the run's minimum; give --workers MIN:MAX with MIN <= MAX"]
        if self.ps.backup_workers >= self.system.num_workers:
            return [f"{name('ps.backup_workers')}: {self.ps.backup_workers} must be less than "
                    f"system.num_workers ({self.system.num_workers})"]
        c, t = self.compression, self.training
        if c.enabled and t.local_update_mode and t.outer_compression != "none":
            return [f"{name('training.outer_compression')}: {t.outer_compression} compresses the "
                    f"pseudo-gradients, and so would compression.type {c.type}; set one of them "
                    "(training.outer_compression: none, or compression.enabled: false)"]
        if c.enabled and t.local_update_mode and t.outer_delay:
            # A hook may chain collectives in its callbacks, which would meet the next step's
            # collectives in another order on each rank.
            return [f"{name('training.outer_delay')}: {t.outer_delay} overlaps a plain all-reduce or "
                    f"training.outer_compression's, not compression.type {c.type}; set "
                    "compression.enabled: false (training.outer_compression: fp16 or int8 compresses "
                    "pseudo-gradients), or training.outer_delay: 0"]
        if c.enabled and c.type == "topk" and c.momentum_correction and (t.optimizer != "sgd" or t.momentum):
            return [f"{name('compression.momentum_correction')}: the workers already apply momentum "
                    f"({c.momentum_correction}); the optimizer must not apply it again: set "
                    f"training.optimizer: sgd and training.momentum: 0 (now {t.optimizer}"
                    f"{f', momentum {t.momentum:g}' if t.optimizer == 'sgd' else ''})"]
        return []


def write_config(values: Mapping[str, Any], path: str | Path) -> None:
    """Write a resolved config (a `Config.to_dict()`) as YAML at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(values), sort_keys=False))


SECTIONS: dict[str, type] = {f.name: f.type if isinstance(f.type, type) else globals()[f.type]
                             for f in dataclasses.fields(Config)}
