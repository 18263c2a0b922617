"""The run configuration: schema, loading (YAML or JSON), overrides and validation.

Precedence, lowest first: dataclass defaults < config file < CLI flags < `--set
section.key=value`. Unknown keys are errors, so a typo never passes silently. Validation
collects every problem and raises one `ConfigError` whose `problems` hold one line each,
naming the field, the bad value and the rule.

The seed's fields keep their names and rules (`training.*`, `system.*`); what the design
needs beyond them is added beside them, and DDP-only knobs live in their own `ddp` section.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from disttrain.errors import ConfigError

DATASETS = ("mnist", "fashion_mnist", "cifar10", "digits", "synthetic")
ARCHITECTURES = ("baseline", "parameter_server", "ddp")
AGGREGATION_MODES = ("sync", "async", "ssp")
COMPRESSION_TYPES = ("quantization", "topk")
OPTIMIZERS = ("sgd", "adam")
BACKENDS = ("auto", "gloo", "nccl")
LR_SCALINGS = ("none", "linear")
MIXED_PRECISIONS = ("none", "bf16", "fp16")
# auto: shared memory between processes of one machine, gRPC bytes between machines.
PAYLOAD_TRANSPORTS = ("auto", "grpc", "shared_memory")


def _rule(check, text: str) -> dict[str, Any]:
    return {"check": check, "rule": text}


def _positive(value) -> bool:
    return value > 0


def _non_negative(value) -> bool:
    return value >= 0


def _choice(options: tuple[str, ...]) -> dict[str, Any]:
    return _rule(lambda v: v in options, "must be one of " + ", ".join(options))


def _optional_positive() -> dict[str, Any]:
    return _rule(lambda v: v is None or v > 0, "must be a positive integer or null (all)")


POSITIVE = _rule(_positive, "must be > 0")
NON_NEGATIVE = _rule(_non_negative, "must be >= 0")
NON_EMPTY = _rule(lambda v: bool(v.strip()), "must not be empty")


@dataclass
class TrainingConfig:
    """What is trained and how: data, model, optimizer, schedule."""

    batch_size: int = field(default=64, metadata=POSITIVE)
    learning_rate: float = field(default=0.001, metadata=POSITIVE)
    num_epochs: int = field(default=1, metadata=POSITIVE)
    dataset: str = field(default="digits", metadata=_choice(DATASETS))
    model_architecture: str = field(default="simplecnn", metadata=NON_EMPTY)
    checkpoint_interval: int = field(default=200, metadata=POSITIVE)
    optimizer: str = field(default="adam", metadata=_choice(OPTIMIZERS))
    momentum: float = field(default=0.9, metadata=_rule(lambda v: 0 <= v < 1, "must be in [0, 1)"))
    weight_decay: float = field(default=0.0, metadata=NON_NEGATIVE)
    seed: int = field(default=42, metadata=NON_NEGATIVE)
    data_dir: str = field(default="data", metadata=NON_EMPTY)
    download: bool = True  # fetch missing data set files from the canonical mirrors
    max_train_samples: int | None = field(default=None, metadata=_optional_positive())
    max_test_samples: int | None = field(default=None, metadata=_optional_positive())
    num_samples: int = field(default=2048, metadata=POSITIVE)
    eval_batch_size: int = field(default=1000, metadata=POSITIVE)
    log_interval: int = field(default=10, metadata=POSITIVE)
    mlp_hidden_size: int = field(default=256, metadata=POSITIVE)
    mlp_num_layers: int = field(default=2, metadata=POSITIVE)

    def cross_problems(self) -> list[str]:
        from disttrain.models import registered_models

        names = registered_models()
        if self.model_architecture.strip() and self.model_architecture not in names:
            return [
                f"training.model_architecture: {self.model_architecture!r} is not a registered "
                f"model; use one of {', '.join(names)}"
            ]
        return []


@dataclass
class SystemConfig:
    """How the run is laid out: strategy, processes, aggregation, compression, I/O paths."""

    num_workers: int = field(default=2, metadata=POSITIVE)
    architecture: str = field(default="baseline", metadata=_choice(ARCHITECTURES))
    aggregation_mode: str = field(default="sync", metadata=_choice(AGGREGATION_MODES))
    compression_enabled: bool = False
    compression_type: str = field(default="quantization", metadata=_choice(COMPRESSION_TYPES))
    compression_ratio: float = field(
        default=0.01, metadata=_rule(lambda v: 0 < v <= 1, "must be in (0, 1]")
    )
    heartbeat_interval: float = field(default=1.0, metadata=POSITIVE)
    heartbeat_timeout: float = field(default=5.0, metadata=POSITIVE)
    checkpoint_dir: str = field(default="checkpoints", metadata=NON_EMPTY)
    log_dir: str = field(default="logs", metadata=NON_EMPTY)
    checkpoint_keep: int = field(default=3, metadata=POSITIVE)
    num_threads: int = field(default=0, metadata=_rule(_non_negative, "must be >= 0 (0 = auto)"))
    num_servers: int = field(default=1, metadata=POSITIVE)
    staleness: int = field(default=2, metadata=NON_NEGATIVE)
    backup_workers: int = field(default=0, metadata=NON_NEGATIVE)
    rpc_timeout_s: float = field(default=60.0, metadata=POSITIVE)
    bind_host: str = field(default="127.0.0.1", metadata=NON_EMPTY)
    payload_transport: str = field(default="auto", metadata=_choice(PAYLOAD_TRANSPORTS))

    def cross_problems(self) -> list[str]:
        problems = []
        if self.heartbeat_timeout <= self.heartbeat_interval:
            problems.append(
                f"system.heartbeat_timeout: {self.heartbeat_timeout} must be greater than "
                f"system.heartbeat_interval ({self.heartbeat_interval})"
            )
        if self.backup_workers >= self.num_workers:
            problems.append(
                f"system.backup_workers: {self.backup_workers} must be less than "
                f"system.num_workers ({self.num_workers})"
            )
        return problems


@dataclass
class DDPConfig:
    """Knobs of the DDP strategy only."""

    backend: str = field(default="auto", metadata=_choice(BACKENDS))
    bucket_cap_mb: float = field(default=25.0, metadata=POSITIVE)
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    grad_accumulation_steps: int = field(default=1, metadata=POSITIVE)
    lr_scaling: str = field(default="none", metadata=_choice(LR_SCALINGS))
    mixed_precision: str = field(default="none", metadata=_choice(MIXED_PRECISIONS))
    max_restarts: int = field(default=0, metadata=NON_NEGATIVE)
    timeout_s: float = field(default=300.0, metadata=POSITIVE)
    rdzv_endpoint: str = ""
    num_nodes: int = field(default=1, metadata=POSITIVE)
    rdzv_id: str = ""

    def cross_problems(self) -> list[str]:
        problems = []
        if self.rdzv_endpoint and not _is_endpoint(self.rdzv_endpoint):
            problems.append(f"ddp.rdzv_endpoint: {self.rdzv_endpoint!r} must look like HOST:PORT "
                            "(port 0-65535), e.g. node0.example.com:29400")
        if self.num_nodes > 1 and not self.rdzv_endpoint:
            problems.append(f"ddp.rdzv_endpoint: ddp.num_nodes is {self.num_nodes}, so every node "
                            "needs the HOST:PORT of the rendezvous (pass --rdzv-endpoint)")
        return problems


def _is_endpoint(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host.strip("[]") and port.isdigit() and int(port) <= 65535)


@dataclass
class Config:
    """The whole run config. A component receives its own section, not this object."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML (the run folder keeps what actually ran)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


