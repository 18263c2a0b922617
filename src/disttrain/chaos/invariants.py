"""What every run under faults must keep, read from what it left on disk.

The figures come from the run's own records of what it did (each shard's newest
checkpoint: its data ledger, the samples it applied and the step it reached; a live DDP
group's ledger of global batches; the final model; the coordinator's registry), never
from counters a process reports about itself. Each check returns the violations it
found, one line each (none: the invariant holds).

- `check_exit`: the run finished (exit 0, a summary), or stopped with a last line that
  names the cause and the command that continues it (`--resume`).
- `check_ps_ledgers`: every shard applied every sample of every epoch exactly once (its
  applied samples are the run's, its ledger the same blocks as every other shard's), every
  worker done, and in sync mode every shard at one step.
- `check_ddp`: restart mode: the final model bit-identical to the fault-free run's;
  live mode: every global batch of every epoch applied once, by the ledger of the final
  checkpoint, and no rank restarted that no fault touched (survivors keep their processes).
- `check_identical`: a final model bit-identical to the fault-free run's (restart mode; a
  sync run only preempted and resumed on its own size).
- `check_ddp_end`: a run resumed on another number of ranks ended where the run ends: its
  newest checkpoint at the last step, past the last epoch, of the ranks it ended on, and
  every sample of every epoch counted once.
- `check_live_end`: a live elastic group's summary: every global batch of every epoch
  applied once (none lost, none twice), the run's last step reached, and no rank started
  again that no fault touched (by its launcher's record).
- `check_accuracy`: within 1 point of the fault-free run of the same seed (of the
  spread of several, for a mode whose runs differ by the order pushes arrive in).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from disttrain.chaos.scenarios import Scenario
from disttrain.coordinator.registry import RegistryError, read_status
from disttrain.core.checkpoint import latest_checkpoint, load_checkpoint
from disttrain.core.errors import CheckpointError

MAX_ACCURACY_GAP = 0.01
FINAL_MODELS = {"ps": "parameter_server_final.pt", "ddp": "ddp_final.pt"}


def check_exit(code: int, last_line: str, summary_found: bool) -> list[str]:
    """A finished run left its summary; a stopped one says why and how to go on."""
    if code == 0:
        return [] if summary_found else ["exited 0 without writing summary.json"]
    problems = []
    if not last_line.strip():
        problems.append(f"stopped (exit {code}) without a last line saying why")
    elif "Traceback" in last_line or last_line.lstrip().startswith(("File ", "raise ")):
        problems.append(f"stopped (exit {code}) with a traceback, not a message: {last_line!r}")
    elif "--resume" not in last_line:
        problems.append(f"stopped (exit {code}) without the command that continues it (--resume): "
                        f"{last_line!r}")
    return problems


def _newest(folder: Path) -> tuple[Path | None, dict[str, Any] | None, str | None]:
    """The newest complete checkpoint in `folder` and its state, or why there is none."""
    try:
        path = latest_checkpoint(folder)
        return (path, load_checkpoint(path), None) if path is not None else (None, None, "no checkpoint")
    except (CheckpointError, OSError) as e:
        return None, None, str(e)


def reassigned_workers(log_dir: Path) -> set[int]:
    """The ranks of the workers the coordinator reassigned at some point of the run (their
    blocks were taken over by the others), from its registry's events."""
    try:
        snapshot = read_status(log_dir / "cluster.db", max_events=1_000_000)
    except RegistryError:
        return set()
    ranks = {node["node_id"]: node["rank"] for node in snapshot.nodes}
    return {ranks[e["node_id"]] for e in snapshot.events
            if e["kind"] == "reassigned" and e["node_id"] in ranks}


