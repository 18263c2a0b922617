"""The communication options `advise` prices beyond the plain schemes, each on numbers
worked by hand and against what the real code writes: DDP's two-phase int8 all-reduce
(its chunks as `two_phase` cuts them), compact top-k payloads (a real `Compressor`'s
bytes), Streaming DiLoCo's fragments (the real `split_fragments`) and pseudo-gradient
compression; the candidates that include them, and a run's config read as one."""

from __future__ import annotations

import math

import pytest
import torch

from disttrain.advise import (
    Candidate,
    CompressionChoices,
    CompressionCost,
    CostModel,
    Link,
    Workload,
    advise,
    candidates,
)
from disttrain.advise.comparison import candidate_of
from disttrain.advise.payloads import compact_gap_bytes, compact_topk_nbytes
from disttrain.advise.workload import measure_compressor
from disttrain.compression import Compressor, collectives, two_phase
from disttrain.compression.ddp_hooks import resolved_collective
from disttrain.compression.dgc import DgcRules
from disttrain.config import load_config
from disttrain.training.fragments import split_fragments

MB = 1e6
NUM_PARAMETERS = 10_000_000  # 40 MB of float32 gradients


def workload(num_parameters: int = NUM_PARAMETERS, shapes: tuple[tuple[int, ...], ...] = ()) -> Workload:
    g = 4 * num_parameters
    costs = {"topk": CompressionCost("topk", 0.01, int(g / 50), 0.02, 0.005),
             "quantization": CompressionCost("quantization", 0.01, int(g / 4), 0.01, 0.004),
             "fp16": CompressionCost("fp16", 0.01, int(g / 2), 0.002, 0.001)}
    return Workload("test", num_parameters, g, 10, 32, 0.1, 0.2, 0.01, 0.0, "given", costs, shapes)


# -- two-phase int8 -------------------------------------------------------------------------


def test_two_phase_bytes_latencies_and_no_overlap_by_hand():
    model = CostModel(workload(), Link(1e8, 1e-3), bucket_cap_bytes=10 * MB)
    n, buckets = 8, 4
    assert model.ddp_collective("quantization", n) == "two_phase"
    comm, wire, found = model.ddp_exchange_s("quantization", n)
    # each bucket's 2.5 M int8 values in 8 chunks of 312,500 with a 4-byte scale each; a rank
    # receives 7 chunks in the all-to-all and 7 in the all-gather
    received = 2 * 7 * (312_500 + 4) * 4
    assert found == buckets and wire == pytest.approx(2 * received)
    assert received == pytest.approx(2 * 7 / 8 * 40 * MB / 4, rel=1e-4)  # 2(n-1)/n of G/4
    # four collectives a bucket (each phase's codes, then scales); encode, and two decodes
    assert comm == pytest.approx(received / 1e8 + 4 * 7 * 4 * 1e-3 + 0.01 + 2 * 0.004)
    # its collectives run inside the hook: backward waits for them, nothing overlaps
    step = model.predict(Candidate("ddp", "quantization"), n).step_time_s
    assert step == pytest.approx(0.1 + 0.2 + comm + 0.01)


@pytest.mark.parametrize("num_ranks", [3, 4, 7, 16])
@pytest.mark.parametrize("numel", [1_000, 12_345])
def test_two_phase_bytes_are_the_chunks_the_real_arithmetic_cuts(num_ranks, numel):
    gradient = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    codes, scales = two_phase.quantize_chunks(gradient, num_ranks)
    # phase 1: the chunks of the other ranks, with their scales; phase 2: their means, likewise
    chunk = codes.shape[1] * codes.element_size() + scales.element_size()
    received = 2 * (num_ranks - 1) * chunk
    model = CostModel(workload(numel), Link(1e9, 0.0))
    assert model.ddp_collective("quantization", num_ranks) == "two_phase"
    assert model.ddp_exchange_s("quantization", num_ranks, pieces=1)[1] == 2 * received


def test_two_phase_bytes_per_rank_stay_flat_as_ranks_are_added():
    model = CostModel(workload(), Link(1e9, 0.0))
    g = 40 * MB
    wires = {n: model.ddp_exchange_s("quantization", n)[1] for n in (3, 8, 64, 1024)}
    for n, wire in wires.items():
        # sent and received: 2 · 2(n-1)/n of the int8 gradient, a scale per chunk beside it
        assert 2 * 2 * (n - 1) / n * g / 4 <= wire <= 2 * 2 * (n - 1) / n * g / 4 * 1.001, n
    assert wires[1024] < 1.5 * wires[3]
    # the all-gather it replaces grows with n: (n-1) payloads received
    gathered = collectives.received_bytes(collectives.GATHER, 1024, model.payload_bytes("quantization"), g)
    assert gathered > 100 * wires[1024]


