"""One process's figures from its metrics.jsonl: samples, training clock, samples/s,
the mean time per step and its split, and the bytes it moved per step.

A window's per-step figures are means over its steps, so a process's mean weighs each
window by the steps it covers. Bytes "on the wire" per step are what a process's
exchange with its peers moved: a PS worker's `comm/bytes_sent` + `comm/bytes_received`
(gradients out, parameters back), a DDP rank's `compression/bytes_sent` when compression
is on, else `comm/bytes_allreduced`; 0 for the baseline, which moves none.
"""

from __future__ import annotations

from typing import Any

from disttrain.report.runs import Record, evaluations, finite, process_index, windows

# digest field -> the per-step metric key it is the mean of
PER_STEP_MEANS: dict[str, str] = {
    "step_time_s": "time/step_s",
    "compute_s": "time/compute_s",
    "comm_blocked_s": "time/comm_blocked_s",
    "comm_overlapped_s": "time/comm_overlapped_s",
    "compression_s": "time/compression_s",
    "bytes_sent_per_step": "comm/bytes_sent",
    "bytes_received_per_step": "comm/bytes_received",
    "bytes_allreduced_per_step": "comm/bytes_allreduced",
    "compression_bytes_sent_per_step": "compression/bytes_sent",
    "compression_bytes_dense_per_step": "compression/bytes_dense",
    "staleness": "ps/staleness",
}


def process_digest(name: str, records: list[Record]) -> dict[str, Any]:
    """The figures of process `name` from its records.

    Returns:
        A JSON-ready dict: process, index, num_steps, samples, train_time_s, samples_per_s,
        the `PER_STEP_MEANS` fields (None where the process never logged the key),
        comm_share (blocked communication / step time), wire_bytes_per_step, evaluates,
        final_accuracy, final_loss and final_perplexity (None unless the process evaluates;
        accuracy None for a language model, perplexity None for a classifier).
    """
    steps = [int(record["step"]) for record in records if "step" in record]
    samples = last_value(records, "progress/samples")
    train_time_s = last_value(records, "progress/train_time_s")
    means = {name: step_weighted_mean(records, key) for name, key in PER_STEP_MEANS.items()}
    step_time_s, blocked_s = means["step_time_s"], means["comm_blocked_s"]
    evaluated = evaluations(records)
    return {
        "process": name,
        "index": process_index(name),
        "num_steps": max(steps, default=0),
        "samples": int(samples) if samples is not None else 0,
        "train_time_s": train_time_s,
        "samples_per_s": samples / train_time_s if samples and train_time_s else None,
        **means,
        "comm_share": blocked_s / step_time_s if blocked_s is not None and step_time_s else None,
        "wire_bytes_per_step": wire_bytes_per_step(means),
        "evaluates": bool(evaluated),
        "final_accuracy": evaluated[-1].accuracy if evaluated else None,
        "final_loss": evaluated[-1].loss if evaluated else None,
        "final_perplexity": evaluated[-1].perplexity if evaluated else None,
    }


def wire_bytes_per_step(figures: dict[str, Any]) -> float:
    """Bytes a process moved per step, from its digest's per-step means (see the module)."""
    sent, received = figures.get("bytes_sent_per_step"), figures.get("bytes_received_per_step")
    if sent is not None or received is not None:
        return (sent or 0.0) + (received or 0.0)
    for name in ("compression_bytes_sent_per_step", "bytes_allreduced_per_step"):
        if figures.get(name) is not None:
            return float(figures[name])
    return 0.0


def step_weighted_mean(records: list[Record], key: str) -> float | None:
    """The mean per step of per-step metric `key` over every window that logged it, each
    weighted by the steps since the previous window; None when no window has it."""
    total, num_steps, previous_step = 0.0, 0, 0
    for record in windows(records):
        step = int(record["step"])
        covered = max(step - previous_step, 1)
        previous_step = step
        value = finite(record.get(key))
        if value is not None:
            total += value * covered
            num_steps += covered
    return total / num_steps if num_steps else None


def last_value(records: list[Record], key: str) -> float | None:
    """The largest value of cumulative metric `key` (None when never logged)."""
    values = [value for value in (finite(record.get(key)) for record in records) if value is not None]
    return max(values, default=None)


def mean_of(digests: list[dict[str, Any]], field: str) -> float | None:
    """The mean of `field` over the digests that have it (None when none has)."""
    values = [digest[field] for digest in digests if digest.get(field) is not None]
    return sum(values) / len(values) if values else None
