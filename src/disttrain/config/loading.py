"""Loading the run configuration: YAML or JSON files, overrides, the original config's
`system.*` spellings, validation.

Precedence, lowest first: dataclass defaults < config file < CLI flags < `--set
section.key=value`. Unknown keys are errors, so a typo never passes silently. Validation
collects every problem and raises one `ConfigError` whose `problems` hold one line each,
naming the field as the user spelled it, the bad value and the rule.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from disttrain.config.schema import SECTIONS, Config
from disttrain.config.shipped import find_shipped, shipped_configs
from disttrain.core.errors import ConfigError

# The original config (the seed implementation's README) keeps these run-wide keys under
# `system`; that spelling stays valid and means the key of the component that now owns it.
SYSTEM_ALIASES: dict[str, str] = {
    "aggregation_mode": "ps.aggregation_mode",
    "compression_enabled": "compression.enabled",
    "compression_type": "compression.type",
    "compression_ratio": "compression.ratio",
    "heartbeat_interval": "coordinator.heartbeat_interval",
    "heartbeat_timeout": "coordinator.heartbeat_timeout",
}

# Spellings that never were the original config's and were renamed before any release. Not
# read: a config using one is refused, and the error names the key's spelling now.
RENAMED: dict[str, str] = {
    **{f"system.{key}": f"ps.{key}" for key in ("staleness", "num_servers", "backup_workers",
                                                "rpc_timeout_s", "bind_host", "payload_transport")},
    "ddp.mixed_precision": "training.precision",
}

Flat = dict[str, Any]          # "section.key" -> value
Spelling = dict[str, str]      # canonical "section.key" -> as the user wrote it


def canonical_key(dotted: str) -> str:
    """The owning component's spelling of `dotted` (`system.aggregation_mode` ->
    `ps.aggregation_mode`)."""
    section, _, key = dotted.partition(".")
    return SYSTEM_ALIASES.get(key, dotted) if section == "system" else dotted


def flatten(raw: dict[str, Any], source: str) -> tuple[Flat, Spelling, list[str]]:
    """A nested mapping as canonical dotted keys, with how each was spelled.

    Raises nothing: problems (a section that is not a mapping, one key given twice under
    two spellings) are returned.
    """
    flat: Flat = {}
    spelled: Spelling = {}
    problems: list[str] = []
    for section, values in raw.items():
        if section not in SECTIONS:
            problems.append(_unknown(str(section), list(SECTIONS), "section"))
            continue
        if values is None:
            continue
        if not isinstance(values, dict):
            problems.append(f"{section}: expected a mapping of keys to values, got {values!r}")
            continue
        for key, value in values.items():
            written = f"{section}.{key}"
            dotted = canonical_key(written)
            if dotted in flat and flat[dotted] != value:
                problems.append(f"{written}: {source} also sets it as {spelled[dotted]}; give it once")
            flat[dotted] = value
            spelled[dotted] = written
    return flat, spelled, problems


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
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is int:
        if number and (isinstance(value, int) or value.is_integer()):
            return int(value), None
        return value, f"{name}: {value!r} is not an integer"
    if base is float:
        if number and not math.isfinite(value):
            return value, f"{name}: {value!r} must be a finite number"
        return (float(value), None) if number else (value, f"{name}: {value!r} is not a number")
    if base is str:
        if isinstance(value, str) or number:
            return str(value), None
        return value, f"{name}: {value!r} is not a string"
    if base is dict:
        if isinstance(value, dict):
            return dict(value), None
        return value, f"{name}: {value!r} is not a mapping; give key: value pairs, e.g. {{n_layer: 2}}"
    raise AssertionError(f"unsupported config type {expected!r} for {name}")


def _unknown(written: str, known: list[str], what: str) -> str:
    leaf = written.rpartition(".")[2] if what == "key" else written
    close = difflib.get_close_matches(leaf, known, n=1)
    prefix = written.rpartition(".")[0] + "." if what == "key" else ""
    hint = f"; did you mean {prefix}{close[0]}?" if close else ""
    return f"{written}: unknown {what}{hint} (known: {', '.join(known)})"


def build(flat: Flat, spelled: Spelling, problems: list[str] | None = None) -> Config:
    """Validate canonical dotted keys and build the `Config`.

    Args:
        problems: problems found before (reading the layers), reported with the rest.
    Raises:
        ConfigError: with one line per problem.
    """
    def name(dotted: str) -> str:
        return spelled.get(dotted, dotted)

    problems = list(problems or [])
    values: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for dotted, value in flat.items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS:
            problems.append(_unknown(section, list(SECTIONS), "section"))
            continue
        cls = SECTIONS[section]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if dotted in RENAMED:
            problems.append(f"{name(dotted)}: unknown key; it is {RENAMED[dotted]} now (write that instead)")
            continue
        if key not in fields:
            known = list(fields) + (list(SYSTEM_ALIASES) if section == "system" else [])
            problems.append(_unknown(name(dotted), known, "key"))
            continue
        value, problem = _type_problem(name(dotted), value, get_type_hints(cls)[key])
        rule = fields[key].metadata
        if problem is None and "check" in rule and value is not None and not rule["check"](value):
            problem = f"{name(dotted)}: {value!r} {rule['rule']}"
        if problem:
            problems.append(problem)
        else:
            values[section][key] = value
    sections = {section: cls(**values[section]) for section, cls in SECTIONS.items()}
    if not problems:
        for section, instance in sections.items():
            if hasattr(instance, "cross_problems"):
                problems += instance.cross_problems(lambda key, s=section: name(f"{s}.{key}"))
    config = Config(**sections)
    if not problems:
        problems += config.cross_problems(name)
    if problems:
        raise ConfigError(sorted(set(problems), key=problems.index))
    return config


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a `Config` from a nested mapping (a key in its section, or in the
    original config's `system.*` spelling).

    Raises:
        ConfigError: with one line per problem.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping with sections {', '.join(SECTIONS)}")
    return build(*flatten(raw, "the config"))


def resolve_config_path(path: str | Path) -> Path:
    """The file `--config` names: `path` when it exists, else the shipped config of that
    bare name (`example`, `ps_sync_mnist`; see `disttrain configs`).

    Raises:
        ConfigError: neither a file nor a shipped config's name.
    """
    if Path(path).is_file():
        return Path(path)
    shipped = find_shipped(str(path))
    if shipped is not None:
        return shipped
    names = ", ".join(config.name for config in shipped_configs())
    raise ConfigError(f"--config: {str(path)!r} does not exist or is not a file, nor the name of a "
                      f"shipped config ({names}; `disttrain configs` lists them)")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file (or a shipped config, by name) into a nested mapping.

    Raises:
        ConfigError: the file is missing or not valid YAML/JSON.
    """
    path = resolve_config_path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config: {str(path)!r} is not UTF-8 text (byte {e.start}); save it as "
                          f"UTF-8 YAML or JSON") from e
    except OSError as e:
        raise ConfigError(f"--config: {str(path)!r} cannot be read ({e.strerror or e})") from e
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


def load_config(path: str | Path | None = None, flags: dict[str, Any] | None = None,
                set_expressions: list[str] | None = None) -> Config:
    """Resolve the config: defaults < file < CLI flags (dotted keys) < `--set` expressions.

    Raises:
        ConfigError: with one line per problem.
    """
    flat, spelled, problems = flatten(read_config_file(path) if path else {}, "the config file")
    for dotted, value in (flags or {}).items():
        flat[canonical_key(dotted)] = value
        spelled[canonical_key(dotted)] = dotted
    for expression in set_expressions or []:
        dotted, value = parse_set_expression(expression)
        flat[canonical_key(dotted)] = value
        spelled[canonical_key(dotted)] = dotted
    return build(flat, spelled, problems)
