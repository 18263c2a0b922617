"""Gradient compression as DDP communication hooks, one per `compression.type`.

- `quantization`, `topk`: each rank encodes its bucket with a `Compressor`, one segment
  per parameter named by the parameter, so error-feedback residuals (and DGC's
  velocities) follow parameters whatever buckets DDP cuts (top-k picks its k over the
  whole bucket: see `Compressor.blocks`), and all-gathers the payloads; every rank
  decodes every payload and averages them in rank order, so all ranks hold the same
  bits. Self-describing top-k payloads (compact, warm-up) differ in length between
  ranks: their lengths are all-gathered first and each is padded to the longest. (A sum of compressed
  payloads means nothing, hence all-gather rather than all-reduce.)
- `quantization` with `compression.ddp_collective: two_phase`: a two-phase int8 all-reduce
  (`two_phase`: an all-to-all of chunks, each averaged by its owner, an all-gather of the
  means), whose bytes per rank stay flat as ranks are added.
- `fp16`, `bf16`: PyTorch's half-precision all-reduce hooks.
- `powersgd`: PyTorch's `powerSGD_hook`, its state kept by parameter (`powersgd`); on a
  bucket in host memory, without the CUDA synchronize it makes wherever CUDA is available.

Each hook records per step the dense bytes, the payload bytes this rank hands to the
collective, the tensors that went uncompressed and the seconds spent compressing, in a
thread-safe `CompressionStats`. A hook's `state_dict` is tensors only, with the same names
and shapes on every rank, for a `weights_only` checkpoint of every rank's state.

Call order: `build_ddp_hook`, then register `run_hook` with the built hook as its state,
before the first forward; `stats.drain()` after each step.

Outside DDP's reducer (a local-update round's pseudo-gradient) one flat buffer is averaged
through the same hooks, or one all-reduce without compression: `start_average` (and
`average_flat`, which waits for it), the one place both recovery modes exchange such a
buffer.

A group that changes while it trains (live recovery) hands a hook's state to a member
that joins, or re-forms: `shared_state` is what every member takes from the one whose
state they all take, `clear_residuals` what each then starts again. Handed over: the
byte counters, quantization's draws, and PowerSGD's shared state (its iteration, the
random generator of Q's start, P and Q, which are all-reduced and so the same on every
member). PowerSGD's collectives depend on it: before its iteration reaches its start a
member all-reduces the whole bucket, after it only the uncompressed gradients, then P,
then Q; a member that missed it (a joiner with a fresh hook) sends a buffer of another
size and gloo aborts on the mismatch. A reset would agree as well, but would throw away
the warm start of Q and repeat the plain all-reduces at every recovery, while P and Q are
small (rank r). When the failed step died inside the hook, the source's P or Q may be its
own unreduced ones; every member takes the same copy, so they still agree, and a warm
start only seeds the next power iteration.

Not handed over: each member's own error-feedback residual (top-k's and quantization's
`residual/...`, the two-phase collective's `owned/...` too, PowerSGD's `error/...`; DGC's
velocities are cleared with them). After every change of group every member starts again
from a zero residual, the source of the state included. That is sound: a residual is the
gradient mass this rank's earlier payloads left out, and error feedback converges from any
starting residual (it only delays that mass); a zero residual drops at most one residual's
worth, once per recovery. Carrying the old one would be wrong: the member that held it may
be gone, the batch split that produced it changes with the group, and a survivor's
residual already includes the encoding of the failed step that the group redoes, which
would then count twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import astuple
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook

from disttrain.compression import collectives, two_phase
from disttrain.compression.compressor import Compressor, Counters
from disttrain.compression.powersgd import PowerSGDBuckets, powersgd_hook_for
from disttrain.config import CompressionConfig

Future = torch.futures.Future


class CompressionStats:
    """Counts of the hooks, per step and since the run started (a resumed run goes on
    counting). Thread-safe: hooks encode on the autograd thread and decode on the
    backend's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step = Counters()
        self._totals = Counters()

    def record(self, bytes_dense: int = 0, bytes_sent: int = 0, dense_segments: int = 0,
               seconds: float = 0.0) -> None:
        with self._lock:
            for sample in (self._step, self._totals):
                sample.bytes_dense += bytes_dense
                sample.bytes_sent += bytes_sent
                sample.dense_segments += dense_segments
                sample.seconds += seconds

    def drain(self) -> Counters:
        """What was recorded since the last drain; call after each step (all futures done)."""
        with self._lock:
            sample, self._step = self._step, Counters()
        return sample

    def totals(self) -> Counters:
        with self._lock:
            return Counters(*astuple(self._totals))

    def state_dict(self) -> torch.Tensor:
        return torch.tensor(astuple(self.totals()), dtype=torch.float64)  # exact below 2**53 bytes

    def load_state_dict(self, totals: torch.Tensor) -> None:
        dense, sent, segments, seconds = totals.tolist()
        with self._lock:
            self._totals = Counters(int(dense), int(sent), int(segments), seconds)