def check_ps_ledgers(scenario: Scenario, checkpoint_dir: Path, reassigned: Iterable[int] = (), *,
                     workers: int | None = None, end_step: int | None = None) -> list[str]:
    """Every shard's newest checkpoint holds every sample once (see the module docstring).
    Every worker is done on every shard, but one `reassigned` (taken over while away) that
    came back after the others ended, or never: its samples are in the counts all the same.
    `workers`: the workers of the run's last launch (a resumed run may have another
    number); `end_step`: the step every shard of a sync run must have ended at."""
    problems, ledgers, steps = [], {}, {}
    taken_over = set(reassigned)
    workers = scenario.workers if workers is None else workers
    for shard in range(scenario.servers):
        path, state, why = _newest(checkpoint_dir / f"server{shard}")
        if state is None:
            problems.append(f"shard {shard}: {why} in {checkpoint_dir / f'server{shard}'}")
            continue
        rules = state["rules"]
        applied = int(rules["counts"]["samples"])
        if applied != scenario.total_samples:
            kind = "lost" if applied < scenario.total_samples else "applied twice"
            problems.append(f"shard {shard} ({path.name}): {applied} samples applied, not "
                            f"{scenario.total_samples} (samples {kind})")
        done = set(rules["done"])
        if done | taken_over != set(range(workers)):
            problems.append(f"shard {shard}: workers {sorted(done)} done of {workers}")
        ledgers[shard] = set(rules["ledger"]["blocks"])
        steps[shard] = int(rules.get("sync_step", 0))
    if ledgers and len({frozenset(blocks) for blocks in ledgers.values()}) > 1:
        union = set().union(*ledgers.values())
        missing = {shard: sorted(union - blocks)[:5] for shard, blocks in ledgers.items() if union - blocks}
        problems.append(f"the shards' ledgers differ: blocks missing by shard {missing}")
    if scenario.mode == "sync" and len(set(steps.values())) > 1:
        problems.append(f"the shards ended at different steps: {steps}")
    elif scenario.mode == "sync" and end_step is not None and steps and set(steps.values()) != {end_step}:
        problems.append(f"the shards ended at step {max(steps.values())}, not at the run's last, {end_step}")
    return problems


def check_final_model(scenario: Scenario, checkpoint_dir: Path) -> tuple[list[str], dict[str, Any] | None]:
    """The final model is there and loads; its state."""
    path = checkpoint_dir / FINAL_MODELS[scenario.command]
    try:
        return [], load_checkpoint(path)
    except (CheckpointError, OSError) as e:
        return [f"the final model {path} cannot be read: {e}"], None


def check_identical(model: dict[str, Any] | None, reference_model: dict[str, Any] | None,
                    promise: str) -> list[str]:
    """The final `model` bit-identical to the fault-free run's (`promise`: who promises it,
    as the violation says); nothing to compare when either is missing (its own check says so)."""
    if model is None or reference_model is None:
        return []
    different = [name for name, tensor in model["model"].items()
                 if not torch.equal(tensor, reference_model["model"][name])]
    if different:
        return [f"the final model differs from the fault-free run's in {len(different)} "
                f"tensor(s) ({', '.join(different[:3])}); {promise} promises it bit-identical"]
    return []


@dataclass(frozen=True)
class DdpExpectation:
    """What the checks of a DDP run take from its schedule.

    Attributes:
        restarted: the ranks a fault may have restarted.
        exact: whether the final model must be the fault-free run's (None: the
            scenario's; not across a change of the number of ranks).
        registry: whether the survivors' processes are read from the coordinator's
            registry (not where a rank was held past the heartbeat timeout: the coordinator
            declares it dead and counts its registering again as a restart;
            `check_live_end` reads the launcher's own record instead).
    """

    restarted: frozenset[int] = frozenset()
    exact: bool | None = None
    registry: bool = True


def check_ddp(scenario: Scenario, checkpoint_dir: Path, log_dir: Path, reference_model: dict | None,
              expect: DdpExpectation = DdpExpectation()) -> list[str]:
    """DDP's promise for its recovery mode (see the module docstring), as `expect` says."""
    problems, model = check_final_model(scenario, checkpoint_dir)
    if scenario.exact if expect.exact is None else expect.exact:
        problems += check_identical(model, reference_model, "restart mode")
    if scenario.mode == "live":
        problems += _live_ledger(scenario, checkpoint_dir)
        problems += _survivors_kept(log_dir, set(expect.restarted)) if expect.registry else []
    return problems


