"""A rank's place in the run and its process group.

Decides the backend (with `auto`, the one the ranks agree on through the rendezvous store:
NCCL when every rank has a GPU, gloo otherwise; see `agreement`) and the one device of
each rank, sets the rank's thread count, starts the process group with a timeout, and
tears it down with a barrier first: without that barrier a gloo rank that leaves while its
peer still talks was seen to abort at exit about one run in twenty. (A rank process then
leaves without the interpreter's shutdown: see `cli.ddp.module_main`.)

The selection functions are pure (the CUDA facts are passed in), so their rules are
tested on machines without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from disttrain.config import Config, DDPConfig
from disttrain.core.errors import ConfigError, DistributedError
from disttrain.strategies.ddp.agreement import decide_backend, exchange_flags, has_own_gpu, store_prefix
from disttrain.training.engine import configure_process

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Variables the elastic agent (torchrun or `disttrain ddp`) sets for every rank.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankInfo:
    """Who this process is: global and local rank, and which restart attempt it belongs to."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart_count: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RankInfo:
        """Read the rank variables the elastic agent sets.

        Raises:
            DistributedError: a variable is missing or not an integer (not started by torchrun).
        """
        missing = [name for name in RANK_VARIABLES if name not in env]
        if missing:
            raise DistributedError(f"{', '.join(missing)} not set: a rank must be started by torchrun "
                                   "or `disttrain ddp`, which set them")
        try:
            return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                       local_rank=int(env["LOCAL_RANK"]),
                       local_world_size=int(env["LOCAL_WORLD_SIZE"]),
                       restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
        except ValueError as e:
            raise DistributedError(f"rank variables are not integers: {e}") from e


def started_by_elastic_agent(env: Mapping[str, str]) -> bool:
    """True in a rank process that torchrun or `disttrain ddp` started."""
    return all(name in env for name in RANK_VARIABLES)


def select_backend(requested: str, cuda_available: bool) -> str:
    """The process-group backend as this machine alone sees it: `auto` is NCCL with CUDA,
    gloo without (a rank's `start` then agrees on it with the other ranks).

    Raises:
        ConfigError: NCCL was asked for on a machine without CUDA.
    """
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise ConfigError("ddp.backend: nccl needs CUDA GPUs and none is available here; use "
                          "--backend gloo (or auto)")
    if requested not in ("gloo", "nccl"):
        raise ConfigError(f"ddp.backend: unknown backend {requested!r}; use auto, gloo or nccl")
    return requested


def node_backend(requested: str, ranks_per_node: int, num_gpus: int) -> str:
    """This node's backend as its launcher sees it: `auto` is NCCL only when each of the
    node's ranks has a GPU (otherwise the ranks will agree on gloo).

    Raises:
        ConfigError: NCCL asked for without CUDA, or with fewer GPUs than ranks.
    """
    backend = select_backend(requested, num_gpus > 0)
    if requested == "auto" and num_gpus < ranks_per_node:
        return "gloo"
    check_gpu_count(backend, ranks_per_node, num_gpus)
    return backend


def check_gpu_count(backend: str, ranks_per_node: int, num_gpus: int) -> None:
    """NCCL gives each rank of a node its own GPU.

    Raises:
        ConfigError: fewer GPUs than ranks on this node.
    """
    if backend == "nccl" and num_gpus < ranks_per_node:
        raise ConfigError(f"ddp.backend: nccl runs one rank per GPU, but {ranks_per_node} ranks per "
                          f"node were asked for and this node has {num_gpus} GPU(s); lower "
                          "--world-size or use --backend gloo")


# Compression that keeps state from one step's gradient to the next (error feedback, P and
# Q) or refuses non-finite payloads cannot take the overflowed gradients that fp16 loss
# scaling lets through the all-reduce for the GradScaler to find and skip.
STATEFUL_COMPRESSION = ("quantization", "topk", "powersgd")


def check_supported(config: Config) -> None:
    """Raises ConfigError for combinations DDP does not offer."""
    compression, training = config.compression, config.training
    if (compression.enabled and compression.type in STATEFUL_COMPRESSION
            and training.precision == "fp16"):
        raise ConfigError(f"compression.type: {compression.type} cannot take the overflowed gradients "
                          "of training.precision=fp16 (loss scaling); use bf16 mixed precision, or "
                          "fp16 or bf16 compression")
    if training.local_update_mode and training.precision == "fp16":
        # Each rank's loss scale would drift apart within a round, and the checkpoint keeps one.
        raise ConfigError("training.precision: fp16 loss scaling is not offered with local updates "
                          "(training.sync_every > 1); use bf16 mixed precision")
    if training.local_update_mode and training.streaming_mode and config.ddp.recovery == "live":
        # A live group rolls a lost member back to its round's start: fragments have none in common.
        raise ConfigError("training.outer_fragments, outer_mixing, outer_compression and outer_delay "
                          "(Streaming DiLoCo) are not offered with ddp.recovery live; leave them at 1, 0, "
                          "none and 0, or use ddp.recovery restart")
    if training.local_update_mode and config.system.balance != "none":
        # Planned batches weight each rank's loss for a gradient average, not for local steps.
        raise ConfigError(f"system.balance: {config.system.balance} batches are not offered with local "
                          "updates (training.sync_every > 1); use system.balance none")


def check_world_size(num_samples: int, world_size: int) -> None:
    """Every rank needs at least one sample.

    Raises:
        ConfigError: fewer samples than ranks.
    """
    if num_samples < world_size:
        raise ConfigError(f"system.num_workers: world size {world_size} is larger than the "
                          f"{num_samples} training samples; use --world-size {num_samples} or "
                          "fewer, or more data")


