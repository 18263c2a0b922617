"""Flags shared by the training commands, each mapped to one config key, and the run
options every strategy takes.

Precedence, lowest first: defaults < `--config` file < flags < `--set section.key=value`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from itertools import chain
from typing import Any

from disttrain.cli.check import add_check_flag
from disttrain.cli.config_warnings import warn_about_run_config
from disttrain.config import Config, load_config
from disttrain.core.auth import TOKEN_ENV, resolve_token
from disttrain.core.errors import ConfigError
from disttrain.core.fault_spec import RunShape, check_faults
from disttrain.core.faults import Fault, arm_fault_points, load_fault_plan, parse_fault
from disttrain.core.process_spec import FLAGS
from disttrain.core.rpc_server import INSECURE_FLAG, require_credentials
from disttrain.core.tls import TlsFiles
from disttrain.training.options import RunOptions

CONFIG_PREFIX = "config:"
_DEFAULTS = Config()
CONFIG_HELP = ("YAML or JSON config file, or the name of a shipped config (`disttrain configs` "
               "lists them), e.g. example")

# flag -> (config key, type, help)
COMMON_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--dataset": ("training.dataset", str, "mnist, fashion_mnist, cifar10, digits, synthetic, "
                  "synthetic:CxHxW, synthetic:text, text:FILE, image-folder:DIR, torchvision:NAME "
                  "(CIFAR10, CIFAR100, MNIST, FashionMNIST, KMNIST, SVHN; pip install "
                  "'disttrain[vision]'), PATH.py:FACTORY, module:FACTORY or an entry point of "
                  "disttrain.datasets"),
    "--data-dir": ("training.data_dir", str, "folder holding <dataset>/ files, or torchvision's layout "
                   "for torchvision:NAME (downloaded if absent)"),
    "--num-epochs": ("training.num_epochs", int, "epochs to train"),
    "--batch-size": ("training.batch_size", int, "samples per step, per worker or rank"),
    "--learning-rate": ("training.learning_rate", float, "learning rate"),
    "--optimizer": ("training.optimizer", str, "sgd, adam or adamw"),
    # Training features: schedule, weight decay, clipping (the same in every strategy).
    "--weight-decay": ("training.weight_decay", float, "weight decay of weights of 2+ dimensions "
                       "(biases and normalisation weights never decay)"),
    "--lr-schedule": ("training.lr_schedule", str, "constant, step, cosine or linear (by step, after "
                      "--warmup-steps)"),
    "--warmup-steps": ("training.warmup_steps", int, "steps of linear learning-rate warm-up"),
    "--lr-decay-steps": ("training.lr_decay_steps", int, "cosine/linear: the step the rate reaches "
                         "--lr-min at"),
    "--lr-min": ("training.lr_min", float, "cosine/linear: the rate's floor"),
    "--precision": ("training.precision", str, "mixed precision: bf16 (autocast, CPU or CUDA), fp16 "
                    "(CUDA, loss scaling; not under the parameter server) or none"),
    "--loader-workers": ("training.loader_workers", int, "processes loading training batches ahead "
                         "(0: the training process loads them)"),
    "--clip-grad-norm": ("training.clip_grad_norm", float, "clip the applied gradient to this global "
                         "L2 norm (0: off)"),
    "--seed": ("training.seed", int, "seed of model init and data order"),
    "--model": ("training.model_architecture", str, "simplecnn, mlp, resnet18, gpt_small, "
                "torchvision:NAME, PATH.py:FACTORY, module:FACTORY or an entry point of "
                "disttrain.models (its keyword arguments: --set training.model_args={...})"),
    "--seq-len": ("training.seq_len", int, "tokens per sample of text:FILE and synthetic:text"),
    "--max-train-samples": ("training.max_train_samples", int, "train on a fixed subset"),
    "--max-test-samples": ("training.max_test_samples", int, "evaluate on a fixed subset"),
    "--num-samples": ("training.num_samples", int, "size of a synthetic data set"),
    FLAGS.checkpoint_dir: ("system.checkpoint_dir", str, "where checkpoints go"),
    FLAGS.log_dir: ("system.log_dir", str, "where metrics, TensorBoard events, summary go"),
    "--checkpoint-interval": ("training.checkpoint_interval", int, "checkpoint every N steps"),
    "--num-threads": ("system.num_threads", int, "torch threads per process (0 = auto)"),
    "--preemption-grace": ("system.preemption_grace_s", float, "seconds a run preempted by SIGTERM "
                           "has to stop at a step its processes agree on, with that step's checkpoint, "
                           "before they are killed"),
}


def balance_flags(who: str) -> dict[str, tuple[str, Any, str]]:
    """The flags of work in proportion to speed, `who` naming a process ("rank", "worker")."""
    return {
        "--balance": ("system.balance", str, f"none (equal batches), proportional (each {who}'s batch "
                      "in proportion to its measured speed, the global batch unchanged) or auto "
                      f"(proportional once {who}s differ by more than --balance-margin)"),
        "--balance-margin": ("system.balance_margin", float, f"auto: the slowest {who}'s speed below "
                             "(1 - margin) of the fastest's turns proportional batches on"),
        "--balance-interval": ("system.balance_interval", int, f"steps between checks of each {who}'s "
                               "speed, re-planning the batches when one drifts (0: plan once, at "
                               "the start)"),
    }


# Gradient compression, on the parameter-server wire and in DDP's all-reduce.
COMPRESSION_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--compression-enabled": ("compression.enabled", bool, "compress gradients before they travel"),
    "--compression-type": ("compression.type", str, "quantization (int8), topk, fp16, bf16, or "
                           "powersgd (DDP only)"),
    "--compression-ratio": ("compression.ratio", float, "topk: share of each tensor's elements "
                            "sent, in (0, 1]"),
    "--no-error-feedback": ("compression.error_feedback", False, "do not carry what a compressed "
                            "gradient left out over to the next step"),
    "--stochastic-rounding": ("compression.stochastic_rounding", bool, "quantization: round "
                              "randomly, so the quantized gradient is unbiased"),
    "--powersgd-rank": ("compression.powersgd_rank", int, "powersgd: rank of each gradient "
                        "matrix's approximation"),
    # Pull compression (parameter server, sync mode).
    "--pull-compression": ("compression.pull", str, "parameter server, sync mode: the shards answer "
                           "with the compressed change of the parameters: none, topk, "
                           "quantization, fp16 or bf16"),
    "--pull-ratio": ("compression.pull_ratio", float, "topk pull compression: share of each "
                     "shard's elements a pulled change carries, in (0, 1]"),
    "--dense-pull-every": ("compression.pull_dense_every", int, "pull compression: send the "
                           "parameters dense every this many versions"),
}


# Local-update training (LocalSGD / DiLoCo): DDP and the parameter server (sync mode).
LOCAL_UPDATE_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--sync-every": ("training.sync_every", int, "local steps each worker takes between two "
                     "synchronisations (H); 1: average every step's gradient (local updates off)"),
    "--local-updates": ("training.local_updates", bool, "take the local-update path even at "
                        "--sync-every 1 (a check: with outer sgd at lr 1 it equals per-step averaging)"),
    "--outer-optimizer": ("training.outer_optimizer", str, "local updates: sgd, or nesterov (DiLoCo's, "
                          "e.g. --outer-lr 0.7 --outer-momentum 0.9), stepping on the averaged "
                          "pseudo-gradient"),
    "--outer-lr": ("training.outer_learning_rate", float, "local updates: the outer learning rate "
                   "(sgd at 1 without momentum averages the models)"),
    "--outer-momentum": ("training.outer_momentum", float, "local updates: the outer momentum, in [0, 1)"),
}


def add_config_flag(parser: argparse.ArgumentParser, flag: str, key: str, type_: Any,
                    help_: str, **kwargs: Any) -> None:
    """Add a flag whose value, when given, overrides config key `key` (section.key).

    A `type_` of `bool` makes a switch that sets the key true; `False`, one that sets it false.
    """
    if type_ is bool or type_ is False:
        parser.add_argument(flag, dest=CONFIG_PREFIX + key, action="store_const",
                            const=type_ is bool, default=None, help=f"{help_} [{key}]", **kwargs)
    else:
        kwargs.setdefault("metavar", flag.lstrip("-").upper().replace("-", "_"))
        parser.add_argument(flag, dest=CONFIG_PREFIX + key, type=type_, default=None,
                            help=f"{help_} [{key}{_default_of(key)}]", **kwargs)


def _default_of(key: str) -> str:
    """" = 64"-style: the key's built-in default, as help shows it (empty when it has none).
    The flag's own default stays None, so an absent flag never overrides the config file."""
    section, name = key.split(".")
    value = getattr(getattr(_DEFAULTS, section), name)
    return "" if value in (None, "") else f" = {value}"


