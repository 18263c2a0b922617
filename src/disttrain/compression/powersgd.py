"""PowerSGD state kept by parameter, so that it survives DDP cutting its buckets anew.

PyTorch's `powerSGD_hook` keeps its state (each rank's error feedback, the warm-start P
and Q matrices) per bucket index. A bucket index does not name the same gradients for
long: DDP rebuilds its buckets after the first iteration (in the order gradients became
ready), and a resumed run's first step has the initial buckets again. `PowerSGDBuckets`
records the layout (parameter names and shapes) each index's state was made for; when a
bucket arrives with another layout, the state of every bucket sharing a parameter with it
is split into per-parameter pieces, and the new bucket's state is assembled from them.
PowerSGD's arithmetic is per tensor (P = MQ, orthogonalisation, Q = M^T P, M ~ PQ^T;
sums over ranks element by element), so the grouping into buckets does not change a
single value: a resumed run goes on bit for bit (with two ranks; with more, a ring
all-reduce may add ranks in another order where a tensor sits elsewhere in the bucket).
A piece whose size does not fit (a checkpoint of another `powersgd_rank`) is dropped,
and PowerSGD starts that bucket afresh, as it does in a run's first compressed step.

`state_dict` holds tensors only (for a `weights_only` checkpoint), with the same names
and shapes on every rank, so the ranks' states can be all-gathered.

`powersgd_hook_for` picks the hook for a bucket's device: PyTorch's own hook synchronizes
CUDA whenever CUDA is available, whatever device the bucket is on, which fails for a bucket
in host memory on a machine with a GPU (gloo on the CPU there, the CPU rank of a mixed group).
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    _should_compress,
    powerSGD_hook,
)

from disttrain.config import CompressionConfig

logger = logging.getLogger(__name__)

# The first two iterations all-reduce plainly: DDP rebuilds its buckets after the first,
# and PyTorch refuses less with error feedback or warm start.
START_ITERATION = 2

Layout = tuple[tuple[str, tuple[int, ...]], ...]  # a bucket's (parameter name, shape), in order


class _NoDevice:
    """A device module of torch (`torch.cuda`, `torch.accelerator`) that says none is available."""

    def __init__(self, module: types.ModuleType):
        self._module = module

    @staticmethod
    def is_available() -> bool:
        return False

    def __getattr__(self, name: str):
        return getattr(self._module, name)


class _HostTorch:
    """`torch` as the hook of a bucket in host memory should see it: no device available.
    PyTorch's `powerSGD_hook` calls `torch.cuda.synchronize(bucket device)` when
    `torch.cuda.is_available()` (a proposed change upstream asks `torch.accelerator` the same,
    hidden here too), and a CPU device makes that raise. A host bucket has nothing to wait for."""

    def __init__(self) -> None:
        self.cuda = _NoDevice(torch.cuda)
        if hasattr(torch, "accelerator"):  # torch 2.6 and later
            self.accelerator = _NoDevice(torch.accelerator)

    def __getattr__(self, name: str):
        return getattr(torch, name)


# PyTorch's own function (one algorithm, kept by PyTorch) with `torch` in its globals bound
# to the host view: the callbacks it makes (`decompress` holds the synchronize) take their
# globals from it, so they see the same view.
_HOST_POWERSGD_HOOK = types.FunctionType(
    powerSGD_hook.__code__, {**powerSGD_hook.__globals__, "torch": _HostTorch()}, powerSGD_hook.__name__,
    powerSGD_hook.__defaults__, powerSGD_hook.__closure__)


def powersgd_hook_for(device: torch.device):
    """PyTorch's `powerSGD_hook` for a bucket on `device`: as it is for a device's memory,
    and for host memory one that never synchronizes a device (which raised there)."""
    return _HOST_POWERSGD_HOOK if device.type == "cpu" else powerSGD_hook


@dataclass(frozen=True)
class TensorPlan:
    """How `powerSGD_hook` treats one gradient of a bucket."""

    name: str
    numel: int
    rows: int
    cols: int
    rank: int  # 0: all-reduced uncompressed
    p_offset: int = 0  # where its P and Q sit in the bucket's P and Q memory
    q_offset: int = 0

    @property
    def sent_numel(self) -> int:
        """Elements this gradient puts into the collectives: P and Q, or itself."""
        return (self.rows + self.cols) * self.rank if self.rank else self.numel


def plan_bucket(layout: Layout, rank: int, min_compression_rate: float) -> list[TensorPlan]:
    """What `powerSGD_hook` does with each gradient of a bucket, by its own rules: each
    gradient is viewed as a `(shape[0], -1)` matrix and compressed at rank
    `min(rows, cols, rank)` where its `_should_compress` says so (step I of the hook); the
    P and Q memory holds the compressed matrices grouped by matrix shape, the groups in
    order of first appearance (step III)."""
    plans, groups = [], {}
    for name, shape in layout:
        numel = math.prod(shape)
        rows = shape[0] if shape else 1
        cols = numel // rows if rows else 0
        matrix_rank = min(rows, cols, rank)
        worth = rows > 0 and _should_compress(rows, cols, matrix_rank, min_compression_rate)[0]
        plans.append(TensorPlan(name, numel, rows, cols, matrix_rank if worth else 0))
        if worth:
            groups.setdefault((rows, cols), []).append(len(plans) - 1)
    p_offset = q_offset = 0
    for members in groups.values():
        for i in members:
            t = plans[i]
            plans[i] = TensorPlan(t.name, t.numel, t.rows, t.cols, t.rank, p_offset, q_offset)
            p_offset += t.rows * t.rank
            q_offset += t.cols * t.rank
    return plans


@dataclass
class Pieces:
    """Per-parameter state: error feedback, P and Q (empty for an uncompressed gradient)."""

    errors: dict[str, torch.Tensor] = field(default_factory=dict)
    ps: dict[str, torch.Tensor] = field(default_factory=dict)
    qs: dict[str, torch.Tensor] = field(default_factory=dict)

    def categories(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"error": self.errors, "p": self.ps, "q": self.qs}


def _spans(plan: Sequence[TensorPlan]) -> dict[str, list[tuple[str, int, int]]]:
    """Per category, each gradient's (name, offset, length) in the bucket's flat tensor."""
    errors, offset = [], 0
    for t in plan:
        errors.append((t.name, offset, t.numel))
        offset += t.numel
    return {"error": errors, "p": [(t.name, t.p_offset, t.rows * t.rank) for t in plan],
            "q": [(t.name, t.q_offset, t.cols * t.rank) for t in plan]}


def split(plan: Sequence[TensorPlan], flats: Mapping[str, torch.Tensor | None], into: Pieces) -> None:
    """Cut a bucket's flat state (`error`, `p`, `q`; None where absent) into `into`."""
    pieces = into.categories()
    for category, spans in _spans(plan).items():
        flat = flats.get(category)
        if flat is not None:
            for name, offset, length in spans:
                pieces[category][name] = flat[offset:offset + length].clone()


