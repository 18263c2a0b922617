"""Where a DDP run's checkpoints are, and how every rank agrees on them.

Rank 0 writes them; all ranks read them. Model and optimizer are the same on every rank
after each step, so rank 0's copy (the model without its DDP wrapper, so the file loads
into a plain module) stands for all. The sampler position is the same on every rank
too (equal shards, equal batches). The entries of `PER_RANK` (RNG states, a compression
hook's state, and with local updates each rank's own model and inner optimizer within a
round) differ per rank: every rank's is kept, in rank order, gathered as tensors
(never pickled over the network), and each rank loads its own. A checkpoint of another
number of ranks is resized as it loads (`resize`).

The folder may be a store's URL (`s3://bucket/run`; see `core.object_store`): every
rank then reads the checkpoint rank 0 chose from the store, so nodes need no shared file
system.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.errors import CheckpointError
from disttrain.strategies.ddp import resize, rng
from disttrain.strategies.ddp import runtime as rt

NO_CHECKPOINT = -1

Codec = tuple[Callable[[Any], dict[str, torch.Tensor]], Callable[[dict[str, torch.Tensor]], Any]]
# Checkpoint entries that differ per rank, with how each becomes tensors and back.
PER_RANK: dict[str, Codec] = {"rng": (rng.encode, rng.decode), "compression": (dict, dict),
                              "local": (dict, dict)}


class RankZeroCheckpoints:
    """The checkpoint store of one rank; `choose` and `save` are collectives."""

    def __init__(self, folder: str | Path, keep: int, runtime: rt.Runtime, *, seed: int = 0,
                 batch_size: int = 0):
        """`seed` and `batch_size` (the run's training seed and per-rank batch) are what a
        resize needs: the new ranks' RNG seeds, and the check that the global batch is kept."""
        self.folder = folder if object_store.is_url(folder) else Path(folder)
        self.keep = keep
        self.runtime = runtime
        self.seed = seed
        self.batch_size = batch_size

    def choose(self, resume: bool) -> Path | str | None:
        """Rank 0 picks the checkpoint and tells the others (one broadcast), so every rank
        loads the same one.

        Raises:
            ConfigError: (rank 0) a fresh run found checkpoints of an earlier run.
            CheckpointError: (other ranks) the chosen file is not visible from this node.
        """
        info = self.runtime.info
        step = NO_CHECKPOINT
        if info.is_main:
            chosen = ckpt.prepare_checkpoint_dir(self.folder, resume)
            step = NO_CHECKPOINT if chosen is None else ckpt.checkpoint_step(chosen)
        tensor = torch.tensor([step], dtype=torch.int64, device=self.runtime.device)
        dist.broadcast(tensor, src=0)
        step = int(tensor.item())
        if step == NO_CHECKPOINT:
            return None
        path = object_store.join(self.folder, ckpt.checkpoint_name(step))
        if not object_store.exists(path):
            raise CheckpointError(f"rank 0 resumes from {object_store.basename(path)} but rank {info.rank} "
                                  f"cannot see it in {self.folder}; put system.checkpoint_dir on storage "
                                  "every node shares (a shared file system, or a store's URL)")
        return path

    def load(self, path: Path | str) -> dict[str, Any]:
        """The checkpoint, with each `PER_RANK` entry holding this rank's own.

        Raises:
            CheckpointError: unreadable, or its per-rank entries do not match its ranks.
            ConfigError: written by another number of ranks, and it cannot be resized to
                this run's (see `resize.resize_state`).
        """
        state = ckpt.load_checkpoint(path)
        ckpt.require_keys(state, ("rng",), path)
        world_size, rank = self.runtime.info.world_size, self.runtime.info.rank
        written = resize.written_world_size(state)
        if written != world_size and state.get("strategy") == "ddp":
            ckpt.require_keys(state, ("position", "sampler", "config"), path)
            return resize.resize_state(state, world_size, rank, self.seed, self.batch_size)
        for key in PER_RANK.keys() & state.keys():
            if not isinstance(state[key], list) or len(state[key]) != world_size:
                written = len(state[key]) if isinstance(state[key], list) else 1
                raise CheckpointError(f"checkpoint {path} was written by {written} ranks and this run "
                                      f"has {world_size}; resume with --world-size {written}")
            state[key] = state[key][rank]
        return state

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Gather every rank's `PER_RANK` entries; rank 0 writes; every rank waits for the
        write, so no rank's training clock counts it while it waits in the next all-reduce."""
        info, device = self.runtime.info, self.runtime.device
        gathered = {key: [decode(tensors) for tensors in rng.gather_tensors(encode(state[key]),
                                                                            info.world_size, device)]
                    for key, (encode, decode) in PER_RANK.items() if key in state}
        if info.is_main:
            ckpt.save_checkpoint(self.folder, step, {**state, **gathered}, keep=self.keep)
        rt.barrier(self.runtime)
