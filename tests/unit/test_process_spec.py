"""A launcher's process spec and the command it starts agree: every kind of child a
launcher starts (a coordinator, a shard server, a worker, a DDP rank under torchrun, a run
of `compare`) is turned into a command line and parsed back with the CLI's real parser
into the same spec. A flag spelled one way by a launcher and another by the CLI fails here.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain import cli
from disttrain.cli.ddp import rank_parser
from disttrain.cli.flags import CONFIG_PREFIX
from disttrain.cli.ps_server import parse_shard
from disttrain.comparison.plan import parse_strategies
from disttrain.coordinator.launch import coordinator_spec
from disttrain.core.faults import parse_fault
from disttrain.core.process_spec import (
    CLI_ENTRY,
    RANK_ENTRY,
    PassedOn,
    ProcessSpec,
    arguments,
    command_line,
    user_command,
)
from disttrain.core.tls import TlsFiles
from disttrain.strategies.ddp.launcher import rank_spec
from disttrain.training.options import RunOptions

FAULTS = [parse_fault(text) for text in (
    "kill:worker=1:step=30", "stop:worker=0:step=10:for=5s", "kill:server=0:step=40",
    "kill:coordinator:step=20",
    "drop-rpc:worker=1:step=15", "slow:worker=1:factor=3:step=100:until=300", "slow-eval:rank=0:for=2s",
    "kill:rank:step=3:attempt=2")]
paths = st.sampled_from([Path("/runs/a/config.yaml"), Path("/tmp/x y/c.yaml")])
tls_files = st.sampled_from([TlsFiles(), TlsFiles("/pki/node.pem", "/pki/node.key", "/pki/ca.pem"),
                             TlsFiles(ca="/pki/ca.pem"),
                             TlsFiles("/pki/node.pem", "/pki/node.key", "/pki/ca.pem", ("ops", "host-a"))])
common = {"config": paths, "faults": st.lists(st.sampled_from(FAULTS), max_size=3).map(tuple),
          "attempt": st.integers(0, 5), "verbose": st.booleans(), "tls": tls_files}
binds = st.sampled_from(["127.0.0.1:0", "0.0.0.0:50051", "[::1]:7000"])


def spec_of(entry: str, args: argparse.Namespace) -> ProcessSpec:
    """What a parsed command line says, as a spec (the fields its command has)."""
    has = vars(args)
    sets = tuple(tuple(text.split("=", 1)) for text in has.get("set", []))
    return ProcessSpec(
        args.command if entry == CLI_ENTRY else "", entry=entry,
        config=Path(args.config) if has.get("config") else None, bind=has.get("bind"),
        registry=Path(args.registry) if has.get("registry") else None,
        shard=parse_shard(args.shard) if "shard" in has else None,
        servers=tuple(args.servers.split(",")) if has.get("servers") else (),
        rank=args.rank if "rank" in has and args.rank != -1 else None, worker_id=has.get("worker_id"),
        log_dir=_path(has.get(f"{CONFIG_PREFIX}system.log_dir")),
        checkpoint_dir=_path(has.get(f"{CONFIG_PREFIX}system.checkpoint_dir")),
        settings=sets, faults=tuple(has.get("faults", ())), resume=has.get("resume", False),
        attempt=has.get("attempt", 0), verbose=args.verbose,
        tls=TlsFiles(has.get("tls_cert"), has.get("tls_key"), has.get("tls_ca"),
                     tuple(has.get("tls_operators", ()))),
        summary_json=_path(has.get("summary_json")), quiet_summary=has.get("quiet_summary", False),
        handoff=_path(has.get("spare_handoff")))


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


@functools.cache
def parser_of(entry: str) -> argparse.ArgumentParser:
    """The entry's real parser, built once for the module (a tenth of a second each, and the
    properties below parse a hundred and fifty command lines)."""
    return cli.build_parser() if entry == CLI_ENTRY else rank_parser()


def parsed(spec: ProcessSpec) -> ProcessSpec:
    namespace = parser_of(spec.entry).parse_args(arguments(spec))
    return spec_of(spec.entry, namespace)


@settings(max_examples=40, deadline=None)
@given(st.builds(coordinator_spec, paths, st.sampled_from([Path("/runs/cluster.db")]), binds,
                 common["attempt"], st.builds(PassedOn, common["faults"], common["tls"], common["verbose"])))
def test_a_coordinator_spec_parses_back(spec):
    assert parsed(spec) == spec


@settings(max_examples=40, deadline=None)
@given(st.builds(ProcessSpec, st.just("ps-server"), bind=binds, resume=st.booleans(),
                 shard=st.integers(1, 4).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n))),
                 **common))
def test_a_shard_server_spec_parses_back(spec):
    assert parsed(spec) == spec


@settings(max_examples=40, deadline=None)
@given(st.builds(ProcessSpec, st.just("ps-worker"), resume=st.booleans(),
                 servers=st.lists(binds, min_size=1, max_size=3).map(tuple),
                 rank=st.none() | st.integers(0, 7), worker_id=st.none() | st.just("worker1"),
                 handoff=st.none() | st.just(Path("/runs/logs/spare0.handoff.json")), **common))
def test_a_worker_spec_parses_back(spec):
    assert parsed(spec) == spec


@settings(max_examples=30, deadline=None)
@given(st.builds(RunOptions, resume=st.booleans(), verbose=st.booleans(), tls=tls_files,
                 faults=st.lists(st.sampled_from(FAULTS), max_size=3).map(tuple)), paths)
def test_a_rank_spec_parses_back_with_the_torchrun_entry(options, config_path):
    spec = rank_spec(config_path, Path("/tmp/summary.json"), options)
    assert command_line(spec)[:3] == ["-u", "-m", RANK_ENTRY]
    assert parsed(spec) == spec
    assert (spec.faults, spec.resume, spec.tls) == (options.faults, options.resume, options.tls)


def test_every_run_of_a_comparison_parses_back(tmp_path):
    for run in parse_strategies("baseline,ps-sync,ps-ssp+fp16,ps-async+topk,ddp+powersgd", 3):
        spec = run.spec(tmp_path / "config.yaml", tmp_path / run.name)
        assert parsed(spec) == spec
        assert user_command(spec)[:2] == ["disttrain", run.subcommand]


def test_no_token_is_ever_on_a_command_line():
    # The token travels in the environment: a spec has no field for it.
    assert not {"token", "secret"} & set(ProcessSpec.__dataclass_fields__)
