"""The `disttrain` command line: the only module that knows every strategy, parses flags,
reads the environment or prints. Only the Python API (`disttrain.api`) imports it.

Building the parser imports every command's module, so those modules import torch and
the strategies inside `run` and `check`, never at the top: `--help` and `disttrain
completion` answer without loading torch.

Exit codes: 0 done, 2 bad usage or config, 1 failure while running.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from disttrain import __version__
from disttrain.cli.check import dry_run, wants_check
from disttrain.core import forking
from disttrain.core.errors import DisttrainError, error_lines
from disttrain.core.logs import setup_logging
from disttrain.core.processes import bind_to_parent, report_error
from disttrain.metrics.summary import RunSummary

# The face tools/ may use (the reference pages are generated from the parsers).
__all__ = ["COMMANDS", "build_parser", "main"]

DESCRIPTION = ("Train one PyTorch model several ways from one config (a single process, a "
               "parameter server over gRPC, DDP all-reduce) and measure what each costs.")

# name -> module; each defines HELP, DESCRIPTION, add_arguments(parser) and run(args), and
# check(args) when it offers --check-config. `run` may return a summary to print, or an exit
# code; a module with PASSES_FLAGS_ON = True gets the flags it does not know in
# `args.passed_on` instead of a usage error.
COMMANDS: dict[str, str] = {
    "train": "disttrain.cli.train",
    "baseline": "disttrain.cli.baseline",
    "ps": "disttrain.cli.ps",
    "ps-server": "disttrain.cli.ps_server",
    "ps-worker": "disttrain.cli.ps_worker",
    "ddp": "disttrain.cli.ddp",
    "evaluate": "disttrain.cli.evaluate",
    "coordinator": "disttrain.cli.coordinator",
    "status": "disttrain.cli.status",
    "compare": "disttrain.cli.compare",
    "validate": "disttrain.cli.validate",
    "report": "disttrain.cli.report",
    "configs": "disttrain.cli.configs",
    "advise": "disttrain.cli.advise",
    "chaos": "disttrain.cli.chaos",
    "token": "disttrain.cli.token",
    "tls": "disttrain.cli.tls",
    "completion": "disttrain.cli.completion",
}

# What the processes a launcher starts (each a `python -m disttrain COMMAND`: a worker, a
# shard, a rank, the coordinator, a run of `compare`) import beyond torch: their fork
# server imports it once (`forking.preload`), instead of every child on its own (about half
# a second of CPU a worker). None of it starts a thread at its import; what it reads from the
# environment there is a start-up variable or read again in each child (see `preload`).
CHILD_MODULES = (*COMMANDS.values(), "disttrain.strategies.baseline", "disttrain.strategies.ps.run.worker",
                 "disttrain.strategies.ps.run.server", "disttrain.strategies.ddp.rank",
                 "disttrain.strategies.ddp.live", "torch.utils.tensorboard")
forking.preload(*CHILD_MODULES)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; each option's default after its help, where it has one
    worth showing (config flags show the config key's own default instead: theirs is None,
    so that an absent flag never overrides the config file)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS)
                and "default" not in text):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disttrain", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"disttrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=module.HELP, description=module.DESCRIPTION,
                                    epilog=getattr(module, "EPILOG", None),
                                    formatter_class=HelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(command_module=module)
    return parser


def write_artifacts(summary: RunSummary, folder: str) -> str:
    """Write the run's artifacts into `folder` (`--artifacts-dir`); the line to print.

    Raises:
        DisttrainError: the folder cannot be written, or a process's metrics cannot be read.
    """
    from disttrain.report.artifacts import write_run_artifacts
    try:
        written = write_run_artifacts(summary.to_dict(), folder)
    except OSError as e:
        raise DisttrainError(f"--artifacts-dir {folder}: cannot write the artifacts "
                             f"({e.strerror or e})") from e
    return f"Artifacts: {', '.join(path.name for path in written)} in {folder}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args.command_module, "PASSES_FLAGS_ON", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.passed_on = unknown
    bind_to_parent()  # started by a launcher (`compare`, `ps`): die with it, however it dies
    setup_logging(args.command, level=logging.DEBUG if args.verbose else logging.INFO)
    try:
        if wants_check(args):
            print(dry_run(args))
            return 0
        result = args.command_module.run(args)
        if isinstance(result, int):
            return result
        if isinstance(result, RunSummary):
            if getattr(args, "summary_json", None):
                result.write(args.summary_json)
            print("\n".join(result.lines()))
            if getattr(args, "artifacts_dir", None):
                print(write_artifacts(result, args.artifacts_dir))
    except DisttrainError as e:
        report_error(e)  # a launcher's supervisor: a user's error is not restarted
        for line in error_lines(e):
            print(f"error: {line}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        report_error(e)
        raise
    return 0