def select_device(backend: str, local_rank: int, gpu_under_gloo: bool = False) -> torch.device:
    """One device per rank: GPU `local_rank` with NCCL, the CPU with gloo, unless
    `gpu_under_gloo` (a GPU rank of an `auto` run that has ranks without one)."""
    on_gpu = backend == "nccl" or gpu_under_gloo
    return torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")


@dataclass
class Runtime:
    """A started process group and what this rank runs on. Collectives take tensors on
    `device`: NCCL reduces GPU tensors only; gloo reduces CPU tensors, and GPU tensors
    (a GPU rank beside ranks without one) by staging them through the host."""

    info: RankInfo
    backend: str
    device: torch.device
    num_threads: int


def start(ddp: DDPConfig, info: RankInfo, num_threads: int) -> Runtime:
    """Set threads and device, then join the process group (rendezvous through the agent's store).

    With `ddp.backend: auto` the ranks first agree on the backend through the same store
    (`agreement`); rank 0 logs the choice and its reason.

    Args:
        num_threads: torch threads for this rank; 0 shares the node's cores among its ranks.
    Raises:
        ConfigError: the backend cannot run here (NCCL without enough GPUs).
        DistributedError: the peers did not all join within `ddp.timeout_s`.
    """
    cuda_available, num_gpus = torch.cuda.is_available(), torch.cuda.device_count()
    forced = None if ddp.backend == "auto" else select_backend(ddp.backend, cuda_available)
    if forced is not None:
        check_gpu_count(forced, info.local_world_size, num_gpus)
    timeout = timedelta(seconds=ddp.timeout_s)
    store = _join(lambda: _rendezvous_store(info, timeout), ddp.timeout_s)
    own_gpu = has_own_gpu(cuda_available, num_gpus, info.local_rank)
    backend = forced or _agree(store, info, own_gpu, ddp.timeout_s)
    device = select_device(backend, info.local_rank, gpu_under_gloo=forced is None and own_gpu)
    threads = configure_process(num_threads, processes_per_machine=info.local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The "default_pg" prefix is what `init_method="env://"` would put on the same store.
    _join(lambda: dist.init_process_group(
        backend=backend, store=dist.PrefixStore("default_pg", store), rank=info.rank,
        world_size=info.world_size, timeout=timeout,
        device_id=device if backend == "nccl" else None), ddp.timeout_s)
    logger.info("rank %d/%d joined (%s on %s, %d threads)", info.rank, info.world_size, backend,
                device, threads)
    return Runtime(info, backend, device, threads)


def _agree(store: dist.Store, info: RankInfo, own_gpu: bool, timeout_s: float) -> str:
    """The backend of `auto`, agreed with every rank through `store`; rank 0 logs why."""
    flags = exchange_flags(dist.PrefixStore(store_prefix(info.restart_count), store), info.rank,
                           info.world_size, own_gpu, timeout_s)
    choice = decide_backend(flags)
    if info.is_main:
        logger.info("backend %s: %s", choice.backend, choice.reason)
    return choice.backend


def _rendezvous_store(info: RankInfo, timeout: timedelta) -> dist.Store:
    """The store `init_process_group(init_method="env://")` would open: a client of the
    agent's store (`TORCHELASTIC_USE_AGENT_STORE`), or one that rank 0 hosts, at
    MASTER_ADDR:MASTER_PORT."""
    store, _, _ = next(dist.rendezvous("env://", info.rank, info.world_size, timeout=timeout))
    store.set_timeout(timeout)
    return store


def _join(action: Callable[[], _T], timeout_s: float) -> _T:
    """Run a step of joining the group; a failure is one line naming the timeout."""
    try:
        return action()
    except (RuntimeError, ValueError, TimeoutError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"could not join the process group within {timeout_s:g}s ({first})") from e


# How a lost peer shows in a gloo collective's error. torch gives it no type: with torch
# 2.13, gloo raises a plain RuntimeError when a peer's socket closes or resets in an
# all-reduce ("... pair.cc: Connection closed by peer ...", "Read error ...: Connection
# reset by peer"), so its text is what tells it apart. NCCL's errors (DistBackendError)
# and the store's (DistStoreError: a wait timed out; DistNetworkError: no connection)
# have types, read first.
PEER_LOSS_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def needs_every_gradient(config: Config) -> bool:
    """Whether each step must give every trainable parameter a gradient: DDP's module wraps
    the model (not with local updates, whose steps are the plain model's) and does not look
    for unused parameters (`ddp.find_unused_parameters`)."""
    return not config.training.local_update_mode and not config.ddp.find_unused_parameters


def is_peer_loss(error: BaseException) -> bool:
    """Whether `error`, raised inside a collective, means another rank went away."""
    if isinstance(error, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in PEER_LOSS_SIGNS)


def peer_loss_error(error: BaseException) -> DistributedError:
    """The one-line error of a rank whose peer died (the traceback would say nothing more)."""
    text = str(error)
    sign = next((s for s in PEER_LOSS_SIGNS if s in text), type(error).__name__)
    return DistributedError(f"lost contact with another rank ({sign}); the agent stops this "
                            "group and restarts it while restarts are left")


def barrier(runtime: Runtime) -> None:
    """Wait until every rank gets here (NCCL is told this rank's GPU)."""
    if runtime.backend == "nccl":
        dist.barrier(device_ids=[runtime.device.index])
    else:
        dist.barrier()


def shutdown(runtime: Runtime) -> None:
    """Leave the process group cleanly: wait for every rank, then destroy it.

    Call once, after the last collective, on every rank. A rank that fails skips this
    and exits; the agent stops the others.
    """
    if not dist.is_initialized():
        return
    barrier(runtime)
    dist.destroy_process_group()
