"""Gradient compression on real MNIST: bytes sent and final accuracy against the
uncompressed run of the same strategy and seed, and the time compressing takes per step
against the step's computation.

Training: real `disttrain ps` and `disttrain ddp` runs (2 workers or ranks, SimpleCNN,
batch 64, 1 epoch, one torch thread per process), each compressed run beside the
uncompressed one of its strategy. Bytes are the run's gradient payload bytes over the
dense bytes of the same steps (`compression_ratio` of summary.json); accuracy is the
final model's on the whole test set.

Time: in this process, on SimpleCNN gradients of real MNIST batches, the median of one
forward and backward pass (the compute of a step) against the median of compressing the
gradient and decoding it (PS: one decode on the server; DDP: one per rank, world size 2).
The runs' own `time/compression_s` over `time/compute_s` is reported beside it.

Targets: PS topk 0.01 (sync and async): bytes <= 2.5% of dense and accuracy within 0.5
points; PS quantization: >= 3.9x fewer bytes and accuracy within 0.2 points; compress +
decompress <= 15% of compute for SimpleCNN.

`--dgc`: top-k with Deep Gradient Compression's rules (momentum correction and masking,
local clipping, sparsity warm-up) and compact payloads, at ratio 0.001, against dense SGD
with momentum 0.9 (the DGC runs apply plain SGD: the momentum travels in the payload), on
the parameter server (sync) and DDP. Target: >= 100x fewer bytes than dense within 0.5
points of its accuracy.

One epoch's final accuracy moves by a few tenths of a point with the seed alone (the
same run with seeds 42, 1 and 2 ends 0.1-0.6 points apart), as large as the targets, so
the parameter-server runs of the checks are repeated with `--seeds` and each check
compares the mean accuracy over them; every run's figures are in the JSON.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import parse_args, report
from ps_helpers import data_dir, make_config

from disttrain.compression import Compressor
from disttrain.config import CompressionConfig
from disttrain.data import ShardedSampler, load_datasets
from disttrain.metrics import RunSummary, read_metrics
from disttrain.training import forward_backward, init_model

NUM_WORKERS = 2
TOPK = {"type": "topk", "ratio": 0.01}
QUANT = {"type": "quantization"}
# (name, strategy, aggregation mode, compression section or None)
RUNS = [
    ("ps-sync", "ps", "sync", None), ("ps-sync-topk", "ps", "sync", TOPK),
    ("ps-sync-quantization", "ps", "sync", QUANT),
    ("ps-async", "ps", "async", None), ("ps-async-topk", "ps", "async", TOPK),
    ("ddp", "ddp", None, None), ("ddp-quantization", "ddp", None, QUANT), ("ddp-topk", "ddp", None, TOPK),
    ("ddp-powersgd", "ddp", None, {"type": "powersgd", "powersgd_rank": 2}),
]
CHECKS = {  # run -> (max share of dense bytes, max accuracy loss in points, against run)
    "ps-sync-topk": (0.025, 0.5, "ps-sync"), "ps-async-topk": (0.025, 0.5, "ps-async"),
    "ps-sync-quantization": (1 / 3.9, 0.2, "ps-sync"),
    "ps-sync-dgc": (0.01, 0.5, "ps-sync"), "ps-async-dgc": (0.01, 0.5, "ps-async"),
    "ddp-dgc": (0.01, 0.5, "ddp"),
}


def dgc_runs(warmup_steps: int, clip_norm: float) -> list:
    """--dgc's runs: dense and DGC's top-k, on the parameter server (sync and async) and DDP."""
    dgc = {"type": "topk", "ratio": 0.001, "momentum_correction": 0.9, "local_clip_norm": clip_norm,
           "warmup_steps": warmup_steps, "warmup_ratio": 0.25, "compact": True}
    return [("ps-sync", "ps", "sync", None), ("ps-sync-dgc", "ps", "sync", dgc),
            ("ps-async", "ps", "async", None), ("ps-async-dgc", "ps", "async", dgc),
            ("ddp", "ddp", None, None), ("ddp-dgc", "ddp", None, dgc)]


def train(name: str, strategy: str, mode: str | None, compression: dict | None, folder: Path,
          limits: dict, seed: int = 42, optimizer: dict | None = None) -> dict:
    run_dir = folder / f"{name}-{seed}"
    training = {"num_epochs": 1, "log_interval": 20, "seed": seed, **limits, **(optimizer or {})}
    config = make_config(run_dir, training=training, num_workers=NUM_WORKERS, aggregation_mode=mode or "sync")
    if compression:
        config = config.replace(compression={"enabled": True, **compression})
        if compression.get("momentum_correction"):  # the momentum travels in the payload
            config = config.replace(training={"momentum": 0.0})
    config.save(run_dir / "config.yaml")
    extra = ["--world-size", str(NUM_WORKERS)] if strategy == "ddp" else []
    started = time.perf_counter()
    command = [sys.executable, "-m", "disttrain", strategy, "--config", str(run_dir / "config.yaml"), *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    summary = RunSummary.read(run_dir / "logs")
    ratio = summary.extra.get("compression_ratio", 1.0)
    metrics = read_metrics(run_dir / "logs" / ("worker0" if strategy == "ps" else "rank0") / "metrics.jsonl")
    steps = [r for r in metrics if "time/compute_s" in r]
    compression_s = statistics.mean(r.get("time/compression_s", 0.0) for r in steps)
    compute_s = statistics.mean(r["time/compute_s"] for r in steps)
    return {"seed": seed, "accuracy": summary.final_accuracy, "bytes_share_of_dense": 1 / ratio,
            "compression_ratio": ratio, "bytes_sent": summary.extra.get("compression_bytes_sent"),
            # PS: what the workers' pushes and pulls moved through gRPC or shared memory
            "wire_bytes_sent": summary.extra.get("bytes_sent"),
            "wire_bytes_received": summary.extra.get("bytes_received"),
            "steps": summary.steps, "learning_rate": config.training.learning_rate,
            "logged_compression_share_of_compute": compression_s / compute_s,
            "wall_s": time.perf_counter() - started}


def coding_times(repeats: int, dgc: dict | None = None) -> dict:
    """Median seconds of a step's compute and of each scheme's encode + decode(s)."""
    torch.set_num_threads(1)
    config = make_config(Path(tempfile.gettempdir()))
    train_set, _ = load_datasets(config.training)
    model = init_model(config.training)
    segments = [(name, p.numel()) for name, p in model.named_parameters()]
    batches = ShardedSampler(len(train_set), world_size=1, rank=0, seed=0).batches(64)
    compute, grads = [], []
    for _, indices in zip(range(repeats), batches, strict=False):
        inputs, targets = train_set.batch(indices)
        model.zero_grad()
        start = time.perf_counter()
        forward_backward(model, inputs, targets)
        compute.append(time.perf_counter() - start)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    out = {"compute_s": statistics.median(compute)}
    schemes = [("quantization", 1.0, False), ("quantization", 1.0, True), ("topk", 0.01, False),
               ("fp16", 1.0, False)]
    compressors = {f"{scheme}{'-stochastic' if stochastic else ''}":
                   Compressor(scheme, ratio, rounding_seed=0 if stochastic else None)
                   for scheme, ratio, stochastic in schemes}
    if dgc:
        compressors["topk-dgc"] = Compressor.from_config(CompressionConfig(enabled=True, **dgc), 0, 2)
    for name, compressor in compressors.items():
        decoded = torch.empty_like(grads[0])
        encode_s, decode_s = [], []
        for grad in grads:
            start = time.perf_counter()
            encoded = compressor.encode(grad, segments)
            compressor.commit(encoded)
            encode_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            compressor.decode(encoded.data, segments, decoded)
            decode_s.append(time.perf_counter() - start)
        enc, dec = statistics.median(encode_s), statistics.median(decode_s)
        out[name] = {"encode_s": enc, "decode_s": dec, "ps_share_of_compute": (enc + dec) / out["compute_s"],
                     "ddp_share_of_compute": (enc + 2 * dec) / out["compute_s"]}
    return out


def repeated(name: str, strategy: str, mode: str | None, compression: dict | None, folder: Path,
             limits: dict, seeds: list[int], optimizer: dict) -> dict:
    """The run once per seed (PS runs of the checks) or once (the rest), and their means."""
    seeds = seeds if strategy == "ps" else seeds[:1]
    optimizer = run_optimizer(optimizer, mode)
    runs = [train(name, strategy, mode, compression, folder, limits, seed, optimizer) for seed in seeds]
    wire = [r["wire_bytes_sent"] for r in runs]
    return {"accuracy": statistics.mean(r["accuracy"] for r in runs),
            "bytes_share_of_dense": statistics.mean(r["bytes_share_of_dense"] for r in runs),
            "wire_bytes_sent": statistics.mean(wire) if None not in wire else None,
            "learning_rate": optimizer["learning_rate"], "runs": runs}


def run_optimizer(optimizer: dict, mode: str | None) -> dict:
    """The optimizer a run of `mode` trains with: SGD in async mode takes the rate over the
    workers (each push is applied whole, so a step moves the model NUM_WORKERS times)."""
    if mode == "async" and optimizer["optimizer"] == "sgd":
        return {**optimizer, "learning_rate": optimizer["learning_rate"] / NUM_WORKERS}
    return optimizer


def recorded_optimizer(optimizer: dict, runs: dict) -> dict:
    """The JSON's top-level optimizer: the rate the runs trained with where they all took
    one (an async-only invocation: the rate over the workers), else null (each run records
    its own, `runs.NAME.learning_rate`)."""
    rates = {run["learning_rate"] for run in runs.values()}
    return {**optimizer, "learning_rate": rates.pop() if len(rates) == 1 else None}


def flags(parser) -> None:
    parser.add_argument("--seeds", default="42,1,2", help="seeds of the parameter-server runs")
    parser.add_argument("--only", help="comma-separated run names (default: all; the checks "
                        "need their runs)")
    parser.add_argument("--optimizer", default="adam", help="adam (the configs' default), or sgd "
                        "with momentum 0.9")
    parser.add_argument("--learning-rate", type=float, help="default: 0.001 (adam), 0.05 (sgd, --dgc); "
                        "sgd in async mode takes it over the 2 workers")
    parser.add_argument("--dgc", action="store_true", help="the DGC runs instead: dense SGD with momentum "
                        "0.9 against top-k 0.001 with DGC's rules and compact payloads (PS sync, DDP)")
    parser.add_argument("--dgc-warmup-steps", type=int, help="sparsity warm-up (default: 50; --quick: 8)")
    parser.add_argument("--dgc-clip", type=float, default=5.0, help="compression.local_clip_norm")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], flags)
    # --quick: a slice of the data and one seed, for a look in minutes (the whole test set otherwise)
    limits = {"max_train_samples": 4096, "max_test_samples": 1024} if args.quick else {}
    seeds = [int(s) for s in args.seeds.split(",")][:1 if args.quick else None]
    name_of_optimizer = "sgd" if args.dgc else args.optimizer
    learning_rate = args.learning_rate or (0.001 if name_of_optimizer == "adam" else 0.05)
    optimizer = {"optimizer": name_of_optimizer, "learning_rate": learning_rate, "momentum": 0.9}
    warmup = args.dgc_warmup_steps if args.dgc_warmup_steps is not None else 8 if args.quick else 50
    all_runs = dgc_runs(warmup, args.dgc_clip) if args.dgc else RUNS
    only = set(args.only.split(",")) if args.only else {name for name, *_ in all_runs}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: repeated(name, strategy, mode, compression, Path(tmp), limits, seeds, optimizer)
                for name, strategy, mode, compression in all_runs if name in only}
    checks = {}
    for name, (max_share, max_drop, against) in CHECKS.items():
        if not {name, against} <= set(runs):
            continue
        drop = 100 * (runs[against]["accuracy"] - runs[name]["accuracy"])
        share = runs[name]["bytes_share_of_dense"]
        # PS: the pushes' bytes on the wire against the dense run's (the same steps); DDP: none
        wire, dense_wire = runs[name]["wire_bytes_sent"], runs[against]["wire_bytes_sent"]
        wire_share = wire / dense_wire if wire and dense_wire else None
        checks[name] = {"bytes_share_of_dense": share, "wire_share_of_dense": wire_share,
                        "fewer_bytes_x": 1 / max(share, wire_share or 0.0), "max_share": max_share,
                        "mean_accuracy_drop_points": drop, "max_drop_points": max_drop,
                        "met": max(share, wire_share or 0.0) <= max_share and drop <= max_drop}
    compared = {"ddp-quantization", "ddp-topk", "ddp-powersgd", "ddp-dgc"}
    for name in compared & set(runs) if "ddp" in runs else ():
        runs[name]["accuracy_drop_points"] = 100 * (runs["ddp"]["accuracy"] - runs[name]["accuracy"])
    dgc = dgc_runs(warmup, args.dgc_clip)[1][3] if args.dgc else None
    times = coding_times(max(args.repeats, 20), dgc)
    report("compression", {"dataset": "mnist" if data_dir() else "synthetic", "seeds": seeds,
                           "optimizer": recorded_optimizer(optimizer, runs),
                           "runs": runs, "checks": checks, "coding_time": times}, args.output,
           target="DGC top-k 0.001: >= 100x fewer bytes than dense, accuracy within 0.5 points" if args.dgc
           else "PS topk 0.01 <= 2.5% of dense bytes, accuracy within 0.5 points; quantization "
                ">= 3.9x fewer bytes, within 0.2 points; encode + decode <= 15% of compute")


if __name__ == "__main__":
    main()
