"""What an overlapped push costs backward on this machine's cores: the parameter server's
overlap pushes each shard's slice while backward still computes, and where no core is
free that push's CPU work (copying the gradients into the flat buffer, framing each
slice's bytes as the wire does) is taken from backward. The cost model subtracts it from
the overlap's credit (`CostModel.overlap_contention_s`).

Measured as backward alone and backward while a second thread does one push's work on
the model's gradients, in interleaved pairs (alone, pushing, alone, pushing: load that
drifts hits both), with the process's `torch.set_num_threads` as the run's. The push's
work is the worker's own: the held gradients copied into one flat buffer, then each
shard's slice (`plan_shards` at `ps.num_servers`) framed by the wire's encoder
(`service.gradient_frames`). gRPC's own threads and the pull are left out.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.wire import codec, service
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.training.engine import logits_of, objective_of

# Interleaved pairs of backward alone and backward beside a push: at least NUM_PAIRS, and
# more (up to MAX_PAIRS) until the pairs have taken MIN_SECONDS, so that the medians of a
# backward of milliseconds stand above a busy machine's pauses.
NUM_PAIRS = 3
MAX_PAIRS = 200
MIN_SECONDS = 1.0


def contention_s(alone: Sequence[float], pushing: Sequence[float]) -> float:
    """Seconds a push's work adds to backward: the median backward beside it less the
    median alone, never below 0 (a free core runs it for nothing); 0 without timings."""
    if not alone or not pushing:
        return 0.0
    return max(0.0, statistics.median(pushing) - statistics.median(alone))


def push_work(model: nn.Module, num_shards: int) -> Callable[[], list[list[bytes]]]:
    """One overlapped push's CPU work on `model`'s current gradients (held as they are
    now): copy them into a flat buffer and frame every shard's slice as the worker's push
    does; returns each shard's messages (the measurement drops them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    held = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.empty(sum(g.numel() for g in held), dtype=held[0].dtype if held else torch.float32)
    plans = plan_shards(model, max(1, min(num_shards, flat.numel())))

    def push() -> list[list[bytes]]:
        torch.cat([g.reshape(-1) for g in held], out=flat)
        messages = []
        for plan in plans:
            data = codec.tensor_bytes(flat[plan.offset:plan.offset + plan.numel])
            header = pb.GradientMessage(worker_id="advise", step=1, shard=plan.shard)
            messages.append(list(service.gradient_frames(header, plan, data)))
        return messages

    return push


def measure_contention(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, num_shards: int,
                       pairs: int = NUM_PAIRS) -> tuple[list[float], list[float]]:
    """Backward's seconds alone and beside one push's work (`push_work` on the model's
    gradients as they are: those of a step taken before), interleaved, over the graph of
    one forward: `pairs` of each, or more while they have taken less than `MIN_SECONDS`
    (at most `MAX_PAIRS`)."""
    model.train()
    objective = objective_of(model)
    # one long-lived helper, as the worker's pushes run on threads already started: a
    # thread's start is not part of a push
    jobs: queue.Queue[Callable[[], object] | None] = queue.Queue()
    ends: queue.Queue[BaseException | None] = queue.Queue()

    def helper() -> None:
        while (job := jobs.get()) is not None:
            try:
                job()
                ends.put(None)
            except BaseException as e:  # handed to the measuring thread, raised there
                ends.put(e)

    push = push_work(model, num_shards)
    push()  # warm-up: the push's buffers and first calls
    output = objective.forward(model, inputs, targets)
    loss = objective.loss(output, logits_of(output), targets)

    def backward(during: Callable[[], object] | None) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if during is not None:
            jobs.put(during)
        loss.backward(retain_graph=True)  # one forward's graph, walked back each time
        elapsed = time.perf_counter() - start
        failed = ends.get() if during is not None else None
        if failed is not None:
            raise failed
        return elapsed

    thread = threading.Thread(target=helper, name="advise-push", daemon=True)
    thread.start()
    try:
        alone: list[float] = []
        pushing: list[float] = []
        begun = time.perf_counter()
        while len(alone) < pairs or (len(alone) < MAX_PAIRS and time.perf_counter() - begun < MIN_SECONDS):
            alone.append(backward(None))
            pushing.append(backward(push))
        return alone, pushing
    finally:
        jobs.put(None)
        thread.join()
