"""`disttrain token`: make a run's secret, and the token of one node of the run."""

from __future__ import annotations

import argparse
import sys

from disttrain.cli.flags import add_token_flag, token_from_args
from disttrain.core.auth import TOKEN_ENV, new_token, write_token_file
from disttrain.core.errors import ConfigError
from disttrain.core.identity import node_token
from disttrain.core.pki import parse_node

HELP = "make a run's secret, or one node's token made from it"
DESCRIPTION = f"""Make a fresh random secret (256 bits) for one run. Every server of the run
(coordinator, parameter-server shards) then refuses calls that carry neither it nor a
node token made from it. Give it with --token-file FILE, or in the {TOKEN_ENV}
environment variable; never on a command line, which any user of the machine can read.

A holder of the secret may act for any node (the operator: launchers, servers, the
coordinator, `disttrain status`). A node token lets its holder act only as that node:
give each worker of a run across machines its own, and keep the secret on the servers'
machine.

    disttrain token new run.token           # written with mode 600, never over a file
    disttrain token new > run.token && chmod 600 run.token
    disttrain token node worker1 --token-file run.token -o worker1.token
    disttrain coordinator --bind 0.0.0.0:50050 --token-file run.token
    disttrain ps-worker ... --worker-id worker1 --token-file worker1.token"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    new = actions.add_parser("new", help="make a new secret: into FILE (mode 600), else to stdout",
                             description="Make a new secret: into FILE (created with mode 600; an "
                                         "existing file is left alone), else printed.")
    new.add_argument("file", nargs="?", metavar="FILE", help="the file to create (default: print it)")
    node = actions.add_parser("node", help="the token of node NAME, made from the run's secret",
                              description="The token of node NAME[:ROLE] (its node id, e.g. worker1, "
                                          "and role, by default NAME without its digits), made from "
                                          f"the secret of --token-file or {TOKEN_ENV}: into FILE "
                                          "(--output, mode 600), else printed.")
    node.add_argument("node", metavar="NAME[:ROLE]", help="the node id, e.g. worker1 or host-a:worker")
    node.add_argument("-o", "--output", dest="file", metavar="FILE",
                      help="the file to create (default: print it)")
    add_token_flag(node)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> None:
    if args.action == "new":
        token = new_token()
    else:
        secret = token_from_args(args)
        if secret is None:
            raise ConfigError(f"disttrain token node: give the run's secret with --token-file FILE or "
                              f"{TOKEN_ENV}")
        name = parse_node(args.node)
        if name.role == "operator":
            raise ConfigError(f"{args.node}: an operator holds the secret itself, not a node token")
        token = node_token(secret, name.node_id, name.role)
    if args.file is None:
        print(token)
        return
    path = write_token_file(args.file, token)
    print(f"wrote {'a new run secret' if args.action == 'new' else f'the token of {args.node}'} to {path} "
          f"(mode 600); give it with --token-file {path} or {TOKEN_ENV}", file=sys.stderr)
