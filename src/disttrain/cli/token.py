"""`disttrain token`: make a run's secret."""

from __future__ import annotations

import argparse
import sys

from disttrain.core.auth import TOKEN_ENV, new_token, write_token_file

HELP = "make a fresh secret for a run (the token every server of it requires)"
DESCRIPTION = f"""Make a fresh random secret (256 bits) for one run. Every server of the run
(coordinator, parameter-server shards) then refuses calls that do not carry it. Give it
to every process with --token-file FILE, or in the {TOKEN_ENV} environment variable;
never on a command line, which any user of the machine can read.

    disttrain token new run.token           # written with mode 600, never over a file
    disttrain token new > run.token && chmod 600 run.token
    disttrain coordinator --bind 0.0.0.0:50050 --token-file run.token"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    new = actions.add_parser("new", help="make a new secret: into FILE (mode 600), else to stdout",
                             description="Make a new secret: into FILE (created with mode 600; an "
                                         "existing file is left alone), else printed.")
    new.add_argument("file", nargs="?", metavar="FILE", help="the file to create (default: print it)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> None:
    token = new_token()
    if args.file is None:
        print(token)
        return
    path = write_token_file(args.file, token)
    print(f"wrote a new run secret to {path} (mode 600); give it to every process of the run with "
          f"--token-file {path} or {TOKEN_ENV}", file=sys.stderr)