def add_config_flags(parser: argparse.ArgumentParser, flags: dict[str, tuple[str, Any, str]]) -> None:
    for flag, (key, type_, help_) in flags.items():
        add_config_flag(parser, flag, key, type_, help_)


def add_common_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """The flags of every command that reads a config (`only` those of `COMMON_FLAGS`
    named, for a command that uses no more)."""
    parser.add_argument(FLAGS.config, help=CONFIG_HELP)
    add_config_flags(parser, {flag: spec for flag, spec in COMMON_FLAGS.items()
                              if only is None or flag in only})
    parser.add_argument(FLAGS.setting, action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config key (repeatable; wins over everything)")
    parser.add_argument(FLAGS.verbose, "--verbose", action="store_true", help="debug logging")


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of every command that trains."""
    add_check_flag(parser)
    parser.add_argument(FLAGS.resume, action="store_true",
                        help="continue from the newest checkpoint in the checkpoint dir")
    parser.add_argument(FLAGS.summary_json, metavar="PATH", help="also write summary.json here")
    parser.add_argument("--artifacts-dir", metavar="DIR",
                        help="also write the run's artifacts here, for `disttrain report`: "
                             "baseline.json; ps.json and worker_metrics.json; ddp.json and "
                             "ddp_rank_<R>.json")
    add_fault_flags(parser)
    add_attempt_flag(parser)


def add_token_flag(parser: argparse.ArgumentParser) -> None:
    """`--token-file PATH`: the run's shared token, read from a file (never a flag's value:
    any user of the machine can read a command line)."""
    parser.add_argument("--token-file", metavar="PATH", default=None,
                        help=f"file holding the run's shared token (private: chmod 600); every "
                             f"server refuses calls without it. Or set {TOKEN_ENV}. Without "
                             f"either, servers accept anyone who reaches their port")


def token_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str | None:
    """The token of a parsed command line: `--token-file`, else `env`'s (default: this
    process's environment) `DISTTRAIN_TOKEN`; None when neither is given.

    Raises:
        ConfigError: the file is unreadable, empty or readable by other users, or the
            token is malformed.
    """
    env = os.environ if env is None else env
    return resolve_token(args.token_file, env.get(TOKEN_ENV))


def add_insecure_flag(parser: argparse.ArgumentParser, action: str = "listen beyond this machine") -> None:
    """`--insecure`: allow `action` without the run's token or client certificates."""
    parser.add_argument(INSECURE_FLAG, action="store_true",
                        help=f"{action} without a token or client certificates (refused otherwise: "
                             f"anyone who reaches the port could call it); only on a network you trust")