class FlatBucket:
    """One flat buffer holding every parameter's gradient in order (a live group's gradient,
    a local-update round's pseudo-gradient), as the hooks read a `dist.GradBucket`: bucket
    0, the last, of every parameter."""

    def __init__(self, buffer: torch.Tensor, params: list[nn.Parameter]):
        self._buffer, self._params = buffer, params

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        views, offset = [], 0
        for param in self._params:
            views.append(self._buffer[offset:offset + param.numel()].view_as(param))
            offset += param.numel()
        return views

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


def start_average(flat: torch.Tensor, params: list[nn.Parameter], hook: CompressionHook | None
                  ) -> Future[torch.Tensor]:
    """Start the group's average of `flat` (one value per element of `params`, in order,
    on every rank alike): through `hook`, which reads it as one `FlatBucket`, or, with
    None, one all-reduce in place, divided before summing as DDP's own average is (no
    half-precision overflow). Every rank ends with the same bits.

    Returns:
        A future of the average (for the all-reduce, `flat` itself); it raises what the
        collective raised.
    Raises:
        RuntimeError, dist.DistError: a peer was lost (the buffer is then unusable).
    """
    if hook is not None:
        return hook.hook(cast(dist.GradBucket, FlatBucket(flat, params)))
    work = dist.all_reduce(flat.div_(dist.get_world_size()), async_op=True)

    def averaged(done: Future) -> torch.Tensor:
        done.value()  # a lost peer's error reaches the caller's wait
        return flat

    return work.get_future().then(averaged)


def average_flat(flat: torch.Tensor, params: list[nn.Parameter], hook: CompressionHook | None
                 ) -> torch.Tensor:
    """`start_average`, waited for: the group's average of `flat`.

    Raises:
        RuntimeError, dist.DistError: a peer was lost (the result is then unusable).
    """
    return start_average(flat, params, hook).wait()


