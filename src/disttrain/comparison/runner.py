"""Run the strategies of a comparison one after another, each as its own `disttrain`
command on the same config, and keep `comparison.json` (what ran, how it ended) current
after each run, so a comparison stopped half-way can still be rendered.

A run that fails (exit code, timeout) is recorded as failed with its error line and the
next one starts; nothing a run leaves is deleted.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from disttrain.comparison.plan import PlannedRun
from disttrain.config import Config
from disttrain.core.process_spec import user_command
from disttrain.core.processes import Cluster
from disttrain.metrics.keys import ACCURACY_THRESHOLDS, PERPLEXITY_TARGETS
from disttrain.report.files import write_json_atomic

logger = logging.getLogger(__name__)

MANIFEST = "comparison.json"
CONFIG_FILE = "config.yaml"
OUTPUT_LOG = "output"  # <run folder>/output.log: the run's stdout and stderr


class Display(Protocol):
    def started(self, index: int, run: PlannedRun) -> None: ...
    def tick(self, elapsed_s: float) -> None: ...
    def finished(self, record: RunRecord) -> None: ...
    def close(self) -> None: ...


@dataclass
class RunRecord:
    """How one run of the comparison went (an entry of `comparison.json`)."""

    name: str
    strategy: str
    compression: str | None
    workers: int
    status: str = "pending"  # pending, ok or failed
    error: str | None = None
    log_dir: str = ""
    wall_time_s: float | None = None
    command: list[str] | None = None


@dataclass
class Comparison:
    """A comparison folder and the runs it holds.

    Args:
        folder: where everything goes (`<folder>/<name>/` per run).
        config: the one config every run trains.
        runs: in the order they run.
        command: the command line that asked for it (recorded).
        timeout_s: a run still going after this long is stopped and counted as failed.
    """

    folder: Path
    config: Config
    runs: list[PlannedRun]
    command: list[str]
    timeout_s: float

    def __post_init__(self) -> None:
        self.records = [RunRecord(r.name, r.strategy, r.compression, r.workers, log_dir=f"{r.name}/logs")
                        for r in self.runs]
        self.created = datetime.now(UTC).isoformat(timespec="seconds")

    def run(self, display: Display) -> list[RunRecord]:
        """Run every strategy in turn; returns the records (also in `comparison.json`)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        config_path = self.folder / CONFIG_FILE
        self.config.save(config_path)
        self.write_manifest()
        try:
            for index, (run, record) in enumerate(zip(self.runs, self.records, strict=True)):
                display.started(index, run)
                self._run_one(run, record, config_path, display)
                self.write_manifest()
                display.finished(record)
        finally:
            display.close()
        return self.records

    def _run_one(self, run: PlannedRun, record: RunRecord, config_path: Path, display: Display) -> None:
        folder = self.folder / run.name
        spec = run.spec(config_path.resolve(), folder.resolve())
        record.command = user_command(spec)
        started = time.monotonic()
        with Cluster(folder) as cluster:
            child = cluster.spawn(OUTPUT_LOG, spec)
            code = None
            while code is None:
                elapsed = time.monotonic() - started
                if elapsed > self.timeout_s:
                    break
                event = cluster.next_event(min(1.0, self.timeout_s - elapsed))
                if event is not None and event.kind == "exit":
                    code = int(event.fields["code"])
                display.tick(time.monotonic() - started)
        record.wall_time_s = time.monotonic() - started
        if code == 0 and (folder / "logs" / "summary.json").is_file():
            record.status = "ok"
            return
        record.status = "failed"
        record.error = (f"stopped after {self.timeout_s:.0f}s (--timeout-per-run)" if code is None
                        else _error_line(child.log_path, code))
        logger.warning("%s failed: %s (log: %s)", run.name, record.error, child.log_path)

    def write_manifest(self) -> Path:
        manifest = {"version": 1, "created": self.created, "command": self.command,
                    "dataset": self.config.training.dataset, "thresholds": list(ACCURACY_THRESHOLDS),
                    "perplexity_targets": list(PERPLEXITY_TARGETS),
                    "num_threads": self.config.system.num_threads,
                    "runs": [asdict(r) for r in self.records]}
        return write_json_atomic(self.folder / MANIFEST, manifest)


def _error_line(log_path: Path, code: int) -> str:
    """The run's own error line (`error: ...`), else its last line, with the exit code."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    errors = [line for line in lines if line.startswith("error:")]
    last = errors[-1][len("error:"):].strip() if errors else (lines[-1] if lines else "no output")
    return f"exit code {code}: {last}"


class LogDisplay:
    """The progress of a comparison: a bar over its runs on a terminal, log lines otherwise."""

    def __init__(self, total: int):
        self.total = total
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="run", desc="compare", dynamic_ncols=True)

    def started(self, index: int, run: PlannedRun) -> None:
        self._name = run.name
        if self._bar is not None:
            self._bar.set_description(f"compare: {run.name} ({index + 1}/{self.total})")
        else:
            logger.info("%d/%d: %s (%d worker%s)", index + 1, self.total, run.name, run.workers,
                        "" if run.workers == 1 else "s")

    def tick(self, elapsed_s: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self._name} {elapsed_s:.0f}s")

    def finished(self, record: RunRecord) -> None:
        line = (f"{record.name}: done in {record.wall_time_s:.1f}s" if record.status == "ok"
                else f"{record.name}: failed ({record.error})")
        if self._bar is not None:
            self._bar.update(1)
            self._bar.write(line)
        else:
            logger.info("%s", line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
