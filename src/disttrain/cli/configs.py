"""`disttrain configs`."""

from __future__ import annotations

import argparse

from disttrain.config.shipped import shipped_configs, shipped_folder

HELP = "list the configs shipped with disttrain"
DESCRIPTION = """List the configs that come with disttrain, one line each: the name to give
--config, and what the config runs. A name given to --config that is not a file is looked
up here, so these run from any folder once disttrain is installed.

    disttrain configs
    disttrain baseline --config example --check-config
    disttrain ps --config ps_sync_mnist"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--paths", action="store_true", help="also print each config's file")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> None:
    configs = shipped_configs()
    width = max((len(config.name) for config in configs), default=0)
    for config in configs:
        print(f"{config.name:<{width}}  {config.description}"
              + (f"  ({config.path})" if args.paths else ""))
    print(f"\n{len(configs)} configs in {shipped_folder()}; run one with --config NAME, copy one "
          "to change it")