def check_exposure(args: argparse.Namespace, address: str, flag: str, exposure: str,
                   options: RunOptions) -> None:
    """Refuse (ConfigError) an `address` other machines reach without the run's token or
    client certificates, unless `--insecure` was given (see `require_credentials`)."""
    require_credentials(address, flag, exposure, options.token is not None, options.tls,
                        getattr(args, "insecure", False))


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """`--tls-cert`, `--tls-key`, `--tls-ca`: TLS on every connection of the process (the
    same files are its identity as a server and as a client)."""
    group = parser.add_argument_group("TLS (every server and client of the run)")
    group.add_argument(FLAGS.tls_cert, metavar="FILE", default=None,
                       help="this process's certificate (PEM); with --tls-key, servers listen with TLS")
    group.add_argument(FLAGS.tls_key, metavar="FILE", default=None,
                       help="the private key of --tls-cert (PEM)")
    group.add_argument(FLAGS.tls_ca, metavar="FILE", default=None,
                       help="the CA (PEM) the peers' certificates must be signed by; servers then "
                            "also require client certificates (mutual TLS)")
    group.add_argument(FLAGS.tls_operator, dest="tls_operators", action="append", default=[], metavar="NAME",
                       help="a client certificate's common name that servers take as the operator's "
                            "although it names no role of the run (repeatable; without it such "
                            "certificates, and those of another run, are refused)")


