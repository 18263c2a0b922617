"""`disttrain train`: run the strategy a config names in `system.architecture`."""

from __future__ import annotations

import argparse

from disttrain import cli
from disttrain.cli.flags import CONFIG_HELP
from disttrain.config import STRATEGY_OF_ARCHITECTURE, load_config

HELP = "run the strategy the config names (system.architecture), with that command's flags"
DESCRIPTION = """Run the strategy the config's system.architecture names: baseline runs
`disttrain baseline`, parameter_server `disttrain ps`, ddp `disttrain ddp`. Every other
flag is passed on, unchanged, to that command (its --help lists them), --check-config
among them; `--set system.architecture=...` chooses another strategy.

    disttrain train --config ps_sync_mnist
    disttrain train --config ddp_mnist --world-size 4 --num-epochs 1
    disttrain train --config my_run.yaml --set system.architecture=ddp --check-config"""

# main() hands every flag this parser does not know to `run` as `args.passed_on`.
PASSES_FLAGS_ON = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "disttrain train --config FILE [--set SECTION.KEY=VALUE] [-v] [FLAGS OF THAT COMMAND...]"
    parser.add_argument("--config", required=True, help=f"{CONFIG_HELP}; its system.architecture "
                        "names the command that runs")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config key (repeatable), system.architecture among them; "
                             "passed on with the rest")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (passed on)")


def command_line(args: argparse.Namespace) -> list[str]:
    """The `disttrain` arguments of the strategy the resolved config names.

    Raises:
        ConfigError: the config file or a `--set` is bad (the strategy's own flags are
            checked by its command).
    """
    architecture = load_config(args.config, {}, args.set).system.architecture
    sets = [part for expression in args.set for part in ("--set", expression)]
    return [STRATEGY_OF_ARCHITECTURE[architecture], "--config", args.config, *sets,
            *(["--verbose"] if args.verbose else []), *args.passed_on]


def run(args: argparse.Namespace) -> int:
    """Run the named strategy's command in this process; its exit code."""
    return cli.main(command_line(args))