def assemble(plan: Sequence[TensorPlan], pieces: Pieces, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """The bucket's flat state from `pieces`, for each category every gradient of the
    bucket has a fitting piece of; the pieces used are taken out of `pieces`."""
    flats = {}
    for category, spans in _spans(plan).items():
        found = pieces.categories()[category]
        if not all(name in found for name, _, _ in spans):
            continue
        if any(found[name].numel() != length for name, _, length in spans):
            logger.warning("saved PowerSGD %s state does not fit the bucket (another powersgd_rank?); "
                           "starting it afresh", category)
            continue
        flat = torch.empty(sum(length for _, _, length in spans), dtype=like.dtype, device=like.device)
        for name, offset, length in spans:
            flat[offset:offset + length] = found.pop(name).view(-1)
        flats[category] = flat
    return flats


class PowerSGDBuckets:
    """PyTorch's `PowerSGDState`, its per-bucket entries kept in step with DDP's buckets.

    Call `fit` at the start of each hook call, before `powerSGD_hook`; all on one thread
    (DDP's autograd thread).
    """

    def __init__(self, section: CompressionConfig, seed: int):
        # The seed draws the random start of Q, which must be the same on every rank.
        self.state = PowerSGDState(process_group=None, matrix_approximation_rank=section.powersgd_rank,
                                   start_powerSGD_iter=START_ITERATION,
                                   use_error_feedback=section.error_feedback, warm_start=True,
                                   random_seed=seed)
        self.layouts: dict[int, tuple[Layout, list[TensorPlan]]] = {}
        self.pending = Pieces()

    @property
    def compressing(self) -> bool:
        """Whether the next hook call compresses (after the plain all-reduce iterations)."""
        return self.state.iter >= self.state.start_powerSGD_iter

    def fit(self, index: int, layout: Layout, buffer: torch.Tensor) -> list[TensorPlan]:
        """Make bucket `index`'s entries match `layout`; returns its plan."""
        known = self.layouts.get(index)
        if known is not None and known[0] == layout:
            return known[1]
        names = {name for name, _ in layout}
        for stale in [i for i, (old, _) in self.layouts.items()
                      if i == index or names & {name for name, _ in old}]:
            self._take_apart(stale)
        plan = plan_bucket(layout, self.state.matrix_approximation_rank, self.state.min_compression_rate)
        self.layouts[index] = (layout, plan)
        flats = assemble(plan, self.pending, buffer)
        for category, entries in self._entries().items():
            if category in flats and (category == "error" or {"p", "q"} <= flats.keys()):
                entries[index] = flats[category]
        return plan

    def _entries(self) -> dict[str, dict[int, torch.Tensor]]:
        s = self.state
        return {"error": s.error_dict, "p": s.p_memory_dict, "q": s.q_memory_dict}

    def _take_apart(self, index: int) -> None:
        _, plan = self.layouts.pop(index)
        split(plan, {category: entries.pop(index, None) for category, entries in self._entries().items()},
              self.pending)

    def state_dict(self) -> dict[str, torch.Tensor]:
        pieces = Pieces(dict(self.pending.errors), dict(self.pending.ps), dict(self.pending.qs))
        for index, (_, plan) in self.layouts.items():
            split(plan, {category: entries.get(index) for category, entries in self._entries().items()},
                  pieces)
        s = self.state
        _, key, pos, has_gauss, cached = s.rng.get_state()
        tensors = {
            "iter": torch.tensor([s.iter, s.total_numel_before_compression,
                                  s.total_numel_after_compression, s.next_stats_report], dtype=torch.int64),
            "rng_key": torch.from_numpy(key.astype(np.int64)),
            "rng_misc": torch.tensor([pos, has_gauss, cached], dtype=torch.float64),
        }
        for category, found in pieces.categories().items():
            tensors.update({f"{category}/{name}": value for name, value in found.items()})
        return tensors

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        s = self.state
        s.iter, s.total_numel_before_compression, s.total_numel_after_compression, s.next_stats_report = (
            int(v) for v in tensors["iter"].tolist())
        pos, has_gauss, cached = tensors["rng_misc"].tolist()
        s.rng.set_state(("MT19937", tensors["rng_key"].numpy().astype(np.uint32), int(pos), int(has_gauss),
                         float(cached)))
        for entries in self._entries().values():
            entries.clear()
        self.layouts.clear()
        self.pending = Pieces()
        for category, found in self.pending.categories().items():
            prefix = f"{category}/"
            found.update({k[len(prefix):]: v.clone() for k, v in tensors.items() if k.startswith(prefix)})
