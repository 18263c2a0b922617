"""`disttrain report`: render a comparison folder again, or make the performance report
from the artifacts training commands leave with --artifacts-dir."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from disttrain.cli.advise import add_advise_link_flag, advisor_from_args
from disttrain.core.errors import ConfigError, DisttrainError, InputFileError
from disttrain.report.artifacts import (
    BASELINE,
    DDP,
    DDP_RANK,
    PS,
    WORKER_METRICS,
    load_artifact,
    worker_digests,
)
from disttrain.report.files import write_json_atomic
from disttrain.report.perf import Artifacts, perf_report, perf_table
from disttrain.report.render import render_comparison

HELP = "render a comparison's report again, or a performance report from run artifacts"
DESCRIPTION = """Two forms.

Given a comparison folder (made by `disttrain compare`), render its report again from
comparison.json and the runs' logs: report.html (one self-contained page, plots inline),
report.md, report.json and plots/*.png in the folder. Prints the table and where
report.html is.

    disttrain report runs/compare-20261201-040000/

Given artifacts (the JSON files `disttrain baseline|ps|ddp --artifacts-dir DIR` writes),
make one performance report: each strategy's accuracy, time, samples/s, speed-up over
the baseline and scaling efficiency, and each worker's or rank's samples/s, step time,
communication share and bytes, with how far apart the slowest and fastest are. Give any
of them (at least one); each file must be the kind its flag takes. Prints a short table;
--output writes the report as JSON.

    disttrain report --output reports/perf_report.json --baseline-json artifacts/baseline.json \\
        --ps-json artifacts/ps.json --worker-metrics-json artifacts/worker_metrics.json \\
        --ddp-json artifacts/ddp.json --ddp-rank-json artifacts/ddp_rank_0.json artifacts/ddp_rank_1.json

A missing, unreadable or malformed file, or one of the wrong kind, exits with 2 and a
line naming it."""

T = TypeVar("T")

# flag -> (destination, artifact kind)
ARTIFACT_FLAGS = {
    "--baseline-json": ("baseline_json", BASELINE),
    "--ps-json": ("ps_json", PS),
    "--worker-metrics-json": ("worker_metrics_json", WORKER_METRICS),
    "--ddp-json": ("ddp_json", DDP),
}
RANK_FLAG = "--ddp-rank-json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", nargs="?", help="a comparison folder to render again")
    add_advise_link_flag(parser)
    group = parser.add_argument_group("performance report from artifacts")
    group.add_argument("--baseline-json", metavar="FILE", help="baseline.json of a baseline run")
    group.add_argument("--ps-json", metavar="FILE", help="ps.json of a parameter-server run")
    group.add_argument("--worker-metrics-json", metavar="FILE",
                       help="worker_metrics.json of a parameter-server run (each worker's figures)")
    group.add_argument("--ddp-json", metavar="FILE", help="ddp.json of a DDP run")
    group.add_argument(RANK_FLAG, dest="ddp_rank_json", nargs="+", action="extend", default=[],
                       metavar="FILE", help="ddp_rank_<R>.json of each rank of a DDP run")
    group.add_argument("--output", metavar="PATH", help="write the performance report here as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> None:
    given = [flag for flag, (dest, _) in ARTIFACT_FLAGS.items() if getattr(args, dest)]
    given += [RANK_FLAG] if args.ddp_rank_json else []
    if args.folder and given:
        raise ConfigError(f"give a comparison folder or artifacts ({', '.join(given)}), not both")
    if args.folder:
        if args.output:
            raise ConfigError("--output is for the report from artifacts; a comparison's report "
                              "is written into its folder")
        advisor = advisor_from_args(args)
        rendered = _written(lambda: render_comparison(args.folder, advisor), args.folder)
        print(rendered.table)
        print(f"\nreport: {rendered.html_path}")
        return
    if not given:
        raise ConfigError("give a comparison folder to render, or at least one artifact: "
                          f"{', '.join([*ARTIFACT_FLAGS, RANK_FLAG])}")
    report = perf_report(load_artifacts(args))
    if args.output:
        _written(lambda: write_json_atomic(args.output, report), args.output)
    print(perf_table(report))
    if args.output:
        print(f"\nreport: {args.output}")


def load_artifacts(args: argparse.Namespace) -> Artifacts:
    """Every artifact given, each checked against its flag.

    Raises:
        InputFileError: a file is missing, malformed or of another kind; a rank is given twice.
    """
    loaded: dict[str, dict] = {}
    artifacts = Artifacts()
    for flag, (dest, kind) in ARTIFACT_FLAGS.items():
        path = getattr(args, dest)
        if path:
            loaded[kind] = load_artifact(path, kind, flag)
            artifacts.sources[kind] = [str(path)]
    artifacts.baseline, artifacts.ps, artifacts.ddp = (loaded.get(kind) for kind in (BASELINE, PS, DDP))
    if WORKER_METRICS in loaded:
        artifacts.workers = worker_digests(loaded[WORKER_METRICS])
    paths_by_rank: dict[int, str] = {}
    for path in args.ddp_rank_json:
        rank = load_artifact(path, DDP_RANK, RANK_FLAG)
        if rank["rank"] in paths_by_rank:
            raise InputFileError(f"{path}: rank {rank['rank']} is given twice "
                                 f"(also {paths_by_rank[rank['rank']]})")
        paths_by_rank[rank["rank"]] = str(path)
        artifacts.ranks.append(rank)
    artifacts.ranks.sort(key=lambda rank: rank["rank"])
    if args.ddp_rank_json:
        artifacts.sources[DDP_RANK] = [str(path) for path in args.ddp_rank_json]
    return artifacts


def _written(write: Callable[[], T], path: str) -> T:
    """Run `write`; a folder or file that cannot be written is one line, exit 1."""
    try:
        return write()
    except OSError as e:
        raise DisttrainError(f"{path}: cannot write the report ({e.strerror or e})") from e
