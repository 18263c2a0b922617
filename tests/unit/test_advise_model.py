"""The link's spelling and the α-β cost model: each strategy's formula on numbers worked by
hand, and the choice of the fastest and the cheapest configuration near it."""

from __future__ import annotations

import math

import pytest

from disttrain.advise import (
    Candidate,
    CompressionCost,
    CostModel,
    Link,
    Workload,
    advise,
    candidates,
    choose,
    parse_link,
)
from disttrain.core.errors import ConfigError

PAYLOADS = ("none", "fp16", "bf16", "quantization", "topk")  # the measured compressors of `workload()`

MB = 1e6


def workload(forward_s=0.1, backward_s=0.2, optimizer_s=0.01, gradient_bytes=40 * MB) -> Workload:
    costs = {"topk": CompressionCost("topk", 0.01, int(gradient_bytes / 50), 0.02, 0.005),
             "quantization": CompressionCost("quantization", 0.01, int(gradient_bytes / 4), 0.01, 0.004),
             "fp16": CompressionCost("fp16", 0.01, int(gradient_bytes / 2), 0.002, 0.001),
             "bf16": CompressionCost("bf16", 0.01, int(gradient_bytes / 2), 0.002, 0.001)}
    return Workload("test", int(gradient_bytes / 4), int(gradient_bytes), 10, 32, forward_s, backward_s,
                    optimizer_s, 0.0, "given", costs)


@pytest.mark.parametrize("text, bandwidth, latency", [
    ("1gbit,0.2ms", 1e9 / 8, 2e-4),
    ("10Gbit, 50us", 10e9 / 8, 5e-5),
    ("100mbit,1ms", 100e6 / 8, 1e-3),
    ("512kbit,0.5s", 512e3 / 8, 0.5),
    ("2.5gbit,0s", 2.5e9 / 8, 0.0),
])
def test_link_spellings(text, bandwidth, latency):
    link = parse_link(text)
    assert link.bandwidth_bytes_per_s == pytest.approx(bandwidth)
    assert link.latency_s == pytest.approx(latency)


@pytest.mark.parametrize("text", ["1gigabit,2ms", "1gbit", "fast", "1gbit,2min", "0gbit,1ms", "gbit,1ms", ""])
def test_a_bad_link_spelling_names_the_accepted_form(text):
    with pytest.raises(ConfigError) as raised:
        parse_link(text)
    message = str(raised.value)
    assert "\n" not in message and "1gbit,0.2ms" in message and "kbit, mbit or gbit" in message


def test_ring_all_reduce_is_two_n_minus_one_over_n_of_the_bytes_and_two_n_minus_one_latencies():
    link = Link(1e8, 1e-3)
    model = CostModel(workload(), link, bucket_cap_bytes=10 * MB)
    comm, wire, buckets = model.ddp_exchange_s("none", 8)
    assert buckets == 4
    assert comm == pytest.approx(2 * 7 / 8 * 40 * MB / 1e8 + 2 * 7 * 4 * 1e-3)
    assert wire == pytest.approx(2 * 2 * 7 / 8 * 40 * MB)
    # buckets overlap with backward: the tail is the later of backward + the last bucket,
    # and the first bucket's readiness + every transfer
    prediction = model.predict(Candidate("ddp"), 8)
    tail = max(0.2 + comm / 4, 0.2 / 4 + comm)
    assert prediction.step_time_s == pytest.approx(0.1 + tail + 0.01)
    assert prediction.samples_per_s == pytest.approx(8 * 32 / prediction.step_time_s)


def test_one_ddp_rank_runs_as_one_process_and_more_ranks_lose_efficiency():
    model = CostModel(workload(), Link(1e8, 1e-3))
    alone = model.predict(Candidate("ddp"), 1)
    assert alone.efficiency == pytest.approx(1.0) and alone.bytes_per_step == 0
    efficiencies = [model.predict(Candidate("ddp"), n).efficiency for n in (2, 8, 64, 1024)]
    assert efficiencies == sorted(efficiencies, reverse=True) and efficiencies[-1] < 1