def tls_from_args(args: argparse.Namespace) -> TlsFiles:
    """The TLS files of a parsed command line (empty when no `--tls-*` flag was given).

    Raises:
        ConfigError: a certificate without its key or the reverse, or a file that cannot be
            read or is not PEM (the flag and file are named).
    """
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca, tuple(args.tls_operators))
    tls.check()
    return tls


def add_attempt_flag(parser: argparse.ArgumentParser) -> None:
    """`--attempt N`: which restart of this process this is (set by a supervisor)."""
    parser.add_argument(FLAGS.attempt, type=int, default=0, help=argparse.SUPPRESS)


INJECT_HELP = (
    "inject a fault, for tests and drills (repeatable): ACTION:TARGET[:KEY=VALUE...]. "
    "kill:worker=1:step=30 - worker 1 SIGKILLs itself right after its step 30; "
    "stop:worker=0:step=10:for=5s - worker 0 hangs (SIGSTOP) after step 10 and goes on "
    "(SIGCONT) 5 s later; kill:server=0:step=40 - the server of shard 0 dies once its "
    "version reaches 40; kill:coordinator:step=20 - the coordinator dies once a node reports "
    "step 20; drop-rpc:worker=1:step=15 - the reply to worker 1's push of step 15 is lost, "
    "so it retries; slow:worker=1:factor=3 - worker 1 is a straggler, each step's work 3 times as "
    "long; slow-eval:worker=0:for=2s - each evaluation 2 s longer. Targets: worker=N, "
    "server=N, rank=N (DDP), coordinator; worker, server or rank alone: every one; the "
    "baseline's one process is worker=0. Durations: 5s, 500ms, 5. Add :attempt=A to fire on "
    "the A-th restart only (default 0: the first start; a restarted process does not fire)")


def add_fault_flags(parser: argparse.ArgumentParser) -> None:
    """`--inject SPEC` and `--fault-plan FILE`, both feeding the run's faults (the
    launchers hand each child its faults as `--inject=SPEC`)."""
    parser.add_argument(FLAGS.inject, dest="faults", action="append", default=[], type=_fault,
                        metavar="SPEC", help=INJECT_HELP)
    parser.add_argument("--fault-plan", dest="fault_plans", action="append", default=[],
                        type=_fault_plan, metavar="FILE",
                        help="YAML file of faults to inject (repeatable): a list under `faults:` "
                             "of --inject specs or mappings such as {action: kill, target: "
                             "worker, index: 1, step: 30}")


def faults_from_args(args: argparse.Namespace) -> tuple[Fault, ...]:
    """The faults of a parsed command line: `--inject` ones, then each `--fault-plan` file's.
    The process's fault points are armed for them (`arm_fault_points`)."""
    faults = (*args.faults, *chain.from_iterable(args.fault_plans))
    arm_fault_points(faults)
    return faults


def add_training_flags(parser: argparse.ArgumentParser,
                       flags: dict[str, tuple[str, Any, str]] | None = None) -> None:
    """Every flag of a command that trains: the common ones, the run's, and `flags`."""
    add_common_flags(parser)
    add_run_flags(parser)
    add_config_flags(parser, flags or {})


