"""The warnings about a run's config, one line each: every key set away from its default
that the run ignores (`config.usage`), and a `system.architecture` naming another strategy
than the command that runs.

They are logged once per run, by the process the user started: a process a disttrain
launcher started (its environment names the launcher, `core.processes.PARENT_ENV`) reads
the launcher's resolved config, where every key looks set, and says nothing, since its
launcher has spoken already. A `ps-server` or `ps-worker` started by hand warns as `ps`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

from disttrain.config import STRATEGY_OF_ARCHITECTURE, Config
from disttrain.config.usage import IgnoredKey, ignored_by_every_run, ignored_keys
from disttrain.core.processes import PARENT_ENV

logger = logging.getLogger(__name__)

# command -> the strategy it runs (a part of it, for ps-server and ps-worker)
STRATEGY_OF_COMMAND = {"baseline": "baseline", "ps": "ps", "ps-server": "ps", "ps-worker": "ps", "ddp": "ddp"}
DEFAULT_ARCHITECTURE = Config().system.architecture


def warn_about_run_config(config: Config, command: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Log the warnings about the config of a run of `command` (see the module docstring).

    Args:
        config: the run's resolved config.
        command: baseline, ps, ps-server, ps-worker or ddp.
        env: the process's environment (default: this process's).
    Returns:
        The lines logged (none in a process a launcher started).
    """
    if _launched(env):
        return []
    strategy = STRATEGY_OF_COMMAND[command]
    lines = [_architecture_line(config, command, strategy)] if _names_another(config, strategy) else []
    return _log(lines + [key.line() for key in ignored_keys(config, strategy)])


def warn_about_comparison_config(runs: Iterable[tuple[Config, str]],
                                 env: Mapping[str, str] | None = None) -> list[str]:
    """Log the keys that every run of a comparison ignores (each run: its config and its
    command, baseline, ps or ddp); a key one run acts on is not ignored. Returns the lines."""
    if _launched(env):
        return []
    ignored: list[IgnoredKey] = ignored_by_every_run(
        (config, STRATEGY_OF_COMMAND[command]) for config, command in runs)
    return _log([key.line(by="every run of the comparison") for key in ignored])


def _launched(env: Mapping[str, str] | None) -> bool:
    return bool((os.environ if env is None else env).get(PARENT_ENV))


def _names_another(config: Config, strategy: str) -> bool:
    architecture = config.system.architecture
    return architecture != DEFAULT_ARCHITECTURE and STRATEGY_OF_ARCHITECTURE[architecture] != strategy


def _architecture_line(config: Config, command: str, strategy: str) -> str:
    named = STRATEGY_OF_ARCHITECTURE[config.system.architecture]
    return (f"system.architecture is {config.system.architecture}, but `disttrain {command}` runs "
            f"{strategy}: the command decides what runs; `disttrain train --config FILE` runs the "
            f"strategy the config names ({named})")


def _log(lines: list[str]) -> list[str]:
    for line in lines:
        logger.warning("%s", line)
    return lines