def test_the_model_and_the_hook_take_the_same_collective_at_every_size():
    keys = {"compression.enabled": True, "compression.type": "quantization"}
    section = load_config(None, keys, []).compression
    model = CostModel(workload(), Link(1e9, 0.0))
    for n in (2, 3, 8, 1024):
        assert model.ddp_collective("quantization", n) == resolved_collective(section, n)


# -- compact top-k --------------------------------------------------------------------------


def test_compact_top_k_bytes_by_hand():
    # 1% kept: a gap of 128 or more (2 bytes) has the chance 0.99^128; 16,384 or more: ~0
    assert compact_gap_bytes(0.01) == pytest.approx(1 + 0.99**128, abs=1e-9)
    assert compact_topk_nbytes(1_000_000, 0.01) == pytest.approx(9 + 10_000 * (2 + 1 + 0.99**128))
    assert 3.27 < (compact_topk_nbytes(1_000_000, 0.01) - 9) / 10_000 < 3.28
    assert compact_gap_bytes(1.0) == 1.0
    assert compact_topk_nbytes(4, 0.9) == 1 + 4 * 4  # never more than the dense values and a byte


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.05, 0.3])
def test_compact_top_k_bytes_are_what_the_real_compressor_writes(ratio):
    numel = 400_000
    gradient = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    encoded = Compressor("topk", ratio, compact=True).encode(gradient, [("w", 300_000), ("b", 100_000)])
    assert encoded.nbytes == pytest.approx(compact_topk_nbytes(numel, ratio), rel=0.01)
    plain = Compressor("topk", ratio).encode(gradient, [("w", 300_000), ("b", 100_000)])
    assert encoded.nbytes < 0.5 * plain.nbytes  # 3.3 bytes a kept element against 8


def test_compact_top_k_in_ddp_gathers_its_lengths_first_and_the_parameter_server_pushes_it():
    model = CostModel(workload(), Link(1e8, 1e-3), bucket_cap_bytes=10 * MB)
    payload = model.payload_bytes("topk-compact")  # not measured: the block's expected bytes
    assert payload == round(compact_topk_nbytes(NUM_PARAMETERS, 0.01))
    n = 8
    comm, wire, buckets = model.ddp_exchange_s("topk-compact", n)
    plain_comm, _, _ = model.ddp_exchange_s("topk", n)
    assert wire == pytest.approx(2 * 7 * payload)
    assert comm == pytest.approx(7 * payload / 1e8 + 2 * 7 * 4 * 1e-3 + 0.02 + 8 * 0.005)
    assert comm < plain_comm
    compact = model.predict(Candidate("ps-sync", "topk-compact", 1), 4)
    plain = model.predict(Candidate("ps-sync", "topk", 1), 4)
    assert plain.bytes_per_step - compact.bytes_per_step == pytest.approx(40 * MB / 50 - payload)
    assert compact.label() == "ps-sync S=1 +topk-compact"


def test_dgc_warm_up_payloads_vary_in_length_so_ddp_gathers_their_lengths_first():
    link = Link(1e8, 1e-3)
    plain = CostModel(workload(), link, bucket_cap_bytes=10 * MB)
    warm = CostModel(workload(), link, bucket_cap_bytes=10 * MB, dgc=DgcRules(warmup_steps=50))
    momentum_only = CostModel(workload(), link, bucket_cap_bytes=10 * MB, dgc=DgcRules(momentum=0.9))
    n, buckets = 8, 4
    assert warm.variable_payload("topk") and not momentum_only.variable_payload("topk")
    assert plain.ddp_collective("topk", n) == warm.ddp_collective("topk", n) == "gather"
    comm = {name: model.ddp_exchange_s("topk", n)[0]
            for name, model in (("plain", plain), ("warm", warm), ("momentum", momentum_only))}
    assert comm["warm"] - comm["plain"] == pytest.approx(7 * buckets * 1e-3)  # one more collective a bucket
    assert comm["momentum"] == comm["plain"]
    # a bucket whose payloads outgrow the ring goes dense: its lengths are gathered first all the same
    dense_n = 128
    assert warm.ddp_collective("topk", dense_n) == "dense"
    assert warm.ddp_exchange_s("topk", dense_n)[0] - plain.ddp_exchange_s("topk", dense_n)[0] == \
        pytest.approx(127 * buckets * 1e-3)


