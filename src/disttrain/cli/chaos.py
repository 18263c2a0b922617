"""`disttrain chaos`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from disttrain.core.errors import ConfigError

HELP = "run real training runs under fault schedules drawn from a seed, and check their invariants"
DESCRIPTION = """Generated fault schedules over whole runs. Each schedule is drawn from a seed
against one scenario (a small `disttrain ps` or `disttrain ddp` run on the bundled digits
data set): kills, hangs, partitions, lost and late replies, slow links, a full checkpoint
store and crashes during a checkpoint write, at random steps, and the interactions nobody
scripts (a second fault before the next checkpoint, a fault during the recovery from the
last one, at an epoch boundary) and SIGKILLs from outside every few seconds. Every
schedule is printed; after each run the invariants are read from what it left on disk:

  the run finished, or stopped with a last line naming the cause and --resume (then
  it is resumed, fault-free, and must finish); every sample applied exactly once (the
  shards' ledgers; a live DDP group's ledger); DDP restart mode's final model bit-identical
  to the fault-free run's; live DDP's survivors never restarted; every process reaped;
  the final accuracy within 1 point of the fault-free run of the same training seed.

Exit code 0 when no invariant was broken. A broken one reproduces from its seed:

    disttrain chaos --scenarios ps-sync --seed 17 --schedules 1"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from disttrain.chaos.scenarios import QUICK, SCENARIOS
    parser.add_argument("--schedules", type=int, default=len(SCENARIOS), metavar="N",
                        help="how many schedules to run, over the scenarios in turn")
    parser.add_argument("--seed", type=int, default=0,
                        help="the first schedule's seed (schedule i: seed + i)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), metavar="LIST",
                        help=f"comma-separated, among {', '.join(SCENARIOS)}")
    parser.add_argument("--quick", action="store_true",
                        help=f"the scenarios {', '.join(QUICK)} only (unless --scenarios names others)")
    parser.add_argument("--max-patterns", type=int, default=2, metavar="K",
                        help="fault patterns per schedule, at most")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/chaos"), metavar="DIR",
                        help="where the runs go; a run that broke an invariant stays there")
    parser.add_argument("--keep-runs", action="store_true", help="keep every run's folder")
    parser.add_argument("--output", type=Path, metavar="PATH", help="write the campaign's JSON here")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _scenarios(args: argparse.Namespace) -> list:
    from disttrain.chaos.scenarios import QUICK, SCENARIOS, scenario
    names = [n for n in args.scenarios.split(",") if n]
    if args.quick and args.scenarios == ",".join(SCENARIOS):
        names = list(QUICK)
    try:
        return [scenario(name) for name in names]
    except ValueError as e:
        raise ConfigError(f"--scenarios: {e}") from e


def run(args: argparse.Namespace) -> int:
    scenarios = _scenarios(args)
    if args.schedules < 1 or args.max_patterns < 1:
        raise ConfigError("--schedules and --max-patterns: give at least 1")
    from disttrain.chaos.campaign import Campaign, run_campaign
    from disttrain.report.files import write_json_atomic

    def show(result: dict) -> None:
        verdict = {"finished": "ok  ", "stopped-then-resumed": "stop", "violated": "FAIL"}[result["outcome"]]
        print(f"{verdict} {result['scenario']} seed {result['seed']} ({', '.join(result['patterns'])}) "
              f"{result['wall_s']:.0f}s", flush=True)
        for line in result["schedule"]:
            print(f"       {line}")
        for violation in result["violations"]:
            print(f"       violated: {violation}")

    try:
        campaign = Campaign(tuple(scenarios), args.seed, args.schedules, args.max_patterns)
        summary = run_campaign(campaign, args.work_dir, show, args.keep_runs)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary["command"] = "disttrain chaos " + " ".join(sys.argv[2:])
    if args.output:
        write_json_atomic(args.output, summary)
    print(f"{summary['schedules_run']} schedules: {summary['finished']} finished, "
          f"{summary['stopped_with_reason']} stopped with a reason and resumed, "
          f"{summary['invariant_violations']} broke an invariant; slowdown median "
          f"{summary['slowdown']['median'] or 0:.2f}x, longest recovery "
          f"{summary['longest_recovery_s'] or 0:.3g}s")
    return 1 if summary["invariant_violations"] else 0