class CompressionHook:
    """A scheme's hook with its state; subclasses define `hook`, `_state` and `_load`."""

    def __init__(self, scheme: str, names: Mapping[int, str]):
        self.scheme = scheme
        self.names = names  # id(parameter) -> its name in the model
        self.stats = CompressionStats()

    def hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        raise NotImplementedError

    def gradients(self, bucket: dist.GradBucket) -> list[tuple[str, torch.Tensor]]:
        """The bucket's gradients (views into its buffer), in order, with their parameters' names."""
        return [(self.names[id(parameter)], gradient)
                for parameter, gradient in zip(bucket.parameters(), bucket.gradients(), strict=True)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state: tensors named `<scheme>/...`, the same on every rank but values."""
        state = {"totals": self.stats.state_dict(), **self._state()}
        return {f"{self.scheme}/{name}": value for name, value in state.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore this rank's state.

        Raises:
            ValueError: the state was written with another scheme (or without compression).
        """
        prefix = f"{self.scheme}/"
        if f"{prefix}totals" not in state:
            written = next(iter(state), "none/").split("/")[0]
            raise ValueError(f"the checkpoint was written with {written} compression and this run uses "
                             f"{self.scheme}; resume with compression.type={written}")
        own = {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}
        self.stats.load_state_dict(own.pop("totals"))
        self._load(own)

    def shared_state(self) -> dict[str, torch.Tensor]:
        """`state_dict` without this rank's own residuals: what a member joining a group
        takes (see the module's docstring)."""
        own = ("residual/", "error/", "owned/")  # DGC's velocities ride along; the taker clears them
        return {name: value for name, value in self.state_dict().items()
                if not name.partition("/")[2].startswith(own)}

    def load_shared_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take a peer's `shared_state`; this rank's residuals are then zero.

        Raises:
            ValueError: the state is of another compression scheme.
        """
        self.load_state_dict(state)
        self.clear_residuals()

    def clear_residuals(self) -> None:
        """This rank's error feedback starts again from zero (a change of group); nothing
        in flight from a group that is gone is waited for."""

    def _state(self) -> dict[str, torch.Tensor]:
        return {}

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        pass


def run_hook(state: CompressionHook, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """The DDP communication hook of every scheme: `state` is what `build_ddp_hook` built."""
    return state.hook(bucket)


class GatherHook(CompressionHook):
    """quantization, topk: encode, all-gather the payloads, decode and average them all.

    `dense_when_cheaper`: a bucket whose payloads would cost more to all-gather than the
    dense tensor to all-reduce (`collectives.cheapest`: top-k once (n - 1)·k outgrows the
    tensor) goes dense instead: each rank decodes its own payload and the decoded tensors
    are all-reduced. The error feedback is the payload's either way; the decision depends
    only on the bucket's sizes and the world size, so every rank takes the same path.
    """

    def __init__(self, compressor: Compressor, names: Mapping[int, str], dense_when_cheaper: bool = False):
        super().__init__(compressor.scheme, names)
        self.compressor = compressor
        self.dense_when_cheaper = dense_when_cheaper

    def hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        started = time.perf_counter()
        buffer = bucket.buffer()
        segments = [(name, gradient.numel()) for name, gradient in self.gradients(bucket)]
        encoded = self.compressor.encode(buffer.detach().cpu(), segments)
        # Committed at once: a payload handed to the collective is never refused in DDP, and
        # a failed collective ends the run, which resumes from a checkpoint before this step.
        self.compressor.commit(encoded)
        n, dense_bytes = dist.get_world_size(), buffer.numel() * buffer.element_size()
        sizes = self._sizes(encoded.nbytes, buffer.device) if self.compressor.variable \
            else [encoded.nbytes] * n
        # The largest payload decides, so every rank takes the same path (they are equal but
        # for self-describing top-k blocks, whose lengths differ from rank to rank).
        if self.dense_when_cheaper and collectives.cheapest(n, max(sizes), dense_bytes, False) == \
                collectives.DENSE:
            return self._dense(buffer, encoded, segments, started)
        # A bucket of zero-size gradients has an empty payload, which frombuffer refuses.
        data = encoded.data + bytes(max(sizes) - encoded.nbytes)  # all-gather takes equal sizes
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data \
            else torch.empty(0, dtype=torch.uint8)
        payload = payload.to(buffer.device)
        self.stats.record(encoded.dense_bytes, encoded.nbytes, encoded.dense_segments,
                          time.perf_counter() - started)
        parts = [torch.empty_like(payload) for _ in range(n)]
        gathered = dist.all_gather(parts, payload, async_op=True).get_future()

        def average(done: Future) -> torch.Tensor:
            done.value()  # a failed all-gather raises its own error here, not a decode of garbage
            started = time.perf_counter()
            total = torch.zeros(buffer.numel(), dtype=buffer.dtype)
            scratch = torch.empty_like(total)
            for part, size in zip(parts, sizes, strict=True):  # in rank order: the same sum everywhere
                self.compressor.decode(memoryview(part.cpu().numpy())[:size], segments, scratch)
                total += scratch
            buffer.copy_(total.div_(len(parts)))
            self.stats.record(seconds=time.perf_counter() - started)
            return buffer

        return gathered.then(average)

    @staticmethod
    def _sizes(nbytes: int, device: torch.device) -> list[int]:
        """Every rank's payload length, in rank order (one small all-gather)."""
        mine = torch.tensor([nbytes], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(sizes, mine)
        return [int(size) for size in sizes]

    def _dense(self, buffer: torch.Tensor, encoded: Any, segments: list[tuple[str, int]],
               started: float) -> Future[torch.Tensor]:
        """This rank's payload decoded, all-reduced dense: the same average of the payloads
        (the ring's reduction gives every rank the same bits), in dense bytes."""
        decoded = torch.zeros(buffer.numel(), dtype=buffer.dtype)
        if encoded.data:
            self.compressor.decode(memoryview(bytes(encoded.data)), segments, decoded)
        decoded = decoded.to(buffer.device)
        self.stats.record(encoded.dense_bytes, decoded.numel() * decoded.element_size(),
                          encoded.dense_segments, time.perf_counter() - started)
        reduced = dist.all_reduce(decoded, async_op=True).get_future()

        def average(done: Future) -> torch.Tensor:
            done.value()
            buffer.copy_(decoded.div_(dist.get_world_size()))
            return buffer

        return reduced.then(average)

    def clear_residuals(self) -> None:
        self.compressor.residuals.clear()  # a missing residual reads as zeros
        self.compressor.velocities.clear()  # DGC's momentum correction: the same reasoning

    def _state(self) -> dict[str, torch.Tensor]:
        state = self.compressor.state_dict()
        tensors = {f"residual/{name}": value for name, value in state["residuals"].items()}
        tensors["counters"] = torch.tensor(state["counters"], dtype=torch.float64)
        tensors.update({f"draws/{name}": torch.tensor(count, dtype=torch.int64)
                        for name, count in state.get("draws", {}).items()})
        tensors.update({f"velocity/{name}": value for name, value in state.get("velocities", {}).items()})
        tensors.update({f"steps/{name}": torch.tensor(count, dtype=torch.int64)
                        for name, count in state.get("steps", {}).items()})
        return tensors

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        residuals = {name[len("residual/"):]: value for name, value in state.items()
                     if name.startswith("residual/")}
        loaded: dict[str, Any] = {"scheme": self.scheme, "residuals": residuals,
                                  "counters": state["counters"].tolist()}
        loaded["draws"] = {name[len("draws/"):]: int(value) for name, value in state.items()
                           if name.startswith("draws/")}
        loaded["velocities"] = {name[len("velocity/"):]: value for name, value in state.items()
                                if name.startswith("velocity/")}
        loaded["steps"] = {name[len("steps/"):]: int(value) for name, value in state.items()
                           if name.startswith("steps/")}
        self.compressor.load_state_dict(loaded)


class HalfPrecisionHook(CompressionHook):
    """fp16, bf16: PyTorch's hooks, which divide by the world size, cast, and all-reduce."""

    HOOKS = {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}

    def hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        started = time.perf_counter()
        buffer = bucket.buffer()
        future = self.HOOKS[self.scheme](None, bucket)
        # The cast happens before the hook returns; the cast back, in its future, is not timed.
        self.stats.record(buffer.numel() * buffer.element_size(), buffer.numel() * 2, 0,
                          time.perf_counter() - started)
        return future


class MatrixBucket:
    """A bucket whose every gradient PyTorch's `powerSGD_hook` can view as a matrix.

    The hook views each gradient as `(shape[0], -1)`: a 0-d gradient (a scalar parameter)
    has no `shape[0]`, and a zero-size one whose first dimension is 0 has no unique `-1`;
    both raised inside the hook. Here a 0-d gradient reads as shape (1,) and a zero-size
    one as (1, 0): views of the same memory, so what the hook writes lands in the bucket,
    and the hook's own rule leaves both uncompressed (as `plan_bucket` counts them).
    Everything else is the bucket's.
    """

    def __init__(self, bucket: dist.GradBucket):
        self._bucket = bucket

    def gradients(self) -> list[torch.Tensor]:
        return [_matrix_view(gradient) for gradient in self._bucket.gradients()]

    def __getattr__(self, name: str):
        return getattr(self._bucket, name)


def _matrix_view(gradient: torch.Tensor) -> torch.Tensor:
    if gradient.dim() == 0:
        return gradient.view(1)
    if gradient.numel() == 0:
        return gradient.view(1, 0)
    return gradient


class PowerSGDHook(CompressionHook):
    """powersgd: PyTorch's `powerSGD_hook` on state that follows DDP's buckets.

    On gloo one bucket's PowerSGD is in flight at a time: the hook's callbacks run on
    gloo's worker threads and wait there for the P and Q all-reduces they start, so two
    buckets at once could take every worker thread and wait forever (and start their
    collectives in a different order on different ranks). Each bucket waits for the one
    before. NCCL runs the callbacks in line, in order, and needs no wait.
    """

    def __init__(self, section: CompressionConfig, seed: int, names: Mapping[int, str]):
        super().__init__("powersgd", names)
        self.buckets = PowerSGDBuckets(section, seed)
        self.in_flight: Future[torch.Tensor] | None = None

    def hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        if self.in_flight is not None:
            self.in_flight.wait()
        started = time.perf_counter()
        buffer = bucket.buffer()
        layout = tuple((name, tuple(gradient.shape)) for name, gradient in self.gradients(bucket))
        plan = self.buckets.fit(bucket.index(), layout, buffer)
        compressing = self.buckets.compressing
        # PyTorch's hook; for a bucket in host memory, without its CUDA synchronize.
        future = powersgd_hook_for(buffer.device)(self.buckets.state, MatrixBucket(bucket))
        # Bytes by the hook's own rule (`plan_bucket`): P and Q of each compressed matrix,
        # the rest all-reduced as it is; the first iterations all-reduce the whole bucket.
        # Counted once each, like comm/bytes_allreduced, though a ring sends about twice that.
        # Dense tensors: those the rule leaves uncompressed as not worth it, at every step.
        itemsize = buffer.element_size()
        sent = sum(t.sent_numel for t in plan) if compressing else buffer.numel()
        raw = sum(1 for t in plan if not t.rank)
        # Timed: the error feedback, Q's start and P = MQ; the steps after each collective
        # run in the hook's futures and are not.
        self.stats.record(buffer.numel() * itemsize, sent * itemsize, raw, time.perf_counter() - started)
        self.in_flight = None if dist.get_backend() == "nccl" else future
        return future

    def clear_residuals(self) -> None:
        self.buckets.state.error_dict.clear()  # the hook starts a missing one at zeros
        self.buckets.pending.errors.clear()
        self.in_flight = None

    def _state(self) -> dict[str, torch.Tensor]:
        return self.buckets.state_dict()

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        self.buckets.load_state_dict(state)


class TwoPhaseHook(CompressionHook):
    """quantization as a two-phase all-reduce (`compression.ddp_collective: two_phase`; the
    arithmetic in `two_phase`): each rank's error-corrected bucket cut into a chunk per
    rank and quantized to int8, an all-to-all of the chunks, each chunk's owner averaging
    its n copies in float32 and quantizing the mean again, an all-gather of the means.
    Bytes per rank stay flat as ranks are added; every rank holds the same average bits.

    Both roundings are fed back (`error_feedback`): phase 1's by every rank, phase 2's by
    the chunk's owner, each kept per parameter, so residuals follow parameters whatever
    buckets DDP cuts, as the all-gather hook's do (an element whose chunk changes owner
    when DDP rebuilds its buckets leaves its phase-2 residual behind, once). The
    collectives run inside the hook, one bucket at a time, in the same order on every
    rank: no bucket's communication overlaps the backward pass yet.
    """

    def __init__(self, names: Mapping[int, str], error_feedback: bool):
        super().__init__("quantization", names)
        self.error_feedback = error_feedback
        self.residuals: dict[str, torch.Tensor] = {}  # parameter name -> phase 1's error
        # parameter name -> phase 2's error, where this rank owned the chunk (zero elsewhere)
        self.owner_residuals: dict[str, torch.Tensor] = {}

    def hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        started = time.perf_counter()
        buffer = bucket.buffer()
        world_size = dist.get_world_size()
        # Laid out by parameter name, not in the bucket's order, which DDP changes when it
        # rebuilds its buckets after the first step (a resumed run's first step has the
        # initial order): the chunks, their scales and their owners are those of an
        # uninterrupted run.
        gradients = sorted(self.gradients(bucket), key=lambda named: named[0])
        flat = torch.cat([gradient.detach().reshape(-1).to(torch.float32) for _, gradient in gradients]) \
            if gradients else torch.zeros(0)
        if self.error_feedback:
            flat += self._flat(self.residuals, gradients, flat.numel())
        codes, scales = two_phase.quantize_chunks(flat, world_size)
        if self.error_feedback:
            sent = two_phase.dequantize_rows(codes, scales).reshape(-1)[:flat.numel()]
            self._keep(self.residuals, flat - sent, gradients)
        received, received_scales = torch.empty_like(codes), torch.empty_like(scales)
        dist.all_to_all_single(received.view(-1), codes.view(-1))  # row r: rank r's chunk of mine
        dist.all_to_all_single(received_scales, scales)
        mean = two_phase.mean_of_chunks(received, received_scales)  # of the chunk this rank owns
        owned = slice(dist.get_rank() * mean.numel(), (dist.get_rank() + 1) * mean.numel())
        if self.error_feedback:  # phase 2's rounding, fed back by the chunk's owner
            kept = self._flat(self.owner_residuals, gradients, codes.numel())
            mean += kept[owned]
        own_codes, own_scale = two_phase.quantize_rows(mean[None])
        if self.error_feedback:
            kept[owned] = mean - two_phase.dequantize_rows(own_codes, own_scale)[0]
            self._keep(self.owner_residuals, kept[:flat.numel()], gradients)
        means = [torch.empty_like(own_codes[0]) for _ in range(world_size)]
        mean_scales = [torch.empty_like(own_scale) for _ in range(world_size)]
        dist.all_gather(means, own_codes[0])
        dist.all_gather(mean_scales, own_scale)
        average = two_phase.dequantize_rows(torch.stack(means), torch.cat(mean_scales)).reshape(-1)
        offset = 0
        for _, gradient in gradients:  # views into the bucket's buffer
            gradient.copy_(average[offset:offset + gradient.numel()].view_as(gradient))
            offset += gradient.numel()
        # What this rank hands to the collectives: every chunk and its scale, then its mean.
        self.stats.record(buffer.numel() * buffer.element_size(),
                          codes.numel() + 4 * world_size + own_codes.numel() + 4, 0,
                          time.perf_counter() - started)
        done: Future[torch.Tensor] = Future()
        done.set_result(buffer)
        return done

    @staticmethod
    def _flat(kept: dict[str, torch.Tensor], gradients: list[tuple[str, torch.Tensor]], numel: int
              ) -> torch.Tensor:
        """The residuals of the bucket's parameters laid out as the bucket, zero-padded to
        `numel` (zeros for a parameter without one yet)."""
        flat, offset = torch.zeros(numel, dtype=torch.float32), 0
        for name, gradient in gradients:
            if name in kept:
                flat[offset:offset + gradient.numel()] = kept[name].reshape(-1)
            offset += gradient.numel()
        return flat.to(gradients[0][1].device) if gradients else flat

    @staticmethod
    def _keep(kept: dict[str, torch.Tensor], flat: torch.Tensor, gradients: list[tuple[str, torch.Tensor]]
              ) -> None:
        offset = 0
        for name, gradient in gradients:
            kept[name] = flat[offset:offset + gradient.numel()].reshape(gradient.shape).cpu()
            offset += gradient.numel()

    def clear_residuals(self) -> None:
        self.residuals.clear()  # both roundings', the owner's laid out for the old group
        self.owner_residuals.clear()

    def _state(self) -> dict[str, torch.Tensor]:
        return {**{f"residual/{name}": value for name, value in self.residuals.items()},
                **{f"owned/{name}": value for name, value in self.owner_residuals.items()}}

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        def kept(prefix: str) -> dict[str, torch.Tensor]:
            return {name[len(prefix):]: value.float() for name, value in state.items()
                    if name.startswith(prefix)}

        self.residuals, self.owner_residuals = kept("residual/"), kept("owned/")


def build_ddp_hook(section: CompressionConfig, named_parameters: Iterable[tuple[str, nn.Parameter]],
                   seed: int, rank_seed: int, world_size: int | None = None) -> CompressionHook:
    """The hook and state of `section.type`.

    Args:
        named_parameters: the model's (the module DDP wraps); names key the state.
        seed: the same on every rank (PowerSGD's random start of Q must agree).
        rank_seed: this rank's own (quantization's stochastic rounding, drawn per rank).
        world_size: the ranks the run starts with, for `compression.ddp_collective: auto`
            (default: the process group's size, else 1).
    Raises:
        ValueError: an unknown compression type.
    """
    names = {id(parameter): name for name, parameter in named_parameters}
    if section.type == "quantization" and resolved_collective(section, world_size) == collectives.TWO_PHASE:
        return TwoPhaseHook(names, section.error_feedback)
    if section.type in ("quantization", "topk"):
        num_ranks = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
        return GatherHook(Compressor.from_config(section, rank_seed, num_ranks), names,
                          dense_when_cheaper=section.ddp_collective == "auto")
    if section.type in HalfPrecisionHook.HOOKS:
        return HalfPrecisionHook(section.type, names)
    if section.type == "powersgd":
        return PowerSGDHook(section, seed, names)
    raise ValueError(f"compression.type: unknown type {section.type!r}; use quantization, topk, fp16, "
                     "bf16 or powersgd")


def resolved_collective(section: CompressionConfig, world_size: int | None = None) -> str:
    """`compression.ddp_collective` as the hook runs it: `auto` is two-phase for int8
    rounded to nearest where it moves fewer bytes than gathering (more than 2 ranks), else
    gather (whose buckets may still go dense, `GatherHook`). Decided once, at the start:
    a hook keeps one error-feedback state for the run."""
    if section.ddp_collective != "auto":
        return section.ddp_collective
    n = world_size if world_size is not None else (dist.get_world_size() if dist.is_initialized() else 1)
    # int8's payload is a quarter of fp32's: only the ratio matters between gather and two-phase
    two_phase_ok = section.type == "quantization" and not section.stochastic_rounding
    return collectives.cheapest(n, 1.0, 4.0, two_phase_ok) if two_phase_ok else collectives.GATHER