def test_the_measured_top_k_applies_the_runs_dgc_rules():
    numel = 100_000
    gradient = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    segments = [("w", 80_000), ("b", 20_000)]
    plain = measure_compressor(Compressor("topk", 0.01), gradient, segments, repeats=1)
    # under a warm-up the first payload keeps 25%: the rules reach the compressor timed
    warm = measure_compressor(Compressor("topk", 0.01, rules=DgcRules(warmup_steps=10, warmup_ratio=0.25)),
                              gradient, segments, repeats=1)
    assert warm.payload_bytes > 10 * plain.payload_bytes
    corrected = measure_compressor(Compressor("topk", 0.01, rules=DgcRules(momentum=0.9)), gradient, segments,
                                   repeats=1)
    assert corrected.payload_bytes == plain.payload_bytes and corrected.encode_s > 0


def test_a_measured_compact_payload_is_taken_as_measured():
    measured = workload()
    measured.compression["topk-compact"] = CompressionCost("topk-compact", 0.01, 123_456, 0.03, 0.01)
    model = CostModel(measured, Link(1e8, 1e-3))
    assert model.payload_bytes("topk-compact") == 123_456 and model.codec_s("topk-compact") == (0.03, 0.01)


# -- Streaming DiLoCo -----------------------------------------------------------------------


def test_fragments_keep_the_mean_bytes_and_cut_the_peak_by_hand():
    model = CostModel(workload(), Link(1e8, 1e-3))
    n, h = 4, 8
    whole = model.predict(Candidate("ddp", "none", 0, h), n)
    four = model.predict(Candidate("ddp", "none", 0, h, fragments=4), n)
    # one flat all-reduce of 10 MB: 2·3/4 of it, 2·3 latencies
    exchange = 2 * 3 / 4 * 10 * MB / 1e8 + 2 * 3 * 1e-3
    assert four.details["exchange_s"] == pytest.approx(exchange)
    assert four.step_time_s == pytest.approx(0.3 + 0.01 + 4 * exchange / h)
    assert whole.step_time_s == pytest.approx(0.3 + 0.01 + (2 * 3 / 4 * 40 * MB / 1e8 + 6e-3) / h)
    assert four.bytes_per_step == pytest.approx(whole.bytes_per_step)
    assert whole.bytes_per_step == pytest.approx(2 * 2 * 3 / 4 * 40 * MB / h)
    assert four.details["peak_bytes"] == pytest.approx(whole.details["peak_bytes"] / 4)
    # on this slow link the whole model's exchange stalls its step 0.6 s; a fragment's 0.15 s
    assert whole.details["longest_step_s"] == pytest.approx(0.31 + 0.606)
    assert four.details["longest_step_s"] == pytest.approx(0.31 + exchange)
    assert four.label() == "ddp H=8 F=4"


def test_int8_pseudo_gradients_are_gathered_by_hand():
    model = CostModel(workload(), Link(1e8, 1e-3))
    n, f = 4, 2
    prediction = model.predict(Candidate("ddp", "none", 0, 8, fragments=f, outer="int8"), n)
    payload = 40 * MB / 4 / f  # quantization's measured payload, half of it
    exchange = 3 * payload / 1e8 + 3 * 1e-3 + (0.01 + n * 0.004) / f
    assert prediction.details["exchange_s"] == pytest.approx(exchange)
    assert prediction.details["peak_bytes"] == pytest.approx(2 * 3 * payload)
    assert prediction.label() == "ddp H=8 F=2 +outer-int8"
    # gathered, its bytes grow with n: below the ring's under 8 ranks, above it beyond
    ring = [model.predict(Candidate("ddp", "none", 0, 8), k).bytes_per_step for k in (4, 16)]
    gathered = [model.predict(Candidate("ddp", "none", 0, 8, outer="int8"), k).bytes_per_step
                for k in (4, 16)]
    assert gathered[0] < ring[0] and gathered[1] > ring[1]


def test_fragments_of_a_real_model_are_the_shares_the_model_assumes():
    sizes = [32 * 1 * 3 * 3, 32, 64 * 32 * 3 * 3, 64, 128 * 9216, 128, 10 * 128, 10]  # SimpleCNN on MNIST
    total = sum(sizes)
    shapes = tuple((s,) for s in sizes)
    model = CostModel(workload(total, shapes), Link(1e8, 0.0))
    for f in (2, 4, 8):
        largest = max(sum(p.stop - p.start for p in fragment) for fragment in split_fragments(sizes, f))
        predicted = model.predict(Candidate("ddp", "none", 0, 8, fragments=f), 2).details["peak_bytes"]
        # the peak of one rank's ring: 2·(n-1)/n of the fragment, sent and received
        assert predicted == pytest.approx(2 * 4 * largest, rel=0.1)


