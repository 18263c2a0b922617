"""What `disttrain advise` shows: the measured workload and link, then one row per size of
run (the fastest configuration, the cheapest within 10% of it, the best of each strategy),
as terminal lines or one JSON document; and the simulations' summaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from disttrain.advise.choice import Advice
from disttrain.advise.costmodel import STRATEGIES
from disttrain.advise.link import Link
from disttrain.advise.simulation import SimulationResult
from disttrain.advise.workload import Workload


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.3g} MB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def workload_lines(workload: Workload, link: Link) -> list[str]:
    w = workload
    lines = [f"model {w.model}: {w.num_parameters / 1e6:.3g} M parameters, {_mb(w.gradient_bytes)} of "
             f"gradients in {w.num_tensors} tensors; batch {w.batch_size} per worker",
             f"step ({w.source}): forward {_ms(w.forward_s)} + backward {_ms(w.backward_s)}, "
             f"optimizer {_ms(w.optimizer_s)}; an overlapped push's CPU work adds "
             f"{_ms(w.overlap_contention_s)} to backward",
             f"link: {link.describe()}"]
    codecs = [f"{c.scheme} {_mb(c.payload_bytes)} (encode {_ms(c.encode_s)}, decode {_ms(c.decode_s)})"
              for c in w.compression.values()]
    pulled = w.pull_compression.get("topk")
    if pulled is not None and pulled.ratio != w.compression.get("topk", pulled).ratio:
        codecs.append(f"pulled topk at {pulled.ratio:g} (encode {_ms(pulled.encode_s)}, "
                      f"decode {_ms(pulled.decode_s)})")
    if codecs:
        lines.append("compressors on this gradient: " + "; ".join(codecs))
    return lines


def advice_lines(workload: Workload, link: Link, advice: Sequence[Advice]) -> list[str]:
    """The terminal table."""
    # as wide as the longest configuration named (pull compression makes them long)
    w = max([26, *(len(p.label()) for a in advice for p in (a.fastest, a.cheapest))])
    header = (f"{'workers':>7}  {'fastest':<{w}} {'samples/s':>10} {'step':>9} {'eff.':>5} {'MB/step':>8}  "
              f"{'cheapest within 10%':<{w}} {'samples/s':>10}  "
              + "  ".join(f"{s:>9}" for s in STRATEGIES))
    lines = [*workload_lines(workload, link), "", header]
    for a in advice:
        f, c = a.fastest, a.cheapest
        best = "  ".join(f"{a.best_by_strategy[s].samples_per_s:>9.4g}" for s in STRATEGIES)
        lines.append(f"{a.num_workers:>7}  {f.label():<{w}} {f.samples_per_s:>10.4g} "
                     f"{_ms(f.step_time_s):>9} {f.efficiency:>5.0%} {f.bytes_per_step / 1e6:>8.3g}  "
                     f"{c.label():<{w}} {c.samples_per_s:>10.4g}  {best}")
    lines.append("")
    lines.append("samples/s of the best configuration of each strategy on the right; eff.: samples/s over "
                 "n times one process alone; MB/step: what one worker sends and receives per step")
    return lines


def recommendation(advice: Sequence[Advice], num_workers: int) -> str:
    """One sentence for `num_workers` (the nearest size predicted)."""
    a = min(advice, key=lambda x: abs(x.num_workers - num_workers))
    f, c = a.fastest, a.cheapest
    text = (f"at {a.num_workers} workers: fastest {f.label()} ({f.samples_per_s:.4g} samples/s, "
            f"{f.efficiency:.0%} efficiency)")
    if c.candidate != f.candidate:
        text += f"; {c.label()} is within 10% ({c.samples_per_s:.4g} samples/s) for less"
    return text


def simulation_lines(results: Sequence[SimulationResult]) -> list[str]:
    lines = [f"{'simulated':<14} {'workers':>7} {'updates':>7} {'s/update':>10} {'samples/s':>10} "
             f"{'dropped':>8} {'staleness p50/p99/max':>22} {'wall':>7}"]
    for r in results:
        setup = r.setup
        name = {"local": f"H={setup.sync_every} F={setup.fragments} tau={setup.delay}",
                "sync": f"sync b={setup.backup_workers}" if setup.backup_workers else "sync",
                "ssp": f"ssp tau={setup.staleness_bound}", "async": "async"}[setup.mode]
        p50, p99, top = staleness_quantiles(r.staleness_histogram)
        lines.append(f"{name:<14} {setup.num_workers:>7} {r.num_updates:>7} {_ms(r.time_per_update_s):>10} "
                     f"{r.samples_per_s:>10.4g} {r.work_dropped_fraction:>8.1%} {f'{p50}/{p99}/{top}':>22} "
                     f"{r.wall_s:>6.1f}s")
    return lines


def staleness_quantiles(histogram: dict[int, int]) -> tuple[int, int, int]:
    """(median, 99th percentile, maximum) of a staleness histogram."""
    total = sum(histogram.values())
    if not total:
        return 0, 0, 0
    found: list[int] = []
    seen = 0
    targets = [0.5 * total, 0.99 * total]
    for value in sorted(histogram):
        seen += histogram[value]
        while targets and seen >= targets[0]:
            found.append(value)
            targets.pop(0)
    return found[0], found[1], max(histogram)


def advice_json(workload: Workload, link: Link, advice: Sequence[Advice],
                simulations: Sequence[SimulationResult] = ()) -> dict[str, Any]:
    return {"workload": workload.to_dict(), "link": link.to_dict(),
            "advice": [a.to_dict() for a in advice],
            "simulations": [r.to_dict() for r in simulations]}
