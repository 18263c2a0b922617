"""`disttrain tls`: make a run's certificate authority and certificates."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from disttrain.core.errors import ConfigError
from disttrain.core.identity import NODE_ROLES as ROLES
from disttrain.core.pki import DEFAULT_HOSTS, parse_node, write_run_pki

HELP = "make a run's CA, operator and node certificates (for --tls-cert/--tls-key/--tls-ca)"
DESCRIPTION = """Make a certificate authority for one run and the certificates it signs, as PEM
files in DIR: ca.pem (every process's --tls-ca), ca.key (the CA's key: keep it off the
nodes), server.pem/server.key (the operator's: keep it on the operator's machine), and for
each --node NAME[:ROLE] NAME.pem/NAME.key, whose subject names the node and its role, and
which names the run (--run-id). Every certificate is valid for the --host names and
addresses the servers are reached by; as a server's, only for its role's service (the
coordinator's: --node coordinator; shard S's: --node serverS). Private keys are written
with mode 600; nothing is overwritten.

    disttrain tls new certs --host node0 --node coordinator --node server0 --node worker0
    disttrain coordinator --bind 0.0.0.0:50050 --tls-cert certs/coordinator.pem \\
        --tls-key certs/coordinator.key --tls-ca certs/ca.pem"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    new = actions.add_parser("new", help="make a new CA and its certificates in DIR",
                             description="Make a new CA and its certificates in DIR (created if absent).")
    new.add_argument("folder", metavar="DIR", help="where the PEM files go")
    new.add_argument("--host", dest="hosts", action="append", default=[], metavar="NAME",
                     help=f"a host name or IP address the servers are reached by (repeatable; "
                          f"default: {', '.join(DEFAULT_HOSTS)})")
    new.add_argument("--node", dest="nodes", action="append", default=[], metavar="NAME[:ROLE]",
                     help=f"a certificate for node NAME (its node id, e.g. worker0) in ROLE (one of "
                          f"{', '.join(ROLES)}, operator; default: NAME without its digits) (repeatable)")
    new.add_argument("--days", type=int, default=365, help="how long the certificates are valid")
    new.add_argument("--run-id", default=None, metavar="ID",
                     help="the run the certificates name (letters, digits, '-'; default: a random one)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> None:
    if args.days < 1:
        raise ConfigError(f"--days {args.days}: must be at least 1")
    try:
        import cryptography  # noqa: F401
    except ImportError as e:
        raise ConfigError("disttrain tls new needs the cryptography package: pip install cryptography") from e
    nodes = [parse_node(text, ROLES) for text in args.nodes]
    written = write_run_pki(Path(args.folder), args.hosts or DEFAULT_HOSTS, nodes, args.days, args.run_id)
    for path in written:
        print(path)
    print(f"each process: --tls-cert {args.folder}/NODE.pem --tls-key {args.folder}/NODE.key "
          f"--tls-ca {args.folder}/ca.pem (its own node's); server.pem is the operator's; keep ca.key "
          f"off the nodes", file=sys.stderr)
