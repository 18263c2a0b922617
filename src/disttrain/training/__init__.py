"""Training shared by every strategy: models, the step and evaluation (`engine`), one
seeding rule, the training loop, and the contracts a strategy fulfils (`strategy`).

Its face, for scripts and users: building a model, one step's forward and backward, the
optimizer, and the options a run takes. The names load on first use: the command line
imports `training.options` to build its parser, and `disttrain --help` must not load
torch, which `engine` and `models` do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrain.training.engine import StepResult, build_optimizer, forward_backward
    from disttrain.training.models import build_model, init_model
    from disttrain.training.options import RunOptions

__all__ = ["RunOptions", "StepResult", "build_model", "build_optimizer", "forward_backward", "init_model"]

_HOMES = {
    "RunOptions": "disttrain.training.options",
    "StepResult": "disttrain.training.engine",
    "build_model": "disttrain.training.models",
    "build_optimizer": "disttrain.training.engine",
    "forward_backward": "disttrain.training.engine",
    "init_model": "disttrain.training.models",
}


def __getattr__(name: str) -> Any:
    """A name of the face, imported from its module on first use (PEP 562).

    Raises:
        AttributeError: `name` is not in `__all__`.
    """
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
