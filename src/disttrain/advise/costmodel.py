"""The α-β cost model: one step's time for each strategy, compression and size of run.

A link moves `b` bytes in `α + b/β` seconds (α its one-way latency, β its bandwidth);
links are full duplex and every machine has its own. One worker's step computes for
`t_f + t_b` (forward, backward) at its batch B; `G` is the dense gradient in bytes, `P`
a compressed push payload, `e`/`d` a compressor's encode/decode time on the whole
gradient, `t_opt` one optimizer step over every parameter. The formulas (the README's
"Choosing a strategy with `disttrain advise`" writes them out too):

- **DDP, ring all-reduce** over n ranks in K = ceil(G / bucket_cap) buckets: `T_ar =
  2(n-1)/n · G/β + 2(n-1)·K·α`; fp16/bf16 halve G and cost e+d. Quantization and top-k
  take the collective of fewest bytes (`compression.collectives`, the rule the hook's
  `ddp_collective: auto` runs): all-gather their payloads, `T = (n-1)·P/β + (n-1)·K·α + e
  + n·d` (compact top-k, and top-k under DGC's sparsity warm-up, whose lengths vary,
  all-gather the lengths first: one more `(n-1)·K·α`; compact top-k's P is
  `advise.payloads.compact_topk_nbytes`, about 3.3 bytes per kept element at 1%); int8's
  two phases (an all-to-all of n chunks of each bucket's int8 values with a float32 scale
  each, each chunk averaged by its owner, an all-gather of the means), `T =
  2(n-1)·(ceil(N/(nK)) + 4)·K/β + 4(n-1)·K·α + e + 2d` for N parameters (about `2(n-1)/n ·
  G/4`, flat in n; four collectives per bucket: each phase's codes, then their scales);
  or, once (n-1)·P outgrows the ring, each rank's payload decoded and all-reduced dense,
  `T = T_ar + e + d`. PowerSGD all-reduces the uncompressed gradients, then P, then Q (its
  payload P is their sum, `advise.payloads`): `T = 2(n-1)/n · P/β + 3·2(n-1)·K·α + e + d`.
  Buckets overlap with backward: the k-th of K is ready at `t_b·k/K`, so the
  backward-and-communication tail is `max(t_b + T/K, t_b/K + T)`; the two-phase hook runs
  its collectives inside backward, so its tail is `t_b + T`. Step: `t_f + tail + t_opt`.
- **Parameter server, S shards, sync**: each worker pushes P (to S shards, 1/S each) and
  pulls G; a shard's link carries n/S of everyone's traffic, so
  `T_push = max(P/β, n·P/(S·β)) + α`, `T_pull = max(G/β, n·G/(S·β)) + α`; each shard
  decodes n slices (`n·d/S`) and applies its slice (`t_opt/S`). With overlap, the slices
  of all but the last shard go while backward finishes: a credit of
  `min(t_b, e + T_push)·(K-1)/K` with K = S, or with K = the push's 1 MB pieces where a raw
  push's shards each outgrow one message (4 MB: the push streams its pieces as backward
  writes them, all but the last during backward), less `overlap_contention_s` (the push's
  CPU work taken from backward where no core is free); with the overlap trial (`ps.overlap_trial_steps`)
  a worker keeps the overlap only where the credit is more than `MIN_GAIN` (2%) of the
  plain step, else none (the plain push): the credit is 0 or above 2%. Step: `t_f + t_b + e +
  T_push + n·d/S + t_opt/S + T_pull - credit`. With pull compression the pull carries
  each shard's compressed change instead of G (dense every D-th version: `((D-1)·P_pull + G)/D`, see
  `advise.payloads`), the shards encode and add the change (`(e_p + d_p)/S`), and the
  worker decodes it (`d_p`).
- **Parameter server, async** (SSP's best case): nobody waits for the slowest. One update
  holds the shards' busiest resource for `s = max(P/(Sβ), G/(Sβ), (d + t_opt)/S)`, so
  they apply at most `1/s` updates a second; a worker cycles in `c = t_f + t_b + e + α +
  max(0, P/β - s) + s + G/β + α` (its own push beyond the shard's share, the shard's turn,
  its pull). Updates per second: `min(n/c, 1/s)`. With pull compression each update
  costs the shards a change's encoding and adding (`(e_p + d_p)/S`, in `s`), and a
  worker, which the n workers' updates left n versions behind, pulls the n changes it
  missed, at most G: `G·p + min(n·P_pull, G)·(1 - p)`, dense with the chance `p =
  min(1, n/D)` that a dense version fell among them; it decodes `min(n, G/P_pull)` changes.
- **Local updates every H steps** (sync strategies): H-1 of H steps only compute and step
  locally; the H-th exchanges the parameters' change as a gradient, without overlap:
  `t_f + t_b + t_opt + T_exchange/H` (DDP: one flat piece, K = 1). **Streaming DiLoCo**
  (DDP) with F fragments exchanges a 1/F share of the model every H/F steps: `t_f + t_b +
  t_opt + F·T_exchange(G/F)/H`, the same bytes per step on average as F = 1 but 1/F of
  them at once (`peak_bytes`), the longest step `t_f + t_b + t_opt + T_exchange(G/F)`
  (`longest_step_s`): where a whole model's exchange stalls a step, fragments spread it
  over H/F times as many. Pseudo-gradients in fp16 or int8 (`training.outer_compression`)
  are all-gathered and each decoded: `T = (n-1)·P/F/β + (n-1)·α + (e + n·d)/F`. The
  parameter server's F fragments are groups of S/F whole shards: a fragment's push and
  pull are the sync round trip above with 1/F of the bytes and work on S/F shards (so a
  shard's link, when it bounds, carries as much as with F = 1). With a delay tau
  (`training.outer_delay`) an exchange overlaps the tau inner steps after its sync step
  and blocks only `max(0, T - tau·(t_f + t_b + t_opt))`; the exchanges share the link
  one after another, so a step takes at least `F·T/H` (`streaming_step_s`).
- **Sync waits for the slowest of n**: with step times of coefficient of variation cv,
  the expected slowest of n is about `t·(1 + cv·sqrt(2 ln n))` (normal tail); cv = 0
  (the default) assumes equal machines. The simulation (`advise.simulation`) answers
  for any distribution.

Samples per second are `n·B / step` (sync; async: updates/s · B), scaling efficiency is
that over n times one process alone (`B / (t_f + t_b + t_opt)`), and bytes per step are
what one worker sends and receives per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from disttrain.advise.link import Link
from disttrain.advise.payloads import compact_topk_nbytes, pull_change_bytes
from disttrain.advise.workload import CompressionCost, Workload
from disttrain.compression import collectives
from disttrain.compression.dgc import DgcRules
from disttrain.strategies.ps.wire.codec import CHUNK_BYTES
from disttrain.strategies.ps.wire.service import UNARY_MAX_BYTES
from disttrain.strategies.ps.worker.overlap_trial import MIN_GAIN

STRATEGIES = ("ddp", "ps-sync", "ps-async")
# topk-compact: top-k with `compression.compact` (fp16 values, varint index gaps)
COMPRESSIONS = ("none", "fp16", "bf16", "quantization", "topk", "topk-compact", "powersgd")
PULL_COMPRESSIONS = ("none", "fp16", "bf16", "quantization", "topk")
# Streaming DiLoCo's pseudo-gradients (`training.outer_compression`) -> the payload scheme
OUTER_COMPRESSIONS = {"none": "none", "fp16": "fp16", "int8": "quantization"}
DDP_ONLY = ("powersgd",)
# How far a compression departs from the exact gradient: the "cheapest" choice prefers less.
_LOSSINESS = {"none": 0, "fp16": 1, "bf16": 1, "quantization": 2, "int8": 2, "topk": 3, "topk-compact": 3,
              "powersgd": 3}
_HALF = ("fp16", "bf16")
_TOPK = ("topk", "topk-compact")


@dataclass(frozen=True)
class Candidate:
    """One way to run: strategy, push compression, shards (ps), local steps H (sync),
    pull compression (ps, H = 1), and Streaming DiLoCo's fragments F (DDP and the
    parameter server in sync mode, H > 1: `training.outer_fragments`; on the parameter
    server groups of whole shards, F <= S), pseudo-gradient compression (DDP:
    `training.outer_compression`) and delay tau (`training.outer_delay`, tau < H, without
    the run's compression)."""

    strategy: str
    compression: str = "none"
    num_servers: int = 0
    sync_every: int = 1
    pull: str = "none"
    fragments: int = 1
    outer: str = "none"
    delay: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression {self.compression!r} is not one of {', '.join(COMPRESSIONS)}")
        if self.strategy.startswith("ps") and self.num_servers < 1:
            raise ValueError("a parameter-server candidate needs num_servers >= 1")
        if self.strategy == "ps-async" and self.sync_every != 1:
            raise ValueError("local updates (sync_every > 1) are for the sync strategies only")
        if self.compression in DDP_ONLY and self.strategy != "ddp":
            raise ValueError(f"{self.compression} compresses DDP's all-reduce only")
        if self.pull not in PULL_COMPRESSIONS:
            raise ValueError(f"pull compression {self.pull!r} is not one of {', '.join(PULL_COMPRESSIONS)}")
        if self.pull != "none" and (not self.strategy.startswith("ps") or self.sync_every != 1):
            raise ValueError("pull compression is for the parameter server without local updates")
        if self.outer not in OUTER_COMPRESSIONS:
            raise ValueError(f"outer compression {self.outer!r} is not one of "
                             f"{', '.join(OUTER_COMPRESSIONS)}")
        streaming = self.fragments != 1 or self.outer != "none" or self.delay != 0
        if streaming and (self.strategy == "ps-async" or self.sync_every < 2):
            raise ValueError("fragments, outer compression and delay are Streaming DiLoCo's: local updates "
                             "(sync_every > 1) with DDP or the parameter server in sync mode")
        if self.outer != "none" and self.strategy != "ddp":
            raise ValueError("outer compression is DDP's (the parameter server compresses pushes by "
                             "its compression)")
        if not 1 <= self.fragments <= max(1, self.sync_every):
            raise ValueError(f"{self.fragments} fragments need 1 to H = {self.sync_every} of them")
        if self.strategy == "ps-sync" and self.fragments > self.num_servers:
            raise ValueError(f"{self.fragments} fragments are groups of whole shards: they need at least "
                             f"as many shards (num_servers is {self.num_servers})")
        if not 0 <= self.delay < max(1, self.sync_every):
            raise ValueError(f"delay {self.delay} must be in [0, H = {self.sync_every})")
        if self.outer != "none" and self.compression != "none":
            raise ValueError("outer compression replaces the run's compression: one of them")
        if self.delay and self.compression != "none":
            raise ValueError("a delayed exchange carries a plain or outer-compressed pseudo-gradient, "
                             "not the run's compression: one of them")

    def label(self) -> str:
        parts = [self.strategy if self.strategy == "ddp" else f"{self.strategy} S={self.num_servers}"]
        if self.compression != "none":
            parts.append(f"+{self.compression}")
        if self.pull != "none":
            parts.append(f"+pull-{self.pull}")
        if self.sync_every > 1:
            parts.append(f"H={self.sync_every}")
        if self.fragments > 1:
            parts.append(f"F={self.fragments}")
        if self.outer != "none":
            parts.append(f"+outer-{self.outer}")
        if self.delay:
            parts.append(f"tau={self.delay}")
        return " ".join(parts)

    def cost_key(self) -> tuple[int, int, int, int, int, int]:
        """Lower is cheaper: fewer extra machines (shards), a more exact gradient and
        parameters, fewer local steps between exchanges, synchronous before asynchronous,
        fresher outer results (a smaller delay), fewer fragments."""
        lossiness = _LOSSINESS[self.compression] + _LOSSINESS[self.pull] + _LOSSINESS[self.outer]
        return (self.num_servers, lossiness, self.sync_every, int(self.strategy == "ps-async"),
                self.delay, self.fragments)


@dataclass(frozen=True)
class RoundTrip:
    """A parameter-server step's communication, as the simulation replays it.

    A worker's push leaves `encode_s - overlap_s` after its compute ends and reaches the
    shards `push_s` later; each push then holds the shards for `service_s` (decoding, or
    for async the shards' busiest resource); a completed update takes `apply_s`; the new
    parameters reach a worker `pull_s` after it.
    """

    encode_s: float
    overlap_s: float
    push_s: float
    service_s: float
    apply_s: float
    pull_s: float


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    num_workers: int
    step_time_s: float
    samples_per_s: float
    efficiency: float
    bytes_per_step: float
    comm_s: float  # the step's time beyond compute that nothing hides
    details: dict[str, float] = field(default_factory=dict)
    collective: str = ""  # DDP's for a payload that cannot be summed (`compression.collectives`)

    def label(self) -> str:
        """The candidate's label, with the collective where it is not the plain all-gather."""
        shown = {collectives.TWO_PHASE: "two-phase", collectives.DENSE: "dense all-reduce"}
        return self.candidate.label() + (f" ({shown[self.collective]})" if self.collective in shown else "")

    def to_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {"configuration": self.label(), "collective": self.collective, "strategy": c.strategy,
                "compression": c.compression,
                "pull_compression": c.pull, "num_servers": c.num_servers, "sync_every": c.sync_every,
                "outer_fragments": c.fragments, "outer_compression": c.outer, "outer_delay": c.delay,
                "num_workers": self.num_workers,
                "step_time_s": self.step_time_s, "samples_per_s": self.samples_per_s,
                "efficiency": self.efficiency, "bytes_per_step": self.bytes_per_step,
                "comm_s": self.comm_s, "details": self.details}


@dataclass(frozen=True)
class CostModel:
    """The model of one workload on one link.

    Args:
        bucket_cap_bytes: DDP's bucket size (`ddp.bucket_cap_mb`).
        overlap: the parameter server pushes each shard's slice as backward produces it.
        compute_cv: coefficient of variation of the step's compute across workers.
        pull_ratio, pull_dense_every: pull compression's topk share and dense period
            (`compression.pull_ratio`, `compression.pull_dense_every`).
        overlap_trial: with overlap, each worker times its first steps overlapped and
            plain and keeps the overlap only on a clear win (`ps.overlap_trial_steps` > 0):
            the step is the overlapped one where it is more than 2% (`MIN_GAIN`) below the
            plain one, else the plain one; False: always overlapped, even where slower.
        overlap_contention_s: seconds an overlapped push's CPU work (serialising each
            shard's slice, gRPC's threads, the parameters brought back) adds to backward
            where no core is free to run it; 0: a core is free (the overlap costs nothing);
            `advise` passes the workload's measured one (`Workload.overlap_contention_s`).
        dgc: DGC's rules of the run's top-k (`DgcRules.of(compression)`): with a sparsity
            warm-up its payloads are self-describing blocks of varying length, whose
            lengths DDP all-gathers before them, as compact top-k's.
    """

    workload: Workload
    link: Link
    bucket_cap_bytes: float = 25 * 2**20
    overlap: bool = True
    compute_cv: float = 0.0
    pull_ratio: float = 0.01
    pull_dense_every: int = 100
    overlap_trial: bool = True
    overlap_contention_s: float = 0.0
    dgc: DgcRules | None = None

    # -- the pieces ------------------------------------------------------------------------

    def single_step_s(self) -> float:
        """One process alone: compute and optimizer."""
        return self.workload.compute_s + self.workload.optimizer_s

    def payload_bytes(self, compression: str) -> float:
        if compression == "none":
            return float(self.workload.gradient_bytes)
        return float(self._cost(compression).payload_bytes)

    def codec_s(self, compression: str) -> tuple[float, float]:
        """(encode, decode) seconds on the whole gradient; 0 for none."""
        if compression == "none":
            return 0.0, 0.0
        cost = self._cost(compression)
        return cost.encode_s, cost.decode_s

    def _cost(self, compression: str, pull: bool = False) -> CompressionCost:
        costs = self.workload.pull_compression if pull else self.workload.compression
        if compression == "topk-compact" and compression not in costs and "topk" in costs:
            # not measured: top-k's times, the compact block's expected bytes at its ratio
            topk = costs["topk"]
            itemsize = round(self.workload.gradient_bytes / max(1, self.workload.num_parameters))
            return replace(topk, scheme=compression, payload_bytes=round(compact_topk_nbytes(
                self.workload.num_parameters, topk.ratio, itemsize)))
        try:
            return costs[compression]
        except KeyError as e:
            raise ValueError(f"the workload has no measured cost for {'pull ' if pull else ''}compression "
                             f"{compression!r}") from e

    def pull_change_bytes(self, pull: str, num_servers: int) -> float:
        """Bytes of one version's pulled change over every shard (the parameters dense for none)."""
        if pull == "none":
            return float(self.workload.gradient_bytes)
        self._cost(pull, pull=True)
        if not self.workload.shapes:
            raise ValueError("the workload has no parameter shapes to size pulled changes by")
        itemsize = round(self.workload.gradient_bytes / max(1, self.workload.num_parameters))
        return float(pull_change_bytes(tuple(self.workload.shapes), num_servers, pull, self.pull_ratio,
                                       itemsize))

    def pull_bytes(self, pull: str, num_servers: int, behind: int = 1) -> float:
        """Bytes one worker pulls per step on average, `behind` versions behind the shards
        (sync: 1; async: each of the n workers moved them once since its last pull): the
        changes it missed, no more than the parameters dense, and the parameters dense
        when a dense version fell among them (see `server.broadcast`)."""
        dense = float(self.workload.gradient_bytes)
        if pull == "none":
            return dense
        crossing = min(1.0, behind / self.pull_dense_every)
        missed = min(behind * self.pull_change_bytes(pull, num_servers), dense)
        return crossing * dense + (1 - crossing) * missed

    def pull_codec_s(self, pull: str, num_servers: int = 1, behind: int = 1) -> tuple[float, float]:
        """(encode, decode) seconds of the pulled changes on the whole model, per step on
        average (dense versions have none): one change encoded per version, the changes
        a worker `behind` versions missed decoded (no more than a dense pull's worth); 0
        for none."""
        if pull == "none":
            return 0.0, 0.0
        cost, share = self._cost(pull, pull=True), (self.pull_dense_every - 1) / self.pull_dense_every
        decoded = 1 if behind == 1 else min(behind, max(1, int(self.workload.gradient_bytes
                                                               // self.pull_change_bytes(pull, num_servers))))
        return cost.encode_s * share, cost.decode_s * share * decoded

    def slowest_compute_s(self, num_workers: int) -> float:
        """Expected compute of the slowest of `num_workers` (what a sync step waits for)."""
        spread = self.compute_cv * math.sqrt(2 * math.log(num_workers)) if num_workers > 1 else 0.0
        return self.workload.compute_s * (1 + spread)

    @staticmethod
    def pipelined(backward_s: float, comm_s: float, num_pieces: int) -> float:
        """Backward and communication of `num_pieces` equal pieces, each sent once
        backward produced it: the later of the last piece's computation and the last
        piece's transfer."""
        k = max(1, num_pieces)
        return max(backward_s + comm_s / k, backward_s / k + comm_s)

    # -- DDP ---------------------------------------------------------------------------------

    def ddp_exchange_s(self, compression: str, n: int, share: float = 1.0,
                       pieces: int | None = None) -> tuple[float, float, int]:
        """(communication s, bytes one rank sends and receives, buckets) of one exchange of
        `share` of the gradient cut into `pieces` buckets (default: DDP's, by its cap)."""
        if n == 1:
            return 0.0, 0.0, 1
        link, g = self.link, share * self.workload.gradient_bytes
        encode_s, decode_s = (share * t for t in self.codec_s(compression))
        if compression == "powersgd":
            payload = share * self.payload_bytes(compression)
            buckets = pieces or max(1, math.ceil(g / self.bucket_cap_bytes))
            wire = 2 * (n - 1) / n * payload
            comm = link.transfer_s(wire) + 3 * 2 * (n - 1) * buckets * link.latency_s + encode_s + decode_s
            return comm, 2 * wire, buckets
        if compression in ("quantization", *_TOPK):
            payload, collective = share * self.payload_bytes(compression), self.ddp_collective(compression, n)
            buckets = pieces or max(1, math.ceil(g / self.bucket_cap_bytes))
            if collective == collectives.TWO_PHASE:
                # the hook's own chunks: each bucket's int8 values cut into n chunks, each
                # with a float32 scale, all-to-all then all-gather: (n - 1) chunks each way
                numel = share * self.workload.num_parameters
                wire = 2 * (n - 1) * (math.ceil(numel / (n * buckets)) + 4) * buckets
            else:
                wire = collectives.received_bytes(collective, n, payload, g)
            # collectives per bucket: two-phase's four (each phase's codes, then their
            # scales), a self-describing payload's lengths first (the hook gathers them
            # before it chooses between its gather and the dense all-reduce)
            calls, decodes = {collectives.GATHER: (1, n), collectives.TWO_PHASE: (4, 2),
                              collectives.DENSE: (2, 1)}[collective]
            if self.variable_payload(compression):
                calls += 1
            comm = (link.transfer_s(wire) + calls * (n - 1) * buckets * link.latency_s + encode_s
                    + decodes * decode_s)
            return comm, 2 * wire, buckets
        size = g / 2 if compression in _HALF else g
        buckets = pieces or max(1, math.ceil(size / self.bucket_cap_bytes))
        wire = 2 * (n - 1) / n * size
        comm = link.transfer_s(wire) + 2 * (n - 1) * buckets * link.latency_s + encode_s + decode_s
        return comm, 2 * wire, buckets

    def outer_exchange_s(self, outer: str, n: int, share: float) -> tuple[float, float]:
        """(communication s, bytes one rank sends and receives) of one Streaming DiLoCo
        exchange of `share` of the model's pseudo-gradient, in one piece: all-reduced
        (none), or each rank's fp16/int8 payload all-gathered and every one decoded."""
        if outer == "none":
            comm, wire, _ = self.ddp_exchange_s("none", n, share, pieces=1)
            return comm, wire
        if n == 1:
            return 0.0, 0.0
        scheme = OUTER_COMPRESSIONS[outer]
        payload = share * self.payload_bytes(scheme)
        encode_s, decode_s = (share * t for t in self.codec_s(scheme))
        wire = collectives.received_bytes(collectives.GATHER, n, payload, 0.0)
        return link_s(self.link, wire, n - 1) + encode_s + n * decode_s, 2 * wire

    def variable_payload(self, compression: str) -> bool:
        """Whether `compression`'s payloads vary in length from rank to rank: compact
        top-k's, and top-k's under DGC's sparsity warm-up (`Compressor.variable`)."""
        warmup = self.dgc is not None and self.dgc.warmup_steps > 0
        return compression == "topk-compact" or (compression == "topk" and warmup)

    def ddp_collective(self, compression: str, n: int) -> str:
        """The collective DDP's `compression.ddp_collective: auto` combines `compression`'s
        payloads with at `n` ranks ("" for a compression that all-reduces)."""
        if compression not in ("quantization", *_TOPK):
            return ""
        return collectives.cheapest(n, self.payload_bytes(compression), float(self.workload.gradient_bytes),
                                    compression == "quantization")

    def _ddp(self, c: Candidate, n: int) -> tuple[float, float, float, dict[str, float]]:
        w = self.workload
        compute = self.slowest_compute_s(n)
        if c.sync_every > 1:
            return self._local_updates(c, n, compute)
        comm, wire, buckets = self.ddp_exchange_s(c.compression, n)
        backward = compute - w.forward_s * compute / w.compute_s if w.compute_s else 0.0
        if self.ddp_collective(c.compression, n) == collectives.TWO_PHASE:
            tail = backward + comm  # its collectives run inside the hook: backward waits for them
        else:
            tail = self.pipelined(backward, comm, buckets)
        step = compute - backward + tail + w.optimizer_s
        return step, n * w.batch_size / step, wire, {"exchange_s": comm, "buckets": buckets}

    def _local_updates(self, c: Candidate, n: int, compute: float
                       ) -> tuple[float, float, float, dict[str, float]]:
        """DDP with local updates every H steps: the pseudo-gradient exchanged as one flat
        piece after the step that ends a round, nothing overlapping it; with F fragments
        (Streaming DiLoCo) a 1/F share every H/F steps: the same bytes per step on average,
        1/F of them at once, and the longest step shorter by as much of the exchange."""
        w, f = self.workload, c.fragments
        comm, wire = self.fragment_exchange(c, n)
        step, longest = streaming_step_s(compute + w.optimizer_s, comm, c)
        details = {"exchange_s": comm, "peak_bytes": wire, "longest_step_s": longest}
        return step, n * w.batch_size / step, f * wire / c.sync_every, details

    # -- parameter server ----------------------------------------------------------------------

    def round_trip(self, c: Candidate, n: int) -> RoundTrip:
        """The parameter server's communication at `n` workers (see `RoundTrip`)."""
        link, w = self.link, self.workload
        behind = n if c.strategy == "ps-async" else 1  # versions a worker's pull catches up
        # Streaming DiLoCo: one fragment's share of the bytes and work, on its S/F shards
        share, s = 1 / c.fragments, c.num_servers / c.fragments
        push_bytes = share * self.payload_bytes(c.compression)
        pull_bytes = share * self.pull_bytes(c.pull, c.num_servers, behind)
        encode_s, decode_s = (share * t for t in self.codec_s(c.compression))
        pull_encode_s, pull_decode_s = self.pull_codec_s(c.pull, s, behind)
        if c.strategy == "ps-async":
            # each update: the shards encode its change and add it to the broadcast copy
            _, pull_add_s = self.pull_codec_s(c.pull, s)
            service = max(link.transfer_s(push_bytes / s), link.transfer_s(pull_bytes / s),
                          (decode_s + w.optimizer_s + pull_encode_s + pull_add_s) / s)
            # the shard's share of the transfer runs beside the worker's: only what the
            # worker's own link takes beyond it comes before the shard's turn
            push = link.latency_s + max(0.0, link.transfer_s(push_bytes) - service)
            return RoundTrip(encode_s, 0.0, push, service, 0.0,
                             link.transfer_s(pull_bytes) + link.latency_s + pull_decode_s)
        push = max(link.transfer_s(push_bytes), link.transfer_s(n * push_bytes / s)) + link.latency_s
        pull = (max(link.transfer_s(pull_bytes), link.transfer_s(n * pull_bytes / s)) + link.latency_s
                + pull_decode_s)
        overlap = 0.0
        if self.overlap and c.sync_every == 1:
            pieces = self.push_pieces(c)
            overlap = min(w.backward_s, encode_s + push) * (pieces - 1) / pieces - self.overlap_contention_s
        apply = (share * w.optimizer_s + pull_encode_s + pull_decode_s) / s
        trip = RoundTrip(encode_s, overlap, push, decode_s / s, apply, pull)
        if overlap and self.overlap_trial:
            # the worker keeps the overlap only where it saves more than MIN_GAIN of the plain
            # step (`overlap_trial.judge`; a model's steps do not vary, so there is no spread)
            plain_step = self.slowest_compute_s(n) + self._sync_exchange_s(replace(trip, overlap_s=0.0), n)
            if overlap <= MIN_GAIN * plain_step:
                trip = replace(trip, overlap_s=0.0)
        return trip

    def push_pieces(self, c: Candidate) -> float:
        """How many parts of a synchronous step's push leave one after another as backward
        writes the gradient: a raw push whose shards each outgrow one message streams its
        1 MB pieces (`PSClient.streams`: across machines, apart from the pull), so all but
        the last piece can leave during backward; any other push goes shard by shard."""
        shard_bytes = self.workload.gradient_bytes / c.num_servers
        if c.compression == "none" and shard_bytes > UNARY_MAX_BYTES:
            return float(c.num_servers * math.ceil(shard_bytes / CHUNK_BYTES))
        return float(c.num_servers)

    @staticmethod
    def _sync_exchange_s(trip: RoundTrip, n: int) -> float:
        """A synchronous step's communication beyond compute: push, the n pushes' turns at
        the shards, the update, the pull."""
        return trip.encode_s - trip.overlap_s + trip.push_s + n * trip.service_s + trip.apply_s + trip.pull_s

    def fragment_exchange(self, c: Candidate, n: int) -> tuple[float, float]:
        """(seconds, bytes one worker sends and receives) of one exchange of local updates
        at `n` workers: the whole model's with one fragment, one fragment's (1/F of the
        bytes) with Streaming DiLoCo; DDP's as one flat piece (or its outer compression's
        all-gather), the parameter server's as a sync round trip on the fragment's shards.
        What `streaming_step_s` and the simulation's replay (`advise.local_simulation`) take.

        Raises:
            ValueError: `c` has no local updates (sync_every 1).
        """
        if c.sync_every < 2:
            raise ValueError(f"{c.label()} exchanges every step: no local updates to price")
        share = 1 / c.fragments
        if c.strategy == "ddp":
            if c.outer != "none":
                return self.outer_exchange_s(c.outer, n, share)
            comm, wire, _ = self.ddp_exchange_s(c.compression, n, share, pieces=1)
            return comm, wire
        wire = share * (self.payload_bytes(c.compression) + self.pull_bytes(c.pull, c.num_servers))
        return self._sync_exchange_s(self.round_trip(c, n), n), wire

    def _ps(self, c: Candidate, n: int) -> tuple[float, float, float, dict[str, float]]:
        w = self.workload
        trip = self.round_trip(c, n)
        behind = n if c.strategy == "ps-async" else 1
        # Streaming DiLoCo: one fragment's push and pull
        wire = (self.payload_bytes(c.compression) + self.pull_bytes(c.pull, c.num_servers, behind)) \
            / c.fragments
        if c.strategy == "ps-async":
            cycle = w.compute_s + trip.encode_s + trip.push_s + trip.service_s + trip.pull_s
            updates_per_s = min(n / cycle, 1 / trip.service_s)
            details = {"cycle_s": cycle, "shard_updates_per_s": 1 / trip.service_s}
            return n / updates_per_s, updates_per_s * w.batch_size, wire, details
        exchange = self._sync_exchange_s(trip, n)
        compute = self.slowest_compute_s(n)
        details = {"exchange_s": exchange, "push_s": trip.push_s, "pull_s": trip.pull_s}
        if c.sync_every == 1:
            step = compute + exchange
            return step, n * w.batch_size / step, wire, details
        # local updates: the workers step their own optimizers; an exchange every H/F steps
        exchange, wire = self.fragment_exchange(c, n)
        step, details["longest_step_s"] = streaming_step_s(compute + w.optimizer_s, exchange, c)
        details["peak_bytes"] = wire
        return step, n * w.batch_size / step, c.fragments * wire / c.sync_every, details

    # -- predictions ---------------------------------------------------------------------------

    def predict(self, c: Candidate, n: int) -> Prediction:
        """Step time, samples/s, efficiency and bytes of `c` at `n` workers."""
        if n < 1:
            raise ValueError(f"num_workers must be >= 1, not {n}")
        step, samples, wire, details = (self._ddp if c.strategy == "ddp" else self._ps)(c, n)
        single = self.single_step_s()
        efficiency = samples / (n * self.workload.batch_size / single)
        comm = max(0.0, step - (self.workload.compute_s if c.strategy == "ps-async" else single))
        collective = self.ddp_collective(c.compression, n) if c.strategy == "ddp" and n > 1 else ""
        return Prediction(c, n, step, samples, efficiency, wire, comm, details, collective)


def streaming_step_s(inner_step_s: float, exchange_s: float, c: Candidate) -> tuple[float, float]:
    """(mean step, longest step) of local updates every H steps in F fragments, each
    fragment's exchange taking `exchange_s` after its sync step, with `inner_step_s` of
    compute and optimizer a step: the exchange overlaps the `delay` inner steps after it
    and blocks its step only for what they do not hide, and the link carries the exchanges
    one after another, at least F·exchange/H a step whatever the delay."""
    blocked = max(0.0, exchange_s - c.delay * inner_step_s)
    mean = max(inner_step_s + c.fragments * blocked / c.sync_every, c.fragments * exchange_s / c.sync_every)
    return mean, inner_step_s + blocked


def link_s(link: Link, num_bytes: float, num_latencies: int) -> float:
    """Seconds `num_bytes` take on `link` behind `num_latencies` one-way latencies."""
    return link.transfer_s(num_bytes) + num_latencies * link.latency_s