def check_ddp_end(scenario: Scenario, checkpoint_dir: Path, summary: dict[str, Any] | None,
                  world_size: int) -> list[str]:
    """A DDP run that ended on `world_size` ranks (maybe not its first launch's) ended where
    the run ends: its newest checkpoint at the last step and past the last epoch, its
    sampler at the start of no further epoch, of `world_size` ranks; and its summary
    counts every sample of every epoch once (the global batch is kept across a resize)."""
    path, state, why = _newest(checkpoint_dir)
    if state is None:
        return [f"no checkpoint to read the run's end from: {why}"]
    problems = []
    position, sampler = state.get("position", {}), state.get("sampler", {})
    if (position.get("step"), position.get("epoch")) != (scenario.total_steps, scenario.epochs):
        problems.append(f"{path.name}: the run ended at step {position.get('step')} of epoch "
                        f"{position.get('epoch')}, not step {scenario.total_steps} after epoch "
                        f"{scenario.epochs}")
    if sampler.get("position") != 0 or state.get("world_size") != world_size:
        problems.append(f"{path.name}: a sampler at position {sampler.get('position')} of "
                        f"{state.get('world_size')} ranks, not 0 of {world_size}")
    samples, expected = (summary or {}).get("samples_processed"), scenario.epochs * scenario.train_samples
    if samples != expected:
        problems.append(f"the run processed {samples} samples, not {expected} ({scenario.epochs} epochs "
                        f"of {scenario.train_samples})")
    return problems


def check_live_end(scenario: Scenario, summary: dict[str, Any] | None, killed: Iterable[int] = ()
                   ) -> list[str]:
    """A live group that changed size while it ran (its global batch kept: `--batch-size` x
    MIN) applied every global batch of every epoch once by its summary's ledger figures,
    ended at the run's last step, and the run's launcher started each of its ranks once
    (`rank_pids`) but those `killed`."""
    if summary is None:
        return ["no summary to read the live group's ledger from"]
    global_batch = scenario.batch_size * scenario.workers
    expected = scenario.epochs * (scenario.train_samples // global_batch) * global_batch
    problems = []
    lost, twice = summary.get("samples_lost"), summary.get("samples_applied_twice")
    if (lost, twice) != (0, 0) or summary.get("samples_applied") != expected:
        problems.append(f"the group applied {summary.get('samples_applied')} samples, not {expected} "
                        f"({lost} lost, {twice} applied twice)")
    if summary.get("steps") != scenario.total_steps:
        problems.append(f"the group ended at step {summary.get('steps')}, not the run's last, "
                        f"{scenario.total_steps}")
    restarted = {slot: pids for slot, pids in summary.get("rank_pids", {}).items()
                 if len(pids) > 1 and int(slot) not in set(killed)}
    problems += [f"rank {slot} was started {len(pids)} times (pids {pids}) though no fault touched it "
                 "(live recovery keeps the survivors' processes)" for slot, pids in restarted.items()]
    return problems


def _live_ledger(scenario: Scenario, checkpoint_dir: Path) -> list[str]:
    path, state, why = _newest(checkpoint_dir)
    if state is None:
        return [f"no live checkpoint to read the ledger from: {why}"]
    ledger = state.get("ledger")
    if ledger is None:
        return [f"{path.name} holds no ledger"]
    ledger = torch.as_tensor(ledger)
    if ledger.shape[0] != scenario.epochs:
        return [f"{path.name}: a ledger of {ledger.shape[0]} epochs, not {scenario.epochs}"]
    lost, twice = int((ledger == 0).sum()), int((ledger > 1).sum())
    if lost or twice:
        return [f"{path.name}: {lost} global batch(es) never applied and {twice} applied more than once"]
    return []


def _survivors_kept(log_dir: Path, restarted: set[int]) -> list[str]:
    try:
        nodes = read_status(log_dir / "cluster.db").nodes
    except RegistryError as e:
        return [f"the registry cannot be read: {e}"]
    return [f"{node['node_id']} restarted {node['restarts']} time(s) though no fault touched it "
            "(live recovery keeps the survivors' processes)"
            for node in nodes if node["role"] == "rank" and node["restarts"]
            and node["rank"] not in restarted]


def check_accuracy(accuracy: float | None, references: list[float],
                   gap: float = MAX_ACCURACY_GAP) -> list[str]:
    """Within `gap` (either way) of the fault-free runs' accuracies (their spread, where
    several were run)."""
    if not references:
        return []
    if accuracy is None:
        return ["the summary holds no final accuracy"]
    low, high = min(references), max(references)
    if not low - gap <= accuracy <= high + gap:
        spread = f"{low:.4f}" if low == high else f"{low:.4f} to {high:.4f}"
        points = f"{100 * gap:g} point" + ("" if 100 * gap == 1 else "s")
        return [f"final accuracy {accuracy:.4f} is more than {points} from the fault-free run's {spread}"]
    return []