def test_top_k_gathers_until_its_payloads_outgrow_the_ring_then_goes_dense():
    model = CostModel(workload(), Link(1e8, 0.0))
    # a payload of G / 50: (n - 1) G / 50 against the ring's 2 (n - 1) / n G
    assert [model.ddp_collective("topk", n) for n in (2, 64, 100, 101, 1024)] == \
        ["gather", "gather", "gather", "dense", "dense"]
    ring = [model.ddp_exchange_s("none", n)[0] for n in (2, 64, 1024)]
    topk = [model.ddp_exchange_s("topk", n)[0] for n in (2, 64, 1024)]
    assert ring[2] < 2 * ring[0]  # 2(n-1)/n of the bytes: bounded
    assert topk[1] > 20 * topk[0]  # (n-1) payloads, and as many decodes, while they are the cheaper
    encode_s, decode_s = model.codec_s("topk")
    assert topk[2] == pytest.approx(ring[2] + encode_s + decode_s)  # then the ring's bytes


def test_int8_takes_two_phases_whose_bytes_stay_flat_and_the_table_says_so():
    model = CostModel(workload(), Link(1e8, 0.0))
    assert model.ddp_collective("quantization", 2) == "gather"
    assert {model.ddp_collective("quantization", n) for n in (3, 64, 1024)} == {"two_phase"}
    sizes = [model.ddp_exchange_s("quantization", n)[1] for n in (3, 64, 1024)]
    assert max(sizes) < 1.5 * min(sizes) and max(sizes) < 4 * model.payload_bytes("quantization")
    prediction = model.predict(Candidate("ddp", "quantization"), 64)
    assert prediction.label() == "ddp +quantization (two-phase)"
    assert prediction.to_dict()["collective"] == "two_phase"
    assert model.predict(Candidate("ddp", "topk"), 1024).label() == "ddp +topk (dense all-reduce)"
    assert model.predict(Candidate("ddp"), 64).label() == "ddp"


def test_parameter_server_shard_links_carry_n_over_s_of_the_traffic():
    link = Link(1e8, 1e-3)
    model = CostModel(workload(), link, overlap=False)
    g = 40 * MB
    one_shard = model.round_trip(Candidate("ps-sync", "none", 1), 8)
    assert one_shard.push_s == pytest.approx(8 * g / 1e8 + 1e-3)
    assert one_shard.pull_s == pytest.approx(8 * g / 1e8 + 1e-3)
    eight_shards = model.round_trip(Candidate("ps-sync", "none", 8), 8)
    assert eight_shards.push_s == pytest.approx(g / 1e8 + 1e-3)  # the worker's own link now binds
    step = model.predict(Candidate("ps-sync", "none", 8), 8).step_time_s
    assert step == pytest.approx(0.3 + eight_shards.push_s + 0.01 / 8 + eight_shards.pull_s)


def test_parameter_server_overlap_hides_all_but_the_last_shards_push_behind_backward():
    """Shards of 3 MB (one message each): a push goes shard by shard."""
    link = Link(1e9, 0.0)
    small = workload(gradient_bytes=12 * MB)
    without = CostModel(small, link, overlap=False).predict(Candidate("ps-sync", "none", 4), 4)
    with_overlap = CostModel(small, link, overlap=True).predict(Candidate("ps-sync", "none", 4), 4)
    push = 12 * MB / 1e9
    assert without.step_time_s - with_overlap.step_time_s == pytest.approx(min(0.2, push) * 3 / 4)


@pytest.mark.parametrize("servers, pieces", [(1, 39), (4, 40)])
def test_a_raw_push_of_shards_over_one_message_hides_all_but_its_last_piece(servers, pieces):
    """Shards over 4 MB stream their 1 MiB pieces as backward writes them (40 MB: 39 pieces
    in one shard, 10 in each of four): all but the last can leave during backward; a
    compressed push still goes shard by shard."""
    link = Link(1e9, 0.0)
    without = CostModel(workload(), link, overlap=False).predict(Candidate("ps-sync", "none", servers), 4)
    model = CostModel(workload(), link, overlap=True)
    assert model.push_pieces(Candidate("ps-sync", "none", servers)) == pieces
    streamed = model.predict(Candidate("ps-sync", "none", servers), 4)
    push = max(40 * MB / 1e9, 4 * 40 * MB / servers / 1e9)
    assert without.step_time_s - streamed.step_time_s == pytest.approx(min(0.2, push) * (pieces - 1) / pieces)
    assert model.push_pieces(Candidate("ps-sync", "quantization", servers)) == servers


