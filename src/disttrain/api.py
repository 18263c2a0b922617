"""The Python API: `disttrain.fit` trains a model under one strategy and returns the run's
summary, as `disttrain baseline|ps|ddp` does from a shell; `disttrain.compare` runs
`disttrain compare` and returns each run's summary.

It is the command line's path, not a second one: the arguments fill the same parsed flags
the command's parser makes, and the command's own `prepare` and `run` resolve the config
(defaults < config file or mapping < the strategy's keys < keyword arguments), check it,
warn about keys the run ignores, and start the run. Errors are the command's, raised
(`ConfigError` for bad input, before any process starts, `DataError`, ...), never an exit.

A model or data set reaches every process of a run by name, as on the command line: a
spec string (`mlp`, `digits`, `my_model.py:build`, `package.module:build`), or a function
(or class) defined at module level, which `factory_spec` turns into its spec. What
cannot be imported by name in another process (a lambda, a nested function, a bound
method, a model instance) is refused with one line saying what to do instead.

`fit` and `compare` take keyword arguments, as Hugging Face's `Trainer` does: those
keywords are the user-facing surface, so they stay keywords (the one exception to the
project's rule of at most six parameters, which elsewhere a typed value carries).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from disttrain.cli.flags import CONFIG_PREFIX
from disttrain.comparison.plan import COMPRESSIONS, DDP_ONLY, DEFAULT_STRATEGIES, STRATEGIES
from disttrain.config import SYSTEM_ALIASES, Config
from disttrain.config.loading import canonical_key, flatten
from disttrain.config.schema import SECTIONS
from disttrain.core.errors import ConfigError
from disttrain.data.plugins import PLUGIN_PREFIX

if TYPE_CHECKING:
    from disttrain.metrics.summary import RunSummary

__all__ = ["compare", "factory_spec", "fit"]

COMMANDS = ("baseline", "ps", "ddp")  # the commands that train, run by their own names
FIT_STRATEGIES = (f"{', '.join(dict.fromkeys(['baseline', 'ps', *STRATEGIES]))}; each but baseline "
                  f"optionally +{', +'.join(sorted(set(COMPRESSIONS) - DDP_ONLY))}, or "
                  f"+{', +'.join(sorted(DDP_ONLY))} with ddp (e.g. ps-sync+topk)")
# The keys whose values name a factory: a function given there becomes its spec.
FACTORY_KEYS = ("training.model_architecture", "training.dataset")

Factory = Callable[..., Any]


def fit(model: str | Factory | None = None, data: str | Factory | None = None, *,
        strategy: str = "baseline", workers: int | None = None, epochs: int | None = None,
        config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
        resume: bool = False, **settings: Any) -> RunSummary | None:
    """Train `model` on `data` under `strategy`; the run's summary.

    Blocks until the run ends. The run writes what the command writes (metrics,
    TensorBoard events, checkpoints, the final model, summary.json) under
    `system.log_dir` and `system.checkpoint_dir` (`logs/` and `checkpoints/` of the
    current folder unless set). The baseline trains in this process (and sets its torch
    threads, `system.num_threads`); `ps` and `ddp` start their processes on this machine
    and wait for them.

    Args:
        model: `training.model_architecture`: a spec string as `--model` takes it, or a
            function or class defined at module level, called in every process as
            `model(description, **training.model_args)`. None: the config's.
        data: `training.dataset`: a spec string as `--dataset` takes it, or a function
            defined at module level returning `(train, test, description)`, called as
            `data(**training.dataset_args)`. None: the config's.
        strategy: `baseline`, `ps` (the config's aggregation mode), `ddp`, or a name of
            `disttrain compare`'s: `ps-sync`, `ps-ssp`, `ps-async`, each but `baseline`
            optionally `+topk`, `+int8`, `+fp16`, `+bf16` (`+powersgd` with `ddp`).
        workers: `system.num_workers` (PS workers, DDP ranks). None: the config's.
        epochs: `training.num_epochs`. None: the config's.
        config: a config file, the name of a shipped config (`disttrain configs`), a
            mapping of sections (`{"training": {"batch_size": 32}}`) or a `Config`.
        resume: continue from the newest checkpoint in `system.checkpoint_dir`.
        **settings: config keys on top of everything else: a section as a mapping
            (`training={"batch_size": 32}`), a key by its name when one section has it
            (`batch_size=32`), or a flag of the strategy's command with underscores
            (`servers=2`, `max_train_samples=256`). A function given to a key that names
            a factory (`dataset=`, `model_architecture=`) becomes its spec.

    Returns:
        The run's summary (what summary.json holds): `final_accuracy`, `final_loss`,
        `samples_processed`, `steps`, times, throughput, and strategy figures in `extra`
        (`samples_applied` of a parameter-server run). None only on a node of a DDP run
        over several nodes whose rank 0 is on another node.

    Raises:
        ConfigError: bad input, before any process starts: an unknown strategy, key or
            value, a factory that cannot be named (see `factory_spec`) or that fails, a
            model that cannot take the data.
        DataError, DisttrainError: what the command's run raises (the CLI's exit code is
            the error's `exit_code`).
    """
    command, strategy_keys = strategy_settings(strategy)
    module, args = command_args(command, config, strategy_keys,
                                {**_named(model, data, workers, epochs), **settings})
    args.resume = resume
    return module.run(args)


def compare(model: str | Factory | None = None, data: str | Factory | None = None, *,
            output_dir: str | os.PathLike[str], strategies: str | Sequence[str] = DEFAULT_STRATEGIES,
            workers: int | None = None, epochs: int | None = None,
            config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
            timeout_per_run_s: float = 3600.0, **settings: Any) -> dict[str, RunSummary]:
    """Train `model` on `data` under each strategy in turn, as `disttrain compare` does,
    and write its report (report.html, report.md, report.json, plots) in `output_dir`.

    Prints the comparison's table and the report's path, as the command does.

    Args:
        output_dir: where the runs and the report go (`<output_dir>/<strategy>/` each);
            must not hold a comparison already.
        strategies: names as `--strategies` takes them (`baseline`, `ps-sync`, `ps-ssp`,
            `ps-async`, `ddp`, each but baseline optionally `+topk`...), a list or one
            comma-separated string.
        timeout_per_run_s: a run still going after this long is stopped and failed.
        model, data, workers, epochs, config, settings: as `fit` takes them (`workers`:
            of every parallel run; the baseline has one process).

    Returns:
        Each run's summary, by strategy name, in the order they ran.

    Raises:
        ConfigError: bad input, before any run starts (as `fit`).
        DisttrainError: a run failed; the others ran, and the report holds them all.
    """
    from disttrain.comparison.runner import MANIFEST
    from disttrain.metrics.summary import RunSummary
    module, args = command_args("compare", config, {},
                                {**_named(model, data, workers, epochs), **settings})
    args.output_dir = os.fspath(output_dir)
    args.strategies = strategies if isinstance(strategies, str) else ",".join(strategies)
    args.timeout_per_run = timeout_per_run_s
    module.run(args)
    runs = json.loads((Path(args.output_dir) / MANIFEST).read_text())["runs"]
    return {run["name"]: RunSummary.read(Path(args.output_dir) / run["log_dir"] / "summary.json")
            for run in runs}


def _named(model: Any, data: Any, workers: int | None, epochs: int | None) -> dict[str, Any]:
    """fit's and compare's own arguments that were given (None: the config's)."""
    named = {"model": model, "data": data, "workers": workers, "epochs": epochs}
    return {word: value for word, value in named.items() if value is not None}


def command_args(command: str, config: Any, strategy_keys: Mapping[str, Any],
                 given: Mapping[str, Any]) -> tuple[ModuleType, argparse.Namespace]:
    """The module of `disttrain COMMAND` and the flags its parser would make of `config`,
    the strategy's keys and the keywords `given`.

    Raises:
        ConfigError: see `config_layer` and `resolve_keys`.
    """
    module = importlib.import_module(f"disttrain.cli.{command}")
    parser = command_parser(module)
    args = parser.parse_args([])  # every flag at its default; a config flag at None
    args.config, config_keys = config_layer(config)
    keys = {**config_keys, **strategy_keys, **resolve_keys(given, config_flags(parser))}
    for key, value in keys.items():
        setattr(args, CONFIG_PREFIX + key, value)
    return module, args


def strategy_settings(name: str) -> tuple[str, dict[str, Any]]:
    """The command a strategy name runs (baseline, ps or ddp) and the config keys the name
    sets: `ps-async` is `ps` with `ps.aggregation_mode: async`; `+topk` turns on that
    gradient compression. A bare command sets nothing, so the config's keys stand.

    Raises:
        ConfigError: an unknown name, or a compression the strategy lacks.
    """
    if not isinstance(name, str):
        raise ConfigError(f"strategy: {name!r} is not a strategy's name; use one of {FIT_STRATEGIES}")
    base, plus, compression = name.strip().partition("+")
    if (base not in COMMANDS and base not in STRATEGIES) or (plus and compression not in COMPRESSIONS):
        raise ConfigError(f"strategy: unknown strategy {name!r}; use one of {FIT_STRATEGIES}")
    if plus and base == "baseline":
        raise ConfigError(f"strategy: {name!r}: the baseline sends no gradients to compress")
    command, keys = (base, {}) if base in COMMANDS else STRATEGIES[base]
    if compression in DDP_ONLY and command != "ddp":
        raise ConfigError(f"strategy: {name!r}: {compression} compresses DDP's all-reduce only; "
                          f"use ddp+{compression}, or {base}+topk")
    settings: dict[str, Any] = dict(keys)
    if plus:
        settings.update({"compression.enabled": True, "compression.type": COMPRESSIONS[compression]})
    return command, settings


def command_parser(command_module: ModuleType) -> argparse.ArgumentParser:
    """The parser of a `disttrain` command (`command_module`, one of `disttrain.cli`'s)."""
    parser = argparse.ArgumentParser(prog=f"disttrain {command_module.__name__.rpartition('.')[2]}")
    command_module.add_arguments(parser)
    return parser


def config_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[str, Any]]:
    """The parser's config flags as keyword arguments (`--max-train-samples` ->
    `max_train_samples`): each word -> (the config key it sets, the value a switch sets it
    to, or None for a flag that takes a value)."""
    flags: dict[str, tuple[str, Any]] = {}
    for action in parser._actions:  # argparse keeps its actions there (shtab reads them too)
        if not action.dest.startswith(CONFIG_PREFIX):
            continue
        key = action.dest[len(CONFIG_PREFIX):]
        for option in action.option_strings:
            if option.startswith("--"):
                flags[option[2:].replace("-", "_")] = (key, action.const if action.nargs == 0 else None)
    return flags


def config_layer(config: Any) -> tuple[str | None, dict[str, Any]]:
    """`--config`'s value for a file or a shipped config's name; else (None, the keys of a
    mapping of sections or of a `Config`, as canonical dotted keys).

    Raises:
        ConfigError: neither a path nor a mapping; a section that is not a mapping or not
            known.
    """
    if config is None:
        return None, {}
    if isinstance(config, str | os.PathLike):
        return os.fspath(config), {}
    if isinstance(config, Config):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ConfigError(f"config: a {type(config).__name__} is not a config; give a file, the name of "
                          f"a shipped config, or a mapping of sections ({', '.join(SECTIONS)})")
    flat, _, problems = flatten(dict(config), "config")
    if problems:
        raise ConfigError(problems)
    return None, {key: factory_spec(value, f"config[{key!r}]") if key in FACTORY_KEYS
                  else os.fspath(value) if isinstance(value, os.PathLike) else value
                  for key, value in flat.items()}


# fit's own words for keys, beside the sections, the command's flags and the key names.
NAMED = {"model": "training.model_architecture", "data": "training.dataset",
         "workers": "system.num_workers", "epochs": "training.num_epochs"}


def resolve_keys(given: Mapping[str, Any], flags: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """Keyword arguments as canonical dotted config keys.

    A word is one of fit's (`model`, `data`, `workers`, `epochs`), a section given as a
    mapping of its keys, a flag of the command (`flags`, from `config_flags`; a switch
    takes True), or a key that one section alone has (`batch_size`, `staleness`). A
    function given to a key that names a factory becomes its spec (`factory_spec`).

    Raises:
        ConfigError: one line per problem: an unknown word (with the closest known one), a
            key of several sections, a section that is not a mapping, a switch given other
            than True or False, a key given twice with two values, a factory that cannot
            be named.
    """
    owners = _key_owners()
    keys: dict[str, Any] = {}
    said: dict[str, str] = {}  # key -> the word that set it, for errors
    problems: list[str] = []

    def put(dotted: str, value: Any, word: str) -> None:
        dotted = canonical_key(dotted)
        value = os.fspath(value) if isinstance(value, os.PathLike) else value  # a folder as a Path
        if dotted in FACTORY_KEYS and not isinstance(value, str):
            try:
                value = factory_spec(value, word)
            except ConfigError as e:
                problems.extend(e.problems)
                return
        if dotted in keys and keys[dotted] != value:
            problems.append(f"{word}: sets {dotted}, which {said[dotted]} sets to {keys[dotted]!r} "
                            "already; give it once")
            return
        keys[dotted], said[dotted] = value, word

    for word, value in given.items():
        if word in NAMED:
            put(NAMED[word], value, word)
        elif word in SECTIONS:
            if not isinstance(value, Mapping):
                problems.append(f"{word}: expected a mapping of its keys, e.g. {word}={{...}}; "
                                f"got {value!r}")
                continue
            for key, item in value.items():
                put(f"{word}.{key}", item, f"{word}[{key!r}]")
        elif word in flags:
            key, switched = flags[word]
            if switched is None:
                put(key, value, word)
            elif value is True:
                put(key, switched, word)
            elif value is not False:
                problems.append(f"{word}: a switch (--{word.replace('_', '-')}); give True or False, "
                                f"not {value!r}")
        elif len(owners.get(word, ())) == 1:
            put(owners[word][0], value, word)
        elif word in owners:
            sections = [dotted.partition(".")[0] for dotted in owners[word]]
            problems.append(f"{word}: a key of several sections ({', '.join(sections)}); give it as "
                            f"{sections[0]}={{{word!r}: ...}}")
        else:
            known = [*NAMED, *SECTIONS, *flags, *owners]
            close = difflib.get_close_matches(word, known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            problems.append(f"{word}: unknown config key, section or flag; {hint}(a key by its name, "
                            f"e.g. batch_size=32, or by its section, e.g. training={{'batch_size': 32}})")
    if problems:
        raise ConfigError(problems)
    return keys


@functools.cache
def _key_owners() -> dict[str, tuple[str, ...]]:
    """Each key name -> the dotted keys of that name, over every section (the original
    config's `system.` spellings count as their owners' keys)."""
    owners: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            owners.setdefault(field.name, []).append(f"{section}.{field.name}")
    for alias, dotted in SYSTEM_ALIASES.items():
        owners.setdefault(alias, [dotted])
    return {name: tuple(keys) for name, keys in owners.items()}


def factory_spec(factory: Any, key: str = "model",
                 importable: Callable[[ModuleType], bool] | None = None) -> str:
    """The spec every process of a run finds `factory` by: `module:name` for a function or
    class of a module other processes import by that name, else `PATH.py:name` of its
    source file (a script's `__main__`, a file imported from a folder only this process
    has on its path). A string is returned as it is.

    Args:
        key: what the factory was given as (`model`, `data`), for errors.
        importable: whether a fresh process imports a module by its name to the same file
            (default: `importable_elsewhere`, which asks one).
    Raises:
        ConfigError: one line naming the object and what to do instead: a lambda, a
            function defined inside another, a method, a callable object or a model
            instance, a function no longer its module's attribute of that name, one
            defined where no file holds it (an interactive session).
    """
    if isinstance(factory, str):
        return factory
    refusal = _refusal(factory, key)
    if refusal:
        raise ConfigError(refusal)
    name, module = factory.__name__, sys.modules.get(factory.__module__)
    if module is None or getattr(module, name, None) is not factory:
        raise ConfigError(f"{key}: {factory.__module__}.{name} is not what its module holds under "
                          f"that name (renamed, redefined or deleted), so other processes cannot "
                          f"import it; pass the module's own {name}")
    importable = importable or importable_elsewhere
    module_name = module.__name__
    if module_name == "__main__":  # `python -m package.module` still has its importable name
        module_name = getattr(getattr(module, "__spec__", None), "name", None) or "__main__"
    if module_name != "__main__" and not module_name.startswith(PLUGIN_PREFIX) and importable(module):
        return f"{module_name}:{name}"
    source = getattr(module, "__file__", None)
    if not source or not source.endswith(".py"):
        where = f"in {source}" if source else "where no file holds it (an interactive session?)"
        raise ConfigError(f"{key}: {name} is defined {where}, which other processes cannot import; "
                          f"define it in a .py file and import it from there")
    return f"{Path(source).resolve()}:{name}"


def _refusal(factory: Any, key: str) -> str | None:
    """The line refusing `factory`, or None when it is a function or class named at module
    level."""
    torch = sys.modules.get("torch")  # without torch imported, nothing is a module instance
    if torch is not None and isinstance(factory, torch.nn.Module):
        return (f"{key}: a {type(factory).__name__} instance cannot reach the other processes of a run; "
                f"pass the function or class that builds it, defined at module level (called as "
                f"factory(description, **training.model_args) in every process)")
    if inspect.ismethod(factory):
        return (f"{key}: the bound method {factory.__qualname__} cannot be imported by other processes; "
                f"define the factory as a function at module level and pass that")
    if not (inspect.isfunction(factory) or inspect.isclass(factory)):
        what = "callable " if callable(factory) else ""
        return (f"{key}: a {what}{type(factory).__name__} object is neither a spec string nor a "
                f"function; pass a spec (e.g. my_model.py:build) or a function defined at module level "
                f"(its arguments go in training.model_args or training.dataset_args)")
    where = _place(factory)
    if factory.__name__ == "<lambda>":
        return (f"{key}: a lambda{where} cannot be imported by other processes; define it at module "
                f"level (def name(...)) and pass that function")
    if "<locals>" in factory.__qualname__:
        outer = factory.__qualname__.split(".<locals>")[0]
        return (f"{key}: {factory.__name__}{where} is defined inside {outer}, so other processes cannot "
                f"import it; define it at module level and pass that function")
    if "." in factory.__qualname__:
        return (f"{key}: {factory.__qualname__}{where} is an attribute of a class, which a spec cannot "
                f"name; define a function at module level that calls it and pass that")
    return None


def _place(factory: Any) -> str:
    """` (at FILE:LINE)` of a function's definition; "" when unknown."""
    code = getattr(factory, "__code__", None)
    if code is None:
        return ""
    file = code.co_filename
    shown = os.path.relpath(file) if file.startswith(os.getcwd() + os.sep) else file
    return f" (at {shown}:{code.co_firstlineno})"


def importable_elsewhere(module: ModuleType) -> bool:
    """Whether a fresh Python process (as a run starts its workers and ranks: this
    interpreter, this environment, this folder) imports `module` by its name from the
    same place as this one did. Not when this process found it on a path of its own
    making (a folder put on `sys.path` by a test runner, a script's folder)."""
    top = module.__name__.partition(".")[0]
    here = sys.modules.get(top)
    spec = getattr(here, "__spec__", None)
    if spec is None:
        return False
    return (_fresh_location(top, os.getcwd(), os.environ.get("PYTHONPATH"))
            == _location(spec.origin, spec.submodule_search_locations))


_FIND = ("import importlib.util, json, sys\n"
         "s = importlib.util.find_spec(sys.argv[1])\n"
         "print(json.dumps(None if s is None else [s.origin, list(s.submodule_search_locations or [])]))")


@functools.cache
def _fresh_location(top: str, cwd: str, pythonpath: str | None) -> tuple[str | None, tuple[str, ...]] | None:
    """Where a fresh process started in `cwd` with `pythonpath` finds top-level module
    `top` (asked, not imported: a top-level name's spec is found without running any
    module); None when it does not."""
    try:
        done = subprocess.run([sys.executable, "-c", _FIND, top], capture_output=True, text=True,
                              timeout=60, check=False)
        found = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return None if found is None else _location(found[0], found[1])


def _location(origin: str | None, locations: Any) -> tuple[str | None, tuple[str, ...]]:
    def real(path: str) -> str:
        return str(Path(path).resolve())
    return (real(origin) if origin and os.path.isabs(origin) else origin,
            tuple(real(path) for path in (locations or ())))
