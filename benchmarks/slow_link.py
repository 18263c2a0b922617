"""Slow-link benchmark: the parameter server and DDP across hosts whose links are limited.

Hosts are Linux network namespaces on one bridge (the multi-host tests' network: needs
root and iproute2). The parameter server's shard runs on host a; the two workers (or the
two DDP nodes, 1 rank each, c10d rendezvous on host b) run on hosts b and c, whose links
are limited with `tc qdisc ... tbf` to each `--rates` value in both directions. For each
rate and each configuration (PS sync and async, each with and without top-k 1%, PS sync
with top-k 1% both ways, DDP with and without PowerSGD rank 2, PS sync and DDP with local
updates every 8 and 32 steps, and Streaming DiLoCo at 32 steps: 4 fragments, each
exchange overlapped with the next 2 steps, mixing 0.5, the PS's on 4 shards) it runs the
real commands and reports, from worker or rank 0's summary and metrics (logged at every
step): samples/s, the time to the workload's target on the training clock (null when
not reached: "reached_target" says so), the final figure and test loss, the bytes worker
0 sent and received, the largest exchange inside an epoch and the bytes of an epoch's
last step (`exchange_bytes`), and the share of the step it spent blocked in exchanges;
then a table of each configuration's final figure against its bytes. `--seed` seeds
every run (default: the config's, 42).

Workloads (`--workload`):
- mnist: MNIST, 1 epoch, to 97% test accuracy, when a copy is at hand (`--data-dir`,
  else $DISTTRAIN_DATA_DIR, ./data, ../shared/data); otherwise, and with `--quick`, the
  shipped digits for 6 epochs (about four minutes for the 22 runs on 2 cores).
- text: a 2-layer byte-level GPT (`gpt_small`, width 128, 0.4M parameters) on text the
  benchmark writes (Python's own standard library sources, the first 400 kB in name
  order; its SHA-256 is in the JSON), 3 epochs, to test perplexity 8.
The runs evaluate at each epoch's end, so a time to target is the end of the first epoch
whose evaluation reached it. On a model this small the links only hurt once they are
slow: what compression buys shows at 100 Mbit/s, not at 1 Gbit/s.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

from common import parse_args, report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "multihost"))
sys.path.insert(0, str(REPO / "tests"))
from conftest import find_real_data_dir  # noqa: E402
from netns import Network, read_event, unavailable_reason  # noqa: E402

from disttrain.core import new_token, write_token_file  # noqa: E402
from disttrain.metrics import ACCURACY, PERPLEXITY, TimeToTarget  # noqa: E402

DISTTRAIN = [sys.executable, "-m", "disttrain"]
TOPK = ["--compression-enabled", "--compression-type", "topk", "--compression-ratio", "0.01"]
POWERSGD = ["--compression-enabled", "--compression-type", "powersgd", "--powersgd-rank", "2"]
PULL_TOPK = ["--pull-compression", "topk", "--pull-ratio", "0.01"]  # the shards' answers too


def local(every: int) -> list[str]:
    """Local updates (DiLoCo's outer step: Nesterov, learning rate 0.7, momentum 0.9)."""
    return ["--sync-every", str(every), "--outer-optimizer", "nesterov", "--outer-lr", "0.7",
            "--outer-momentum", "0.9"]


def stream(fragments: int, delay: int = 2, mixing: float = 0.5) -> list[str]:
    """Streaming DiLoCo: `fragments` fragments, each exchange overlapped with the next
    `delay` inner steps and its result mixed by `mixing` (the paper's 0.5 with a delay)."""
    return ["--set", f"training.outer_fragments={fragments}", "--set", f"training.outer_delay={delay}",
            "--set", f"training.outer_mixing={mixing}"]


CONFIGS = {"ps-sync": ("ps", ["--aggregation-mode", "sync"]),
           "ps-sync+topk": ("ps", ["--aggregation-mode", "sync", *TOPK]),
           "ps-sync+topk-both": ("ps", ["--aggregation-mode", "sync", *TOPK, *PULL_TOPK]),
           "ps-sync+local8": ("ps", ["--aggregation-mode", "sync", *local(8)]),
           "ps-sync+local32": ("ps", ["--aggregation-mode", "sync", *local(32)]),
           "ps-sync+local32+stream4": ("ps", ["--aggregation-mode", "sync", *local(32), *stream(4)]),
           "ps-async": ("ps", ["--aggregation-mode", "async"]),
           "ps-async+topk": ("ps", ["--aggregation-mode", "async", *TOPK]),
           "ddp": ("ddp", []),
           "ddp+powersgd": ("ddp", POWERSGD),
           "ddp+local8": ("ddp", local(8)),
           "ddp+local32": ("ddp", local(32)),
           "ddp+local32+stream4": ("ddp", [*local(32), *stream(4)])}
# Every step's own record, so that an exchange's bytes and an epoch's last step are read
# from the metrics as they were, not from a window's means.
EVERY_STEP = ["--set", "training.log_interval=1"]
RUN_TIMEOUT_S = 900
TEXT_BYTES = 400_000
GPT = ["--model", "gpt_small", "--seq-len", "64", "--batch-size", "16", "--set",
       'training.model_args={"n_layer": 2, "n_head": 4, "n_embd": 128, "dropout": 0.0}']


@dataclass(frozen=True)
class Target:
    """A run is timed to `value` of the figure `measure` (the summary's own time-to-target
    record: its field of times, the target's key in it, the final figure's field)."""

    measure: TimeToTarget
    value: float

    @property
    def figure(self) -> str:
        return self.measure.name

    @property
    def times_field(self) -> str:
        return self.measure.field

    @property
    def key(self) -> str:
        return self.measure.key(self.value)

    @property
    def final_field(self) -> str:
        return self.measure.final_field


ACCURACY_97 = Target(ACCURACY, 0.97)
PERPLEXITY_8 = Target(PERPLEXITY, 8.0)


def extra_args(parser) -> None:
    parser.add_argument("--rates", default="1gbit,100mbit", help="tc rates, comma-separated")
    parser.add_argument("--workload", choices=("mnist", "text"), default="mnist",
                        help="mnist (to 97%% accuracy) or text (a small GPT, to perplexity 8)")
    parser.add_argument("--data-dir", type=Path, help="folder holding mnist/ (else digits)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which configurations")
    parser.add_argument("--seed", type=int, help="every run's seed (default: the config's, 42)")


def write_text(path: Path, size: int) -> str:
    """Write `size` bytes of Python's standard library sources (its modules in name order)
    to `path`: real text every machine has. Returns its SHA-256."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for source in sorted(stdlib.glob("*.py")):
        chunk = source.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
        if total >= size:
            break
    joined = b"".join(chunks)
    text = joined[:joined.rfind(b"\n", 0, size) + 1]  # whole lines: no character cut in two
    path.write_bytes(text)
    return hashlib.sha256(text).hexdigest()


def num_shards(flags: list[str]) -> int:
    """The parameter-server shards a configuration's flags need: one, or one per fragment
    (a Streaming DiLoCo fragment is a group of whole shards)."""
    fragments = [flag.split("=", 1)[1] for flag in flags if flag.startswith("training.outer_fragments=")]
    return int(fragments[-1]) if fragments else 1


def run_one(net: Network, kind: str, flags: list[str], data: list[str], target: Target, folder: Path
            ) -> dict:
    a, b, c = net.hosts["a"], net.hosts["b"], net.hosts["c"]
    env = {"OMP_NUM_THREADS": "1", "DISTTRAIN_PARENT_PID": str(os.getpid())}
    # The hosts listen beyond loopback, where every server asks for credentials: a run token.
    token = write_token_file(folder / "run.token", new_token())
    common = [*data, "--num-threads", "1", "--token-file", str(token), *EVERY_STEP, *flags]
    processes = []
    if kind == "ps":
        addresses, shards = [], num_shards(flags)
        common += ["--set", f"ps.num_servers={shards}"]
        for shard in range(shards):  # every shard on host a
            log = folder / f"server{shard}.out"
            server = a.start([*DISTTRAIN, "ps-server", "--bind", f"{a.address}:0", "--shard",
                              f"{shard}/{shards}", "--workers", "2", *common,
                              "--log-dir", str(folder / f"a{shard}"),
                              "--checkpoint-dir", str(folder / f"ckpt-a{shard}")], log, env)
            addresses.append(read_event(log, "listening", server)["address"])
        address = ",".join(addresses)
        for rank, host in enumerate((b, c)):
            processes.append(host.start(
                [*DISTTRAIN, "ps-worker", "--servers", address, "--rank", str(rank), "--worker-id",
                 f"worker{rank}", *common, "--log-dir", str(folder / host.name),
                 "--checkpoint-dir", str(folder / f"ckpt-{host.name}")], folder / f"{host.name}.out", env))
    else:
        log = folder / "coordinator.out"
        coordinator = a.start([*DISTTRAIN, "coordinator", "--bind", f"{a.address}:0", "--registry",
                               str(folder / "cluster.db"), "--token-file", str(token)], log, env)
        address = read_event(log, "listening", coordinator)["address"]
        for host in (b, c):
            processes.append(host.start(
                [*DISTTRAIN, "ddp", "--world-size", "2", "--nnodes", "2", "--rdzv-endpoint",
                 f"{b.address}:29400", "--rdzv-id", folder.name, "--backend", "gloo", "--coordinator",
                 address, *common, "--log-dir", str(folder / host.name),
                 "--checkpoint-dir", str(folder / "ckpt")], folder / f"{host.name}.out", env))
    codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in processes]
    for host in net.hosts.values():
        host.stop_processes()
        host.processes.clear()
    if any(codes):
        tails = {p.name: p.read_text()[-1500:] for p in folder.glob("*.out")}
        return {"status": "failed", "exit_codes": codes, "log_tails": tails}
    summary = json.loads((folder / "b" / "summary.json").read_text())
    reached = summary[target.times_field].get(target.key)
    records = train_records(folder / "b")
    sent, received = bytes_of_run(records)
    return {"status": "ok", "samples_per_s": round(summary["throughput_samples_per_s"], 1),
            "time_to_target_s": None if reached is None else round(reached, 3),
            "reached_target": reached is not None,
            f"final_{target.figure}": round(summary[target.final_field], 4),
            "final_loss": round(summary["final_loss"], 4),
            "train_time_s": round(summary["train_time_s"], 3), "steps": summary["steps"],
            "bytes_sent": sent, "bytes_received": received, "exchange_bytes": exchange_bytes(records),
            "comm_blocked_share": blocked_share(records)}


def train_records(folder: Path) -> list[dict]:
    """The training records of the metrics under `folder` (worker or rank 0's), in order."""
    metrics = next(folder.rglob("metrics.jsonl"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [record for record in records if "loss/train" in record]


def steps_of(records: list[dict]) -> list[tuple[dict, int]]:
    """Each record with the steps its window held (its step minus the previous record's)."""
    previous, out = 0, []
    for record in records:
        out.append((record, record["step"] - previous))
        previous = record["step"]
    return out


def sent_of(record: dict) -> float:
    """A record's per-step bytes sent: the compressed payload where compression ran, else
    the PS push or the DDP all-reduce."""
    return record.get("compression/bytes_sent",
                      record.get("comm/bytes_sent", record.get("comm/bytes_allreduced", 0.0)))


def bytes_of_run(records: list[dict]) -> tuple[int, int]:
    """Bytes worker (rank) 0 sent and received over the run: its windows' per-step means
    times their steps. Received: the PS pull (an all-reduce receives what it sends)."""
    sent = received = 0.0
    for record, steps in steps_of(records):
        sent += sent_of(record) * steps
        received += record.get("comm/bytes_received", sent_of(record)) * steps
    return round(sent), round(received)


def exchange_bytes(records: list[dict]) -> dict[str, int]:
    """The bytes of worker (rank) 0's exchanges, from records of one step each.

    Returns:
        "peak": the largest exchange inside an epoch (its last steps left out). With local
        updates an exchange is a run of consecutive steps that sent bytes, summed (a PS push
        overlapped with the next steps counts its bytes in the steps it ran through); on
        DDP the largest single collective of a step (`local/exchange_bytes`, one fragment's
        where an epoch's last step all-reduces every fragment in turn). Without local
        updates every step is an exchange. "epoch_end": the most an epoch's last step sent
        (with local updates every fragment's round ends there).

    Raises:
        ValueError: a record stands for more than one step (log every step).
    """
    last = {record["epoch"]: record["step"] for record in records}
    local = any("local/rounds" in record for record in records)
    peak = run = 0.0
    for record, steps in steps_of(records):
        if steps != 1:
            raise ValueError(f"the record of step {record['step']} stands for {steps} steps: "
                             "log every step (training.log_interval=1)")
        if record["step"] == last[record["epoch"]]:
            run = 0.0
        elif "local/exchange_bytes" in record:
            peak = max(peak, record["local/exchange_bytes"])
        elif local:
            run = run + sent_of(record) if sent_of(record) else 0.0
            peak = max(peak, run)
        else:
            peak = max(peak, sent_of(record))
    epoch_end = max((sent_of(r) for r in records if r["step"] == last[r["epoch"]]), default=0.0)
    return {"peak": round(peak), "epoch_end": round(epoch_end)}


def blocked_share(records: list[dict]) -> float:
    """The share of worker (rank) 0's step time spent blocked in exchanges: the sum of
    `time/comm_blocked_s` over the sum of `time/step_s`, each a window's mean times its steps."""
    blocked = sum(r.get("time/comm_blocked_s", 0.0) * steps for r, steps in steps_of(records))
    total = sum(r["time/step_s"] * steps for r, steps in steps_of(records))
    return round(blocked / total, 4) if total else 0.0


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], extra_args)
    # A SIGTERM (a timeout, a Ctrl-C'd make) unwinds the with-blocks, so the namespaces and
    # their processes are removed as on a normal exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    reason = unavailable_reason()
    if reason:  # skipped, not failed: `make bench` goes on with the others
        print(f"slow_link: skipped, cannot make network namespaces here: {reason}", file=sys.stderr)
        report("slow_link", {"skipped": f"cannot make network namespaces here: {reason}"}, args.output)
        return 0
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        print(f"slow_link: unknown configuration(s) {', '.join(unknown)} (known: {', '.join(CONFIGS)})",
              file=sys.stderr)
        return 2
    results: dict[str, dict[str, dict]] = {}
    with TemporaryDirectory(prefix="slow-link-") as scratch:
        workload = workload_of(args, Path(scratch))
        seeded = [] if args.seed is None else ["--seed", str(args.seed)]
        for rate in args.rates.split(","):
            with Network(["a", "b", "c"]) as net:
                for host in (net.hosts["b"], net.hosts["c"]):
                    host.limit_rate(rate)
                for name in names:
                    folder = Path(scratch) / f"{rate}-{name.replace('+', '-')}"
                    folder.mkdir()
                    kind, flags = CONFIGS[name]
                    results.setdefault(rate, {})[name] = run_one(
                        net, kind, [*seeded, *flags], workload["flags"], workload["target"], folder)
                    print(f"{rate:>8} {name:<24} {results[rate][name]}", file=sys.stderr, flush=True)
    target = workload["target"]
    table = bytes_table(results, target)
    print("\n".join(table), file=sys.stderr)
    report("slow_link", {"workload": args.workload, "data": " ".join(workload["flags"]),
                         **({"text_sha256": workload["sha256"]} if "sha256" in workload else {}),
                         "to": {"figure": target.figure, "value": target.value}, "workers": 2,
                         "seed": args.seed, "rates": results, "table": table}, args.output,
           target=f"at the slow rate: compression and local updates reach {target.figure} "
                  f"{target.value:g} sooner than the dense runs")
    return 0 if all(r["status"] == "ok" for runs in results.values() for r in runs.values()) else 1


def workload_of(args, scratch: Path) -> dict:
    """The data and model flags of `args.workload`, and its target."""
    if args.workload == "text":
        text = scratch / "stdlib.txt"
        sha256 = write_text(text, TEXT_BYTES // 4 if args.quick else TEXT_BYTES)
        epochs = "2" if args.quick else "3"
        return {"flags": ["--dataset", f"text:{text}", *GPT, "--num-epochs", epochs],
                "target": PERPLEXITY_8, "sha256": sha256}
    data_dir = None if args.quick else (args.data_dir or find_real_data_dir())
    flags = (["--dataset", "mnist", "--data-dir", str(data_dir), "--num-epochs", "1"] if data_dir
             else ["--dataset", "digits", "--num-epochs", "6"])
    return {"flags": flags, "target": ACCURACY_97}


def bytes_table(results: dict[str, dict[str, dict]], target: Target) -> list[str]:
    """A Markdown table: per rate and configuration, samples/s, the time to the target, the
    final figure and the megabytes worker 0 sent and received."""
    rows = [f"| rate | configuration | samples/s | time to {target.figure} {target.value:g} (s) | "
            f"final {target.figure} | MB sent | MB received |", "|---|---|---:|---:|---:|---:|---:|"]
    for rate, runs in results.items():
        for name, run in runs.items():
            if run["status"] != "ok":
                rows.append(f"| {rate} | {name} | failed | | | | |")
                continue
            reached = "not reached" if run["time_to_target_s"] is None else f"{run['time_to_target_s']:.1f}"
            rows.append(f"| {rate} | {name} | {run['samples_per_s']:,.0f} | {reached} | "
                        f"{run[f'final_{target.figure}']:.4g} | {run['bytes_sent'] / 1e6:,.1f} | "
                        f"{run['bytes_received'] / 1e6:,.1f} |")
    return rows


if __name__ == "__main__":
    sys.exit(main())