def test_compression_trades_bytes_for_compute():
    model = CostModel(workload(), Link(1e7, 0.0), overlap=False)
    dense = model.predict(Candidate("ps-sync", "none", 1), 1)
    topk = model.predict(Candidate("ps-sync", "topk", 1), 1)
    assert topk.bytes_per_step == pytest.approx(40 * MB / 50 + 40 * MB)
    saved_s = (40 * MB - 40 * MB / 50) / 1e7
    assert topk.step_time_s == pytest.approx(dense.step_time_s - saved_s + 0.02 + 0.005)


def test_async_is_capped_by_what_a_shard_can_apply():
    model = CostModel(workload(optimizer_s=0.0), Link(1e8, 0.0))
    cap = 1e8 / (40 * MB)  # updates/s one shard's link carries
    rates = [model.predict(Candidate("ps-async", "none", 1), n).samples_per_s / 32 for n in (1, 1024)]
    assert rates[0] < cap and rates[1] == pytest.approx(cap)
    assert model.predict(Candidate("ps-async", "none", 4), 1024).samples_per_s / 32 == pytest.approx(4 * cap)


def test_local_updates_divide_the_exchange_by_h():
    model = CostModel(workload(), Link(1e7, 1e-3))
    # DDP's local rounds all-reduce the pseudo-gradient as one flat piece: 2(n-1) latencies
    one_piece = 2 * 15 / 16 * 40 * MB / 1e7 + 2 * 15 * 1e-3
    assert model.ddp_exchange_s("none", 16, pieces=1)[0] == pytest.approx(one_piece)
    h8 = model.predict(Candidate("ddp", "none", 0, 8), 16)
    assert h8.step_time_s == pytest.approx(0.3 + 0.01 + one_piece / 8)
    assert h8.bytes_per_step == pytest.approx(model.predict(Candidate("ddp"), 16).bytes_per_step / 8)


def test_sync_waits_for_the_expected_slowest_of_n():
    model = CostModel(workload(), Link(1e12, 0.0), compute_cv=0.1)
    assert model.slowest_compute_s(1) == pytest.approx(0.3)
    assert model.slowest_compute_s(64) == pytest.approx(0.3 * (1 + 0.1 * math.sqrt(2 * math.log(64))))


def test_candidates_never_have_more_shards_than_workers():
    found = candidates(4, max_servers=64, sync_every=(1, 8))
    assert max(c.num_servers for c in found) == 4
    assert not any(c.strategy == "ps-async" and c.sync_every > 1 for c in found)
    assert {c.compression for c in found} == {"none", "fp16", "bf16", "quantization", "topk", "topk-compact",
                                              "powersgd"}
    assert {c.strategy for c in found if c.compression == "powersgd"} == {"ddp"}
    pulled = candidates(4, pulls=("none", "topk"))
    assert {c.strategy for c in pulled if c.pull != "none"} == {"ps-sync", "ps-async"}
    assert not any(c.pull != "none" and c.sync_every > 1 for c in pulled)
    assert len(pulled) == len(found) - len([c for c in found if c.sync_every > 1]) + len(
        [c for c in pulled if c.pull == "topk"])


def test_choose_the_fastest_and_the_cheapest_within_ten_percent():
    model = CostModel(workload(), Link(1e8, 1e-4))
    predictions = [model.predict(c, 64) for c in candidates(64, sync_every=(1, 8), compressions=PAYLOADS)]
    fastest, cheapest = choose(predictions)
    assert fastest.samples_per_s == max(p.samples_per_s for p in predictions)
    assert cheapest.samples_per_s >= 0.9 * fastest.samples_per_s
    cheaper = [p for p in predictions if p.candidate.cost_key() < cheapest.candidate.cost_key()]
    assert cheaper and all(p.samples_per_s < 0.9 * fastest.samples_per_s for p in cheaper)


def test_a_slow_link_makes_compression_win_and_a_fast_one_plain_ddp():
    slow = advise(CostModel(workload(), parse_link("100mbit,1ms")), [64], sync_every=(1,))[0]
    fast = advise(CostModel(workload(), parse_link("400gbit,1us")), [64], sync_every=(1,))[0]
    assert slow.fastest.candidate.compression != "none"
    assert fast.cheapest.candidate == Candidate("ddp")
