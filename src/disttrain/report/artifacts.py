"""Run artifacts: small JSON files a training command leaves in `--artifacts-dir`, for a
performance report made elsewhere (`disttrain report --baseline-json ...`).

Every artifact has `"kind"` (which file it is) and `"version"`:

    baseline.json          kind "baseline": the baseline run's summary fields, and
                           `process`, the digest of its one process
    ps.json                kind "ps": a parameter-server run's summary fields
    worker_metrics.json    kind "worker_metrics": `workers`, one digest per worker
    ddp.json               kind "ddp": a DDP run's summary fields
    ddp_rank_<R>.json      kind "ddp_rank": the digest of rank R, with `rank`

A digest is `digest.process_digest` of the process's metrics.jsonl: samples, training
clock, samples/s, mean step time and its split, bytes per step, final test accuracy if
the process evaluates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disttrain.core.errors import InputFileError
from disttrain.report.digest import process_digest
from disttrain.report.files import read_json_file, write_json_atomic
from disttrain.report.runs import SUMMARY_NUMBERS, is_number, read_processes

ARTIFACT_VERSION = 1
BASELINE, PS, DDP, WORKER_METRICS, DDP_RANK = "baseline", "ps", "ddp", "worker_metrics", "ddp_rank"
RUN_KINDS = (BASELINE, PS, DDP)
# kind -> its file name
FILE_NAMES = {BASELINE: "baseline.json", PS: "ps.json", DDP: "ddp.json",
              WORKER_METRICS: "worker_metrics.json", DDP_RANK: "ddp_rank_<R>.json"}
# digest fields an artifact must carry, each a number or (where never logged) null
DIGEST_NUMBERS = ("train_time_s", "samples_per_s", "step_time_s", "compute_s", "comm_blocked_s",
                  "compression_s", "comm_share", "wire_bytes_per_step", "final_accuracy")


def run_kind(strategy: str) -> str:
    """The artifact kind of a strategy's run: baseline, ps (ps-sync, ps-async, ps-ssp), ddp.

    Raises:
        ValueError: a strategy without artifacts.
    """
    if strategy in (BASELINE, DDP):
        return strategy
    if strategy.startswith("ps-"):
        return PS
    raise ValueError(f"no artifacts are defined for strategy {strategy!r}")


def write_run_artifacts(summary: dict[str, Any], folder: str | Path,
                        log_dir: str | Path | None = None) -> list[Path]:
    """Write the artifacts of a finished run into `folder` (created). Call after the run
    has written its summary; each process's metrics are read from its folder of `log_dir`.

    Args:
        summary: the run summary as in summary.json (`RunSummary.to_dict()`).
        log_dir: the run's log dir (default: the summary's `config.system.log_dir`).

    Returns:
        The files written: the run's artifact first.

    Raises:
        ValueError: the summary is of a strategy without artifacts.
        InputFileError: a metrics file cannot be read. OSError: `folder` cannot be written.
    """
    folder = Path(folder)
    kind = run_kind(summary["strategy"])
    log_dir = Path(log_dir if log_dir is not None else summary["config"]["system"]["log_dir"])
    run = {**summary, "kind": kind, "version": ARTIFACT_VERSION}
    written = []
    if kind == BASELINE:
        processes = read_processes(log_dir, BASELINE)
        run["process"] = process_digest(BASELINE, processes[BASELINE]) if BASELINE in processes else None
        written.append(write_json_atomic(folder / FILE_NAMES[BASELINE], run))
    elif kind == PS:
        written.append(write_json_atomic(folder / FILE_NAMES[PS], run))
        workers = [process_digest(name, records)
                   for name, records in read_processes(log_dir, "worker").items()]
        written.append(write_json_atomic(folder / FILE_NAMES[WORKER_METRICS], {
            "kind": WORKER_METRICS, "version": ARTIFACT_VERSION, "strategy": summary["strategy"],
            "workers": workers}))
    else:
        written.append(write_json_atomic(folder / FILE_NAMES[DDP], run))
        for name, records in read_processes(log_dir, "rank").items():
            digest = process_digest(name, records)
            written.append(write_json_atomic(folder / f"ddp_rank_{digest['index']}.json", {
                "kind": DDP_RANK, "version": ARTIFACT_VERSION, "strategy": summary["strategy"],
                "rank": digest["index"], **digest}))
    return written


def load_artifact(path: str | Path, kind: str, flag: str) -> dict[str, Any]:
    """Read the artifact at `path`, which must be of `kind`.

    Args:
        flag: the command-line flag it was given to, named in errors.

    Raises:
        InputFileError: one line naming the file: missing, unreadable, not JSON, of another
            kind, or missing a field.
    """
    path = Path(path)
    data = read_json_file(path, f"{kind} artifact, {FILE_NAMES[kind]}")
    if not isinstance(data, dict):
        raise InputFileError(f"{path}: is not a disttrain artifact (expected a JSON object, given to {flag})")
    found = data.get("kind")
    if found is None:
        raise InputFileError(f"{path}: has no \"kind\", so it is not a disttrain artifact; {flag} takes "
                             f"{FILE_NAMES[kind]} as a training command writes it with --artifacts-dir")
    if found != kind:
        written_as = f" ({FILE_NAMES[found]})" if found in FILE_NAMES else ""
        raise InputFileError(f"{path}: is a {found!r} artifact{written_as}, but {flag} takes a {kind!r} "
                             f"artifact ({FILE_NAMES[kind]})")
    if kind in RUN_KINDS:
        _check_run(data, path)
    elif kind == WORKER_METRICS:
        workers = data.get("workers")
        if not isinstance(workers, list) or not workers:
            raise InputFileError(f"{path}: \"workers\" should be a non-empty list of worker digests")
        for i, worker in enumerate(workers):
            _check_digest(worker, f"{path}: workers[{i}]")
    else:
        _check_digest(data, str(path))
        if not isinstance(data.get("rank"), int):
            raise InputFileError(f"{path}: \"rank\" should be an integer, not {data.get('rank')!r}")
    return data


def worker_digests(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The digests of a worker_metrics artifact, each with the run's strategy."""
    return [{**worker, "strategy": data.get("strategy")} for worker in data["workers"]]


def _check_run(data: dict[str, Any], path: Path) -> None:
    if not isinstance(data.get("strategy"), str):
        raise InputFileError(f"{path}: \"strategy\" is missing or not a string")
    if run_kind_or_none(data["strategy"]) != data["kind"]:
        raise InputFileError(f"{path}: says kind {data['kind']!r} but strategy {data['strategy']!r}, "
                             "so it is not an artifact as --artifacts-dir writes it")
    for name in SUMMARY_NUMBERS:
        if name not in data:
            raise InputFileError(f"{path}: has no \"{name}\" (a {data['kind']} artifact has every "
                                 "summary field)")
        if not is_number(data[name]):
            raise InputFileError(f"{path}: \"{name}\" should be a number, not {data[name]!r}")


def _check_digest(data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise InputFileError(f"{where}: should be a process digest (a JSON object)")
    if not isinstance(data.get("process"), str) or not is_number(data.get("samples")):
        raise InputFileError(f"{where}: is not a process digest (\"process\" and \"samples\" missing)")
    for name in DIGEST_NUMBERS:
        if name not in data or not (data[name] is None or is_number(data[name])):
            raise InputFileError(f"{where}: \"{name}\" should be a number or null, not {data.get(name)!r}")


def run_kind_or_none(strategy: str) -> str | None:
    try:
        return run_kind(strategy)
    except ValueError:
        return None
