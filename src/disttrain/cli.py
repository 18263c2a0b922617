"""The `disttrain` command: subcommands -> config -> run(). No training logic here.

Every training subcommand shares the same flags; each flag maps to one config key, and
precedence is defaults < `--config` file < flags < `--set section.key=value`.
Exit codes: 0 done, 2 bad usage or config, 1 failure while running.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any

from disttrain import __version__
from disttrain.config import Config, load_config
from disttrain.errors import DisttrainError
from disttrain.faults import parse_fault
from disttrain.logs import setup_logging
from disttrain.metrics import RunSummary

logger = logging.getLogger(__name__)

# name -> (module, one-line help). Each module defines add_arguments(parser) and main(args, config).
COMMANDS: dict[str, tuple[str, str]] = {
    "baseline": ("disttrain.baseline", "train in one process (the control group)"),
    "ddp": ("disttrain.ddp", "data-parallel ranks with ring all-reduce (torch.distributed)"),
    "evaluate": ("disttrain.evaluation", "test accuracy of a saved model file"),
    "ps": ("disttrain.ps.cluster", "parameter server: servers and workers on this machine"),
    "ps-server": ("disttrain.ps.server", "serve one parameter-server shard over gRPC"),
    "ps-worker": ("disttrain.ps.worker", "train as one parameter-server worker"),
}

CONFIG_PREFIX = "config:"

# flag -> (config key, type, help); shared by every training subcommand.
COMMON_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--dataset": ("training.dataset", str, "mnist, fashion_mnist, cifar10, digits or synthetic"),
    "--data-dir": ("training.data_dir", str, "folder holding <dataset>/ files (downloaded if absent)"),
    "--num-epochs": ("training.num_epochs", int, "epochs to train"),
    "--batch-size": ("training.batch_size", int, "samples per step, per worker or rank"),
    "--learning-rate": ("training.learning_rate", float, "learning rate"),
    "--optimizer": ("training.optimizer", str, "sgd or adam"),
    "--seed": ("training.seed", int, "seed of model init and data order"),
    "--model": ("training.model_architecture", str, "registered model: simplecnn or mlp"),
    "--max-train-samples": ("training.max_train_samples", int, "train on a fixed subset"),
    "--max-test-samples": ("training.max_test_samples", int, "evaluate on a fixed subset"),
    "--num-samples": ("training.num_samples", int, "size of the synthetic data set"),
    "--checkpoint-dir": ("system.checkpoint_dir", str, "where checkpoints go"),
    "--log-dir": ("system.log_dir", str, "where metrics, TensorBoard events, summary go"),
    "--checkpoint-interval": ("training.checkpoint_interval", int, "checkpoint every N steps"),
    "--num-threads": ("system.num_threads", int, "torch threads per process (0 = auto)"),
}


def add_config_flag(parser: argparse.ArgumentParser, flag: str, key: str, type_: Any,
                    help_: str, **kwargs: Any) -> None:
    """Add a flag whose value, when given, overrides config key `key` (section.key)."""
    if type_ is bool:
        parser.add_argument(flag, dest=CONFIG_PREFIX + key, action="store_const", const=True,
                            default=None, help=f"{help_} [{key}]", **kwargs)
    else:
        kwargs.setdefault("metavar", flag.lstrip("-").upper().replace("-", "_"))
        parser.add_argument(flag, dest=CONFIG_PREFIX + key, type=type_, default=None,
                            help=f"{help_} [{key}]", **kwargs)


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or JSON config file")
    for flag, (key, type_, help_) in COMMON_FLAGS.items():
        add_config_flag(parser, flag, key, type_, help_)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config key (repeatable; wins over everything)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in the checkpoint dir")
    parser.add_argument("--summary-json", metavar="PATH", help="also write summary.json here")
    parser.add_argument("--inject-fault", dest="faults", action="append", default=[],
                        type=_fault, help=argparse.SUPPRESS)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _fault(text: str):
    try:
        return parse_fault(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def config_from_args(args: argparse.Namespace) -> Config:
    """Resolve the config of a parsed command line (raises ConfigError)."""
    flags = {name[len(CONFIG_PREFIX):]: value for name, value in vars(args).items()
             if name.startswith(CONFIG_PREFIX) and value is not None}
    return load_config(args.config, flags, args.set)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disttrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"disttrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_) in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=help_, description=module.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        add_common_flags(sub)
        module.add_arguments(sub)
        sub.set_defaults(module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.command, level=logging.DEBUG if args.verbose else logging.INFO)
    try:
        config = config_from_args(args)
        result = args.module.main(args, config)
    except DisttrainError as e:
        for line in getattr(e, "problems", [str(e)]):
            print(f"error: {line}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if isinstance(result, RunSummary):
        print("\n".join(result.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