def _fault(text: str) -> Fault:
    try:
        return parse_fault(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _fault_plan(path: str) -> list[Fault]:
    try:
        return load_fault_plan(path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def config_from_args(args: argparse.Namespace) -> Config:
    """Resolve the config of a parsed command line, and set this process's retry window
    for a failing checkpoint store from it (`system.checkpoint_retry_s`).

    Raises:
        ConfigError: one line per problem (an unknown model among them).
    """
    from disttrain.core import store_retry
    from disttrain.training.models import check_model_name
    flags = {name[len(CONFIG_PREFIX):]: value for name, value in vars(args).items()
             if name.startswith(CONFIG_PREFIX) and value is not None}
    config = load_config(args.config, flags, args.set)
    check_model_name(config.training.model_architecture)
    store_retry.set_window(config.system.checkpoint_retry_s)
    return config


def options_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> RunOptions:
    """The run options of a parsed command line: `--inject` faults, then those of each
    `--fault-plan` file; the token (see `token_from_args`) of a command with `--token-file`;
    the TLS files (see `tls_from_args`) of a command with `--tls-*`.

    Raises:
        ConfigError: see `token_from_args` and `tls_from_args`.
    """
    faults = faults_from_args(args)
    token = token_from_args(args, env) if hasattr(args, "token_file") else None
    tls = tls_from_args(args) if hasattr(args, "tls_cert") else TlsFiles()
    return RunOptions(resume=args.resume, faults=faults, verbose=args.verbose,
                      attempt=getattr(args, "attempt", 0), token=token, tls=tls)


def prepare_run(args: argparse.Namespace, command: str, env: Mapping[str, str] | None = None
                ) -> tuple[Config, RunOptions]:
    """The config and options of a run of `command` (baseline, ps or ddp): resolved and
    checked, warned about (the keys the run ignores), and recording the strategy that runs.

    Raises:
        ConfigError: see `config_from_args`, `options_from_args` and `run_shape`; a fault
            the run would never reach.
        CheckpointError: see `run_shape`.
    """
    config = config_from_args(args)
    warn_about_run_config(config, command, env)
    options = options_from_args(args, env)
    if options.faults:
        try:
            check_faults(options.faults, run_shape(config, command, resume=options.resume))
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return config.run_by(command), options


def run_shape(config: Config, command: str, resume: bool = False) -> RunShape:
    """The processes and steps of a run of `command` (baseline, ps or ddp), to check its
    faults against (`check_faults`). Loads the training set to count its steps, taken with
    the batch the run will use (`resumed_batch_size` when resuming).

    Raises:
        ConfigError: the data set cannot be loaded, or the checkpoint resumed cannot be
            resized to this run's workers.
        CheckpointError: every checkpoint resumed from is damaged.
    """
    from disttrain.data.datasets import load_datasets
    system, training = config.system, config.training
    world = 1 if command == "baseline" else system.num_workers
    train, _ = load_datasets(training)
    batch_size = resumed_batch_size(config, command) if resume else training.batch_size
    steps = training.num_epochs * -(-(len(train) // world) // batch_size)
    if command == "baseline":
        return RunShape("the baseline run", {"worker": 1}, {"worker": steps}, restarted=())
    coordinator = 0 if config.coordinator.address else 1
    if command == "ps":
        workers = max(world, config.ps.max_workers)  # an elastic run's workers, up to its most
        return RunShape("this parameter-server run", {"worker": workers, "server": config.ps.num_servers,
                                                      "coordinator": coordinator},
                        {"worker": steps, "server": world * steps, "coordinator": world * steps})
    live = config.ddp.recovery == "live"
    return RunShape(f"this DDP run ({config.ddp.recovery} recovery)",
                    {"rank": world, "coordinator": coordinator if config.ddp.num_nodes == 1 else 0},
                    {"rank": steps, "coordinator": steps},
                    restarted=("rank",) if live or config.ddp.max_restarts else (), group_restart=not live)


def resumed_batch_size(config: Config, command: str) -> int:
    """The per-worker batch a resumed run of `command` takes: the one that keeps its
    checkpoint's global batch when that was written by another number of workers or
    ranks (the launchers resize it before any process starts), else the config's.

    Raises:
        ConfigError, CheckpointError: as the strategy's `resize.resumed_config`.
    """
    if command == "ps":
        from disttrain.strategies.ps.run.resize import resumed_batch_size as strategy_batch_size
    elif command == "ddp":
        from disttrain.strategies.ddp.resize import resumed_batch_size as strategy_batch_size
    else:
        return config.training.batch_size
    return strategy_batch_size(config)


def size_arg(text: str) -> int | tuple[int, int]:
    """`--workers` / `--world-size`: N, or MIN:MAX (an elastic run; see `split_size_range`)."""
    low, colon, high = text.partition(":")
    try:
        return (int(low), int(high)) if colon else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX (e.g. 4, or 2:4)") from None


def split_size_range(args: argparse.Namespace, flag: str, max_key: str) -> None:
    """A `size_arg` range as its keys: system.num_workers MIN, `max_key` (a config key) MAX.

    Raises:
        ConfigError: MIN < 1 or MIN > MAX.
    """
    size_key = CONFIG_PREFIX + "system.num_workers"
    value = getattr(args, size_key, None)
    if not isinstance(value, tuple):
        return
    low, high = value
    if low < 1 or low > high:
        raise ConfigError(f"{flag} {low}:{high}: MIN must be at least 1 and at most MAX (e.g. 2:4)")
    setattr(args, size_key, low)
    setattr(args, CONFIG_PREFIX + max_key, high)
