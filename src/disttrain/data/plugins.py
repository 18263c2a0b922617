"""Finding a user's factory: `PATH.py:NAME`, `package.module:NAME`, or a name that an
installed package registers in an entry-point group (`disttrain.models`,
`disttrain.datasets`).

Both the model and the data-set plug-ins come through here, so they spell, find and fail
alike: every failure is one `ConfigError` line naming the config key, what was looked for
and where, and how to fix it (the CLI exits 2 before anything starts).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from disttrain.core.errors import ConfigError

MODEL_GROUP = "disttrain.models"
DATASET_GROUP = "disttrain.datasets"
COLLATE_GROUP = "disttrain.collate"
LOSS_GROUP = "disttrain.losses"
PLUGIN_PREFIX = "disttrain_plugin_"  # the module names a user's files are imported under


def is_factory_spec(spec: str) -> bool:
    """Whether `spec` names a factory by place (`PATH.py:NAME` or `module:NAME`), not by a
    registered or entry-point name."""
    where, sep, name = spec.rpartition(":")
    return bool(sep and where and name)


def entry_point_names(group: str) -> list[str]:
    """The names installed packages register in entry-point `group`, sorted."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=group)})


def load_factory(spec: str, key: str, group: str) -> Callable[..., Any]:
    """The callable `spec` names: `PATH.py:NAME`, `module:NAME`, or an entry point's name
    in `group`.

    Args:
        key: the config key the spec came from (`training.model_architecture`), for errors.

    Raises:
        ConfigError: the file or module is missing or fails to import, the name is not in
            it or is not callable, or no entry point has that name.
    """
    if not is_factory_spec(spec):
        return _from_entry_point(spec, key, group)
    where, _, name = spec.rpartition(":")
    module = _import_file(where, key) if where.endswith(".py") else _import_module(where, key)
    factory = getattr(module, name, None)
    if factory is None:
        raise ConfigError(f"{key}: {where} has no {name!r}; define `def {name}(...)` there or "
                          "name another factory after the colon")
    if not callable(factory):
        raise ConfigError(f"{key}: {spec} is a {type(factory).__name__}, not a callable factory")
    return factory


def _import_file(path: str, key: str) -> ModuleType:
    """Import the Python file at `path` once per process, under a name made from its
    absolute path (so two files named model.py do not clash)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"{key}: file {path} does not exist (looked for {file}); give the path of "
                          "a Python file, e.g. my_model.py:build")
    module_name = PLUGIN_PREFIX + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    try:
        return import_plugin_file(module_name, str(file))
    except Exception as e:  # the user's file: any error it raises is theirs to see
        raise ConfigError(f"{key}: importing {path} failed: {one_line(e)}{user_frame(e)}") from e


def import_plugin_file(module_name: str, path: str) -> ModuleType:
    """Import the file at `path` as `module_name`, once per process (a failed import leaves
    no module behind). Its folder goes first on `sys.path`, as Python puts a script's, so
    that it imports the modules beside it, in every process that imports it."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    folder = str(Path(path).parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def imported_plugin_files() -> list[tuple[str, str]]:
    """(module name, path) of every user's file imported in this process, sorted: what a
    spawned process must import again before it can unpickle objects of their classes."""
    return sorted((name, module.__file__) for name, module in list(sys.modules.items())
                  if name.startswith(PLUGIN_PREFIX) and getattr(module, "__file__", None))


def _import_module(name: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(f"{key}: no module named {name!r}; install the package that provides it "
                              "or give a file, e.g. path/to/file.py:factory") from e
        raise ConfigError(f"{key}: importing {name} failed: {one_line(e)}") from e
    except Exception as e:  # the user's module: any error it raises is theirs to see
        raise ConfigError(f"{key}: importing {name} failed: {one_line(e)}") from e


def _from_entry_point(name: str, key: str, group: str) -> Callable[..., Any]:
    found = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == name]
    if not found:
        raise ConfigError(f"{key}: {name!r} is not a known name nor an entry point of group {group!r} "
                          "(spell a factory as PATH.py:NAME or module:NAME)")
    try:
        return found[0].load()
    except Exception as e:  # the installed package's error
        raise ConfigError(f"{key}: entry point {name!r} ({found[0].value}) cannot be loaded: "
                          f"{one_line(e)}") from e


def call_factory(factory: Callable[..., Any], spec: str, key: str, *args: Any, **kwargs: Any) -> Any:
    """`factory(*args, **kwargs)`, its failure turned into a one-line ConfigError that shows
    its message.

    Raises:
        ConfigError: the factory raised.
    """
    try:
        return factory(*args, **kwargs)
    except ConfigError:  # already one line that names the key (a builder's own check)
        raise
    except Exception as e:  # the user's factory: its message and its place are the useful part
        raise ConfigError(f"{key}: {spec} raised {one_line(e)}{user_frame(e)}") from e


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, for an error of code not ours shown in one line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


_OURS = str(Path(__file__).resolve().parents[1])  # the disttrain package
_INSTALLED = tuple(str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})


def user_frame(error: BaseException) -> str:
    """` (at FILE:LINE, in FUNCTION)`: the innermost place of `error`'s traceback in the
    user's code (neither disttrain's nor an installed package's nor Python's), where a
    factory's bug is; "" when there is none."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        file = str(Path(frame.filename).resolve())
        if frame.filename.startswith("<") or file.startswith(_OURS) or file.startswith(_INSTALLED):
            continue
        shown = os.path.relpath(file) if file.startswith(os.getcwd() + os.sep) else file
        return f" (at {shown}:{frame.lineno}, in {frame.name})"
    return ""