SECTIONS: dict[str, type] = {"training": TrainingConfig, "system": SystemConfig, "ddp": DDPConfig}


def _type_problem(name: str, value: Any, expected: Any) -> tuple[Any, str | None]:
    """Coerce `value` to the annotated type; return (value, problem-or-None)."""
    allow_none = expected == (int | None) or expected == (float | None)
    if value is None:
        return value, None if allow_none else f"{name}: null is not allowed; give a value"
    base = int if expected in (int, int | None) else float if expected in (float, float | None) else expected
    if base is bool:
        if isinstance(value, bool):
            return value, None
        return value, f"{name}: {value!r} is not a boolean; use true or false"
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        if isinstance(value, float) and value.is_integer():
            return int(value), None
        return value, f"{name}: {value!r} is not an integer"
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                return value, f"{name}: {value!r} must be a finite number"
            return float(value), None
        return value, f"{name}: {value!r} is not a number"
    if base is str:
        if isinstance(value, str):
            return value, None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value), None
        return value, f"{name}: {value!r} is not a string"
    raise AssertionError(f"unsupported config type {expected!r} for {name}")


def _build_section(section: str, cls: type, raw: Any) -> tuple[Any, list[str]]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return cls(), [f"{section}: expected a mapping of keys to values, got {raw!r}"]
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems: list[str] = []
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{section}.{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {section}.{close[0]}?" if close else ""
            problems.append(f"{name}: unknown key{hint} (known keys: {', '.join(fields)})")
            continue
        value, problem = _type_problem(name, value, hints[key])
        if problem:
            problems.append(problem)
            continue
        rule = fields[key].metadata
        if rule and value is not None and not rule["check"](value):
            problems.append(f"{name}: {value!r} {rule['rule']}")
            continue
        values[key] = value
    instance = cls(**values)
    if not problems and hasattr(instance, "cross_problems"):
        problems.extend(instance.cross_problems())
    return instance, problems


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a `Config` from a nested mapping.

    Raises:
        ConfigError: with one line per problem.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping with sections {', '.join(SECTIONS)}")
    problems = []
    for section in raw:
        if section not in SECTIONS:
            close = difflib.get_close_matches(str(section), SECTIONS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{section}: unknown section{hint} (known: {', '.join(SECTIONS)})")
    built = {}
    for section, cls in SECTIONS.items():
        built[section], section_problems = _build_section(section, cls, raw.get(section))
        problems.extend(section_problems)
    if problems:
        raise ConfigError(problems)
    return Config(**built)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a nested mapping.

    Raises:
        ConfigError: the file is missing or not valid YAML/JSON.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: {str(path)!r} does not exist or is not a file")
    text = path.read_text()
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        line = str(e).splitlines()[0]
        raise ConfigError(f"--config: {str(path)!r} is not valid {path.suffix[1:].upper()}: {line}") from e
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config: {str(path)!r} must hold a mapping of sections, "
                          f"got {type(raw).__name__}")
    return raw


def parse_set_expression(expression: str) -> tuple[str, Any]:
    """Parse `section.key=value`; the value is read as YAML (so 128, 0.1, true, null work).

    Raises:
        ConfigError: the expression is not of the form section.key=value.
    """
    key, sep, text = expression.partition("=")
    if not sep or key.count(".") != 1 or not all(key.split(".")):
        raise ConfigError(f"--set: {expression!r} must look like section.key=value")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set: cannot read the value of {expression!r}") from e
    return key.strip(), value


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of `raw` with dotted `section.key` overrides applied."""
    merged = {section: dict(values or {}) if isinstance(values, dict) else values
              for section, values in raw.items()}
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        target = merged.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{section}: expected a mapping of keys to values, got {target!r}")
        target[key] = value
    return merged


def load_config(
    path: str | Path | None = None,
    flags: dict[str, Any] | None = None,
    set_expressions: list[str] | None = None,
) -> Config:
    """Resolve the config: defaults < file < CLI flags (dotted keys) < `--set` expressions.

    Raises:
        ConfigError: with one line per problem.
    """
    raw = read_config_file(path) if path else {}
    raw = apply_overrides(raw, flags or {})
    raw = apply_overrides(raw, dict(parse_set_expression(e) for e in set_expressions or []))
    return config_from_dict(raw)
