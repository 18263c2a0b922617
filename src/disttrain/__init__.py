"""disttrain: train one PyTorch model four ways and measure what each strategy costs.

The Python API (`disttrain.fit` and `disttrain.compare`, see `disttrain.api`) loads on first
use, so that `import disttrain` (every command line starts with it) stays as light as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it, imported when the name is first asked for
_LAZY = {"fit": "disttrain.api", "compare": "disttrain.api", "factory_spec": "disttrain.api",
         "RunSummary": "disttrain.metrics.summary", "ConfigError": "disttrain.core.errors",
         "DataError": "disttrain.core.errors", "DisttrainError": "disttrain.core.errors"}

__all__ = ["ConfigError", "DataError", "DisttrainError", "RunSummary", "__version__", "compare",
           "factory_spec", "fit"]

if TYPE_CHECKING:
    from disttrain.api import compare, factory_spec, fit
    from disttrain.core.errors import ConfigError, DataError, DisttrainError
    from disttrain.metrics.summary import RunSummary


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'disttrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
