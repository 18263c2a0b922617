"""The project's exception hierarchy.

Each class says whether the error is recoverable, in its docstring and in `recoverable`,
which a supervisor reads (`coordinator.budget`): False, a restart would fail the same way
(a user's error: the run stops at once); True, a restart may mend it; None, not said. The
CLI maps them to exit codes:
`ConfigError` and `InputFileError` exit with 2 (bad usage, config or input file),
`CheckpointStoreError` with 74 (a checkpoint store that failed for good), every other
`DisttrainError` with 1.
"""


class DisttrainError(Exception):
    """Base class. Carries a one-line message meant for the user."""

    exit_code = 1
    recoverable: bool | None = None


class ConfigError(DisttrainError, ValueError):
    """The config or the command line is invalid. Not recoverable: fix the input.

    `problems` holds one line per problem, each naming the field, the bad value and the rule.
    """

    exit_code = 2
    recoverable = False

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class InputFileError(DisttrainError):
    """A file given to read (a run's summary.json or metrics, a report artifact, a
    comparison's comparison.json) is missing, unreadable, not JSON or of the wrong shape.
    Not recoverable: the one-line message names the file and what is wrong with it; fix
    the path or write the file again."""

    exit_code = 2
    recoverable = False


class DataError(DisttrainError):
    """A data set is missing, truncated or malformed. Not recoverable without user action."""

    recoverable = False


class CheckpointError(DisttrainError):
    """A checkpoint cannot be read or does not match the run. Not recoverable automatically:
    the message names the file; delete it to fall back to an older one."""

    recoverable = False


class CheckpointStoreError(DisttrainError):
    """The checkpoint store failed for good: a write or read kept failing through its retry
    window (the store unreachable, its disk full, access to it refused). Not recoverable by
    a restart: a process started again on the same store fails the same way, so the run
    stops. The one-line message names the store, the operation, the error, the newest
    complete checkpoint there, and says to continue with `--resume` once the store works.
    Not a `CheckpointError`: a checkpoint that cannot be *reached* is not a damaged one to
    skip for an older one."""

    exit_code = 74  # sysexits.h EX_IOERR: a launcher tells it from a crash worth a restart
    recoverable = False


class Preempted(DisttrainError):
    """The process was asked to stop (SIGTERM: a scheduler's preemption, a spot machine
    reclaimed) and stopped at a step's end with a checkpoint of that step. Nothing is lost:
    the same command with `--resume` goes on from there. Exit code 143, as a shell reports a
    process ended by SIGTERM."""

    exit_code = 143


class TrainingError(DisttrainError):
    """Training cannot go on as configured (e.g. it diverged). Not recoverable by a
    restart: change the config."""

    recoverable = False


class DistributedError(DisttrainError):
    """A peer process failed or could not be reached. Recoverable by a supervisor restart."""

    recoverable = True


def error_lines(error: DisttrainError) -> list[str]:
    """The lines to show a user for `error`: one per problem, each without a traceback."""
    return list(getattr(error, "problems", None) or [str(error)])


def reported_error(output: str) -> str | None:
    """The last `error: ...` line a disttrain process printed in `output` (its log's tail),
    without that prefix; None when it printed none."""
    for line in reversed(output.splitlines()):
        if line.startswith("error: "):
            return line[len("error: "):].strip()
    return None


def store_failure(name: str, output: str, log: object) -> CheckpointStoreError:
    """What a launcher stops the run with when its process `name` exited with
    `CheckpointStoreError.exit_code`: that process's own line (the last `error:` line of
    its `output`), named; restarting it would only fail again."""
    line = reported_error(output) or f"its checkpoint store failed for good; see its log {log}"
    return CheckpointStoreError(f"{name}: {line.removeprefix(f'{name}: ')}")
