"""`--check-config`: the dry run of every command that starts processes or training.

A command that offers it defines `check(args) -> str`: it parses and validates what the
real run parses and validates (the config with its flags and `--set` overrides, the
token file, the TLS files, addresses, the shard), through the same functions its `run`
uses, and returns what would run in a few words. `main` then prints
`<command>: <what would run>; config OK` and exits 0, or the real run's error and exit
code 2. The commands that train also run one real step of the model on the first batch
of the training set, in this process (`training.first_step`), as their runs do before
starting anything. Nothing is bound, started or written: checkpoint folders are not
looked at either, so a run that would resume or refuse them is not judged here.
"""

from __future__ import annotations

import argparse

from disttrain.config import Config, TrainingConfig
from disttrain.training.options import RunOptions

HELP = ("check the flags and the config as the run would (addresses, token and TLS files "
        "included) and run one step of the model on the first batch, print what would run and "
        "exit: 0 when all is well, 2 with the error otherwise. Binds no port, reads no "
        "checkpoint, starts nothing")


def add_check_flag(parser: argparse.ArgumentParser) -> None:
    """`--check-config` on a command that defines `check(args)`."""
    parser.add_argument("--check-config", action="store_true", help=HELP)


def wants_check(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "check_config", False))


def dry_run(args: argparse.Namespace) -> str:
    """The line `--check-config` prints for a parsed command line.

    Raises:
        DisttrainError: whatever the real run raises for the same flags before it starts
            (ConfigError, exit code 2, for bad flags, config, files or addresses).
    """
    return f"{args.command}: {args.command_module.check(args)}; config OK"


def count(number: int, noun: str) -> str:
    """E.g. "1 worker", "2 workers"."""
    return f"{number} {noun}" + ("" if number == 1 else "s")


def describe_training(config: Config) -> str:
    """E.g. "simplecnn on mnist, 2 epochs of batch 64 (adam, lr 0.001)", with the training
    features that are on: "(adamw, lr 0.001, weight decay 0.1, 100 warm-up steps, cosine
    to 1e-05 at step 1000, clipped at norm 1, bf16)"."""
    training = config.training
    return (f"{training.model_architecture} on {training.dataset}, {training.num_epochs} epochs of batch "
            f"{training.batch_size} ({', '.join(describe_optimizer(training))})")


def describe_optimizer(training: TrainingConfig) -> list[str]:
    """The optimizer, its rate and the training features that are on, one phrase each."""
    parts = [training.optimizer, f"lr {training.learning_rate:g}"]
    if training.weight_decay:
        parts.append(f"weight decay {training.weight_decay:g}")
    if training.warmup_steps:
        parts.append(f"{count(training.warmup_steps, 'warm-up step')}")
    if training.lr_schedule == "step":
        parts.append(f"x{training.lr_gamma:g} every {count(training.lr_step_size, 'step')}")
    elif training.lr_schedule != "constant":
        parts.append(f"{training.lr_schedule} to {training.lr_min:g} at step {training.lr_decay_steps}")
    if training.clip_grad_norm:
        parts.append(f"clipped at norm {training.clip_grad_norm:g}")
    if training.precision != "none":
        parts.append(training.precision)
    return parts


def describe_compression(config: Config) -> str:
    """", int8-quantized gradients"-style suffix; empty when compression is off."""
    compression = config.compression
    if not compression.enabled:
        return ""
    detail = f" {compression.ratio:g}" if compression.type == "topk" else ""
    return f", {compression.type}{detail} compression"


def describe_aggregation(config: Config) -> str:
    """E.g. "sync", "ssp (staleness 2)", "sync (1 backup worker)"."""
    ps = config.ps
    if ps.aggregation_mode == "ssp":
        return f"ssp (staleness {ps.staleness})"
    if ps.aggregation_mode == "sync" and ps.backup_workers:
        return f"sync ({ps.backup_workers} backup workers)"
    return ps.aggregation_mode


def describe_coordinator(config: Config, without: str = "without a coordinator") -> str:
    """Where the processes report; `without` when `coordinator.address` is not set."""
    address = config.coordinator.address
    return f"reporting to the coordinator at {address}" if address else without


def describe_folders(config: Config, options: RunOptions | None = None) -> str:
    """Where checkpoints and logs go, and whether the run resumes."""
    resume = ", resuming" if options is not None and options.resume else ""
    return f"checkpoints in {config.system.checkpoint_dir}, logs in {config.system.log_dir}{resume}"


def describe_security(options: RunOptions) -> str:
    """", token, TLS"-style suffix: how the run's connections are protected."""
    parts = (["token"] if options.token else []) + (["TLS"] if options.tls.enabled else [])
    return f", with {' and '.join(parts)}" if parts else ""
