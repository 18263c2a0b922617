"""What a comparison runs: strategy names such as `ps-sync+topk`, each turned into the
`disttrain` command that trains it on the comparison's one config.

A name is a strategy (`baseline`, `ps-sync`, `ps-ssp`, `ps-async`, `ddp`) optionally
followed by `+` and a gradient compression (`topk`, `int8`, `fp16`, `bf16`, and
`powersgd` for DDP). Every run gets the same config file (data, seed, budget, model);
the name only sets the strategy's own keys, so `ps-sync` means uncompressed even when
the config enables compression, and `system.architecture` says what each run is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from disttrain.config import STRATEGY_OF_ARCHITECTURE, Config, config_from_dict, parse_set_expression
from disttrain.core.errors import ConfigError
from disttrain.core.process_spec import ProcessSpec
from disttrain.core.processes import thread_count

# strategy -> (subcommand, config keys it sets)
STRATEGIES: dict[str, tuple[str, dict[str, str]]] = {
    "baseline": ("baseline", {}),
    "ps-sync": ("ps", {"ps.aggregation_mode": "sync"}),
    "ps-ssp": ("ps", {"ps.aggregation_mode": "ssp"}),
    "ps-async": ("ps", {"ps.aggregation_mode": "async"}),
    "ddp": ("ddp", {}),
}
# compression suffix -> config compression.type
COMPRESSIONS: dict[str, str] = {"topk": "topk", "int8": "quantization", "quantization": "quantization",
                                "fp16": "fp16", "bf16": "bf16", "powersgd": "powersgd"}
DDP_ONLY = {"powersgd"}
ARCHITECTURE_OF_COMMAND = {command: name for name, command in STRATEGY_OF_ARCHITECTURE.items()}

DEFAULT_STRATEGIES = "baseline,ps-sync,ps-ssp,ps-async,ddp"
KNOWN = (f"{', '.join(STRATEGIES)}; each but baseline optionally +{', +'.join(sorted(set(COMPRESSIONS)))} "
         f"(+powersgd with ddp only), e.g. ps-sync+topk")


@dataclass(frozen=True)
class PlannedRun:
    """One run of a comparison.

    Args:
        name: as the user wrote it (`ps-sync+topk`); also its folder's name.
        strategy: the strategy part (`ps-sync`).
        compression: the compression suffix, or None.
        workers: processes that train (1 for the baseline).
        overrides: further config keys of this run only, as (key, value) pairs.
    """

    name: str
    strategy: str
    compression: str | None
    workers: int
    overrides: tuple[tuple[str, str], ...] = ()

    @property
    def subcommand(self) -> str:
        return STRATEGIES[self.strategy][0]

    def settings(self) -> dict[str, str]:
        """The config keys this run sets on top of the comparison's config (its
        `system.architecture` among them, so the command it runs finds the config its own)."""
        keys = {"system.architecture": ARCHITECTURE_OF_COMMAND[self.subcommand],
                **STRATEGIES[self.strategy][1]}
        keys["compression.enabled"] = "true" if self.compression else "false"
        if self.compression:
            keys["compression.type"] = COMPRESSIONS[self.compression]
        keys.update(self.overrides)
        return keys

    def config(self, config: Config) -> Config:
        """The config this run trains: the comparison's `config` with `settings()`.

        Raises:
            ConfigError: a setting the config cannot take.
        """
        raw = config.to_dict()
        for key, text in self.settings().items():
            dotted, value = parse_set_expression(f"{key}={text}")
            section, name = dotted.split(".")
            raw[section][name] = value
        return config_from_dict(raw)

    def spec(self, config_path: Path, folder: Path) -> ProcessSpec:
        """The `disttrain` command of this run: its config, its folders, its keys."""
        settings = (("system.num_workers", str(self.workers)), *self.settings().items())
        return ProcessSpec(self.subcommand, config=config_path, log_dir=folder / "logs",
                           checkpoint_dir=folder / "checkpoints", settings=settings)


def parse_strategies(text: str, workers: int) -> list[PlannedRun]:
    """The runs named in a comma-separated list, in its order.

    Raises:
        ConfigError: an unknown or repeated name, or a compression the strategy lacks.
    """
    runs: list[PlannedRun] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        strategy, _, compression = name.partition("+")
        if strategy not in STRATEGIES or (compression and compression not in COMPRESSIONS):
            raise ConfigError(f"--strategies: unknown strategy {name!r}; known: {KNOWN}")
        if compression and strategy == "baseline":
            raise ConfigError(f"--strategies: {name!r}: the baseline sends no gradients to compress")
        if compression in DDP_ONLY and strategy != "ddp":
            raise ConfigError(f"--strategies: {name!r}: {compression} compresses DDP's all-reduce "
                              f"only; use ddp+{compression}, or {strategy}+topk")
        if any(run.name == name for run in runs):
            raise ConfigError(f"--strategies: {name!r} is named twice")
        runs.append(PlannedRun(name, strategy, compression or None, 1 if strategy == "baseline" else workers))
    if not runs:
        raise ConfigError(f"--strategies: no strategy named; known: {KNOWN}")
    return runs


def equal_threads(config: Config, runs: list[PlannedRun]) -> Config:
    """The config with `system.num_threads` pinned, when it is 0 (auto), to the threads
    each process of the widest run gets on this machine, so every process of every run
    (the baseline's one among them) computes with the same threads and a speed-up
    measures the strategy, not a difference in threads."""
    if config.system.num_threads:
        return config
    return config.replace(system={"num_threads": thread_count(0, max(run.workers for run in runs))})
