"""What a launcher tells a child process it starts: a typed `ProcessSpec`, and the one
function that turns it into a command line (`command_line`).

Launchers (the parameter server's, DDP's, the coordinator's, `compare`) describe each
child with a spec and never write flags themselves; the spellings of those flags live
here, in `FLAGS`, and the CLI builds its parsers from the same names, so a launcher and
the command it starts cannot drift apart (a test parses every kind of spec's command
line back with the real parser). The run's token never appears: it travels in the
child's environment (`core.auth.TOKEN_ENV`), which other users cannot read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from disttrain.core.faults import Fault, format_fault
from disttrain.core.tls import TlsFiles

CLI_ENTRY = "disttrain"  # `python -m disttrain COMMAND ...`: the `disttrain` command line
RANK_ENTRY = "disttrain.torchrun"  # `python -m disttrain.torchrun ...`: one DDP rank under torchrun


@dataclass(frozen=True)
class Flags:
    """The spelling of each field of a spec on a command line."""

    config: str = "--config"
    bind: str = "--bind"
    registry: str = "--registry"
    shard: str = "--shard"
    servers: str = "--servers"
    rank: str = "--rank"
    worker_id: str = "--worker-id"
    log_dir: str = "--log-dir"
    checkpoint_dir: str = "--checkpoint-dir"
    setting: str = "--set"
    inject: str = "--inject"
    resume: str = "--resume"
    attempt: str = "--attempt"
    verbose: str = "-v"
    tls_cert: str = "--tls-cert"
    tls_key: str = "--tls-key"
    tls_ca: str = "--tls-ca"
    tls_operator: str = "--tls-operator"
    summary_json: str = "--summary-json"
    quiet_summary: str = "--quiet-summary"
    handoff: str = "--spare-handoff"


FLAGS = Flags()


@dataclass(frozen=True)
class PassedOn:
    """What a launcher passes on to each child it starts, from its own command line: the
    faults to inject (each child keeps those meant for it), its TLS files, debug logging."""

    faults: tuple[Fault, ...] = ()
    tls: TlsFiles = TlsFiles()
    verbose: bool = False


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start.

    Args:
        command: the `disttrain` subcommand (`coordinator`, `ps-server`, `ps-worker`,
            `baseline`, `ps`, `ddp`); empty for `RANK_ENTRY`, which takes `ddp`'s flags.
        entry: the module `python -m` runs: `CLI_ENTRY` or `RANK_ENTRY`.
        config: the resolved config file the child reads.
        bind: HOST:PORT a server listens on (port 0: a free one, which it reports).
        registry: the coordinator's SQLite registry.
        shard: (index, number of shards) a `ps-server` holds.
        servers: every shard's HOST:PORT, in shard order (`ps-worker`).
        rank: the rank a `ps-worker` asks for.
        worker_id: a `ps-worker`'s name, the same across its restarts.
        log_dir, checkpoint_dir: the run's folders, when they differ from the config's.
        settings: config keys set on top of the file, as (section.key, value).
        faults: faults to inject, for tests and drills (each process keeps its own).
        resume: continue from the newest checkpoint.
        attempt: how often the process was restarted before (0: its first start).
        verbose: debug logging.
        tls: the process's TLS files (empty: plain TCP).
        summary_json: where rank 0 of DDP also writes the summary.
        quiet_summary: the rank does not print the summary (its launcher does).
        handoff: a `ps-worker` hot spare's hand-off file: it starts up, then waits to be
            told there which worker to become (`strategies.ps.run.spares`).
    """

    command: str
    entry: str = CLI_ENTRY
    config: Path | None = None
    bind: str | None = None
    registry: Path | None = None
    shard: tuple[int, int] | None = None
    servers: tuple[str, ...] = ()
    rank: int | None = None
    worker_id: str | None = None
    log_dir: Path | None = None
    checkpoint_dir: Path | None = None
    settings: tuple[tuple[str, str], ...] = ()
    faults: tuple[Fault, ...] = ()
    resume: bool = False
    attempt: int = 0
    verbose: bool = False
    tls: TlsFiles = TlsFiles()
    summary_json: Path | None = None
    quiet_summary: bool = False
    handoff: Path | None = None


def command_line(spec: ProcessSpec) -> list[str]:
    """The arguments after the Python interpreter that start `spec` (unbuffered, so the
    launcher reads its event lines as they come)."""
    return ["-u", "-m", spec.entry, *arguments(spec)]


def user_command(spec: ProcessSpec) -> list[str]:
    """`spec` as a user would type it (for records and logs): `disttrain COMMAND ...`."""
    program = ["disttrain"] if spec.entry == CLI_ENTRY else ["python", "-m", spec.entry]
    return [*program, *arguments(spec)]


def arguments(spec: ProcessSpec) -> list[str]:
    """The arguments after the entry module: the command, then its flags."""
    args = [spec.command] if spec.command else []
    paths = ((FLAGS.config, spec.config), (FLAGS.registry, spec.registry), (FLAGS.log_dir, spec.log_dir),
             (FLAGS.checkpoint_dir, spec.checkpoint_dir), (FLAGS.summary_json, spec.summary_json),
             (FLAGS.handoff, spec.handoff),
             # Absolute: paths are not secrets, and a child may start in another folder.
             (FLAGS.tls_cert, spec.tls.cert), (FLAGS.tls_key, spec.tls.key), (FLAGS.tls_ca, spec.tls.ca))
    for flag, path in paths:
        if path is not None:
            args += [flag, os.path.abspath(path)]
    values = ((FLAGS.bind, spec.bind), (FLAGS.worker_id, spec.worker_id),
              (FLAGS.shard, None if spec.shard is None else f"{spec.shard[0]}/{spec.shard[1]}"),
              (FLAGS.servers, ",".join(spec.servers) or None),
              (FLAGS.rank, None if spec.rank is None else str(spec.rank)),
              (FLAGS.attempt, str(spec.attempt) if spec.attempt else None))
    for flag, value in values:
        if value is not None:
            args += [flag, value]
    for key, value in spec.settings:
        args += [FLAGS.setting, f"{key}={value}"]
    args += [f"{FLAGS.inject}={format_fault(fault)}" for fault in spec.faults]
    for name in spec.tls.operators:
        args += [FLAGS.tls_operator, name]
    switches = ((FLAGS.resume, spec.resume), (FLAGS.verbose, spec.verbose),
                (FLAGS.quiet_summary, spec.quiet_summary))
    return args + [flag for flag, on in switches if on]
