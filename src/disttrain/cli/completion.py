"""`disttrain completion`."""

from __future__ import annotations

import argparse

HELP = "print a shell completion script for disttrain (bash, zsh or tcsh)"
DESCRIPTION = """Print a tab-completion script for disttrain's commands and flags. The script is
static: pressing tab runs no Python, so completion is instant. Install it once:

    disttrain completion bash > ~/.local/share/bash-completion/completions/disttrain
    disttrain completion zsh > "${fpath[1]}/_disttrain"
    eval "$(disttrain completion bash)"   # this shell only

Print it again after upgrading disttrain, to pick up new commands and flags."""

SHELLS = ("bash", "zsh", "tcsh")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> None:
    import shtab

    from disttrain import cli

    print(shtab.complete(cli.build_parser(), shell=args.shell))