def test_fragments_outer_compression_and_delay_are_refused_where_they_do_not_run():
    with pytest.raises(ValueError, match="local updates"):
        Candidate("ddp", "none", 0, 1, fragments=2)
    with pytest.raises(ValueError, match="local updates"):
        Candidate("ddp", "none", 0, 1, delay=1)
    with pytest.raises(ValueError, match="local updates"):
        Candidate("ps-async", "none", 2, 1, fragments=2)
    with pytest.raises(ValueError, match="groups of whole shards"):
        Candidate("ps-sync", "none", 1, 8, fragments=2)
    with pytest.raises(ValueError, match="outer compression is DDP's"):
        Candidate("ps-sync", "none", 2, 8, outer="int8")
    with pytest.raises(ValueError, match=r"delay 8 must be in \[0, H = 8\)"):
        Candidate("ddp", "none", 0, 8, delay=8)
    with pytest.raises(ValueError, match="not the run's compression"):
        Candidate("ddp", "fp16", 0, 8, delay=2)
    with pytest.raises(ValueError, match="1 to H = 4"):
        Candidate("ddp", "none", 0, 4, fragments=8)
    with pytest.raises(ValueError, match="one of them"):
        Candidate("ddp", "topk", 0, 8, outer="int8")
    with pytest.raises(ValueError, match="is not one of"):
        Candidate("ddp", "none", 0, 8, outer="int4")


# -- the candidates and a run's config ------------------------------------------------------


def test_the_candidates_include_every_option_the_workload_allows():
    found = candidates(8, sync_every=(1, 8), compressions=("none", "topk-compact"), outers=("none", "int8"))
    ddp = [c for c in found if c.strategy == "ddp"]
    assert {(c.sync_every, c.fragments, c.outer) for c in ddp if c.compression == "none"} == \
        {(1, 1, "none")} | {(8, f, o) for f in (1, 2, 4, 8) for o in ("none", "int8")}
    assert {c.delay for c in ddp if c.compression == "none"} == {0, 1, 2, 4}
    assert {c.delay for c in found if c.compression != "none"} == {0}  # a delay with plain pseudo-gradients
    # the parameter server's fragments: groups of whole shards, so no more than its shards
    ps = [c for c in found if c.strategy == "ps-sync" and c.sync_every == 8]
    assert {(c.num_servers, c.fragments) for c in ps} == {(s, f) for s in (1, 2, 4, 8) for f in (1, 2, 4, 8)
                                                          if f <= s}
    assert {c.delay for c in ps if c.compression == "none"} == {0, 1, 2, 4}
    assert {c.fragments for c in found if c.strategy == "ps-async" or c.sync_every == 1} == {1}
    assert not any(c.outer != "none" and c.compression != "none" for c in found)
    assert Candidate("ps-sync", "topk-compact", 8) in found
    # by default: top-k measured, its compact block too, which wins on a slow link
    slow = CostModel(workload(), Link(1e6, 1e-4))
    assert advise(slow, [8])[0].fastest.candidate == Candidate("ddp", "topk-compact")
    # quantization measured: int8 pseudo-gradients, gathered, half the ring's bytes at 4 ranks,
    # their exchange delayed behind inner steps
    local = advise(slow, [4], sync_every=(8,),
                   choices=CompressionChoices(pushes=("none",)))[0].fastest.candidate
    assert (local.strategy, local.outer) == ("ddp", "int8") and local.delay > 0


def test_a_runs_config_is_the_candidate_it_ran():
    def config(**keys):
        return load_config(None, keys, [])

    compact = config(**{"compression.enabled": True, "compression.type": "topk", "compression.compact": True})
    assert candidate_of({"strategy": "ddp"}, compact) == Candidate("ddp", "topk-compact")
    streaming = config(**{"training.sync_every": 8, "training.outer_fragments": 4,
                          "training.outer_compression": "int8"})
    assert candidate_of({"strategy": "ddp"}, streaming) == Candidate("ddp", "none", 0, 8, fragments=4,
                                                                     outer="int8")
    assert math.isfinite(CostModel(workload(), Link(1e8, 1e-4)).predict(
        candidate_of({"strategy": "ddp"}, streaming), 4).step_time_s)
