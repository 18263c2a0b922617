"""What a fault is and how it is written: the `--inject` grammar and `--fault-plan` files.

The grammar is `ACTION:TARGET[:KEY=VALUE...]`:

- `kill:worker=1:step=30`: worker 1 sends itself SIGKILL right after its step 30.
- `stop:worker=0:step=10:for=5s`: worker 0 stops (SIGSTOP) after step 10 and is continued
  (SIGCONT) 5 s later: a hang, not a death.
- `kill:server=0:step=40`: the server of shard 0 dies once its version reaches 40.
- `kill:coordinator:step=20`: the coordinator dies once any node has reported step 20.
- `drop-rpc:worker=1:step=15`: the reply to worker 1's gradient push of step 15 is lost,
  so the worker retries a push the server already applied.
- `slow:worker=1:factor=3`: worker 1 is a straggler; each of its steps takes 3 times as long.
  `slow:worker=1:factor=3:step=100:until=300` makes it one from its step 100 to its step
  300 (a straggler that appears mid-run, and recovers).
- `slow-eval:worker=0:for=2s`: each evaluation of worker 0 takes 2 s longer.
- `delay-rpc:worker=1:step=15:for=3s`: the reply to worker 1's push of step 15 comes back
  3 s late (past the call's deadline it is lost, and the worker retries).
- `partition:server=1:step=40:for=5s`: once shard 1's version reaches 40 it is cut off
  from every other process for 5 s: its calls and the calls to it fail UNAVAILABLE, open
  streams included (a process of the parameter server or the coordinator).
- `slow-link:worker=0:for=20ms`: each call of worker 0, in and out, takes 20 ms longer;
  `:step=N:until=M` as for slow.
- `store-error:server=0:step=40:for=10s`: shard 0's checkpoint writes fail with "no space
  left" for 10 s from its version 40 (a full disk, an unwritable store).
- `crash-checkpoint:worker=1:step=20`: worker 1 dies (SIGKILL) in the middle of its first
  checkpoint write at or after its step 20, the checkpoint partly written.

Targets: `worker=N`, `server=N`, `rank=N` (a DDP rank), `coordinator`; `worker`, `server`
or `rank` alone means every one of them. Durations: `5s`, `500ms` or `5` (seconds).
Every fault takes `attempt=A`: it fires only on that start of the process (0, the
default, is the first start, so a restarted process does not fire again).

A step-triggered fault fires once, the first time its process reaches that step or beyond.
The baseline's one process is worker 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROLES = ("worker", "server", "rank", "coordinator")
TRAINING_ROLES = ("worker", "rank")
RPC_ROLES = ("worker", "server", "coordinator")  # the processes whose traffic is gRPC
CHECKPOINT_ROLES = ("worker", "server", "rank")  # the processes that write checkpoints

# action -> (keys it requires, roles it applies to)
ACTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kill": (("step",), ROLES),
    "term": (("step",), TRAINING_ROLES),
    "stop": (("step", "for"), ROLES),
    "drop-rpc": (("step",), ("worker",)),
    "slow": (("factor",), TRAINING_ROLES),
    "slow-eval": (("for",), TRAINING_ROLES),
    "delay-rpc": (("step", "for"), ("worker",)),
    "partition": (("step", "for"), RPC_ROLES),
    "slow-link": (("for",), RPC_ROLES),
    "store-error": (("step", "for"), CHECKPOINT_ROLES),
    "crash-checkpoint": (("step",), CHECKPOINT_ROLES),
}
# action -> (keys it may take besides `attempt`)
OPTIONAL: dict[str, tuple[str, ...]] = {"slow": ("step", "until"), "slow-link": ("step", "until")}
KEY_FIELDS = {"step": "step", "for": "seconds", "factor": "factor", "attempt": "attempt", "until": "until"}
FORMS = ("kill:worker=1:step=30, term:worker=0:step=5, stop:worker=0:step=10:for=5s, "
         "kill:server=0:step=40, "
         "kill:coordinator:step=20, drop-rpc:worker=1:step=15, slow:worker=1:factor=3[:step=N][:until=M], "
         "slow-eval:rank=0:for=2s, delay-rpc:worker=1:step=15:for=3s, partition:server=1:step=40:for=5s, "
         "slow-link:worker=0:for=20ms[:step=N][:until=M], store-error:server=0:step=40:for=10s, "
         "crash-checkpoint:worker=1:step=20 (each may end with :attempt=A)")


@dataclass(frozen=True)
class Fault:
    """One fault to inject.

    Attributes:
        action: kill, term (SIGTERM, as a preemption), stop, drop-rpc, slow, slow-eval,
            delay-rpc, partition, slow-link, store-error or crash-checkpoint.
        step: the step (a server's version) at which the fault fires; the step from
            which slow and slow-link slow (0: from the start).
        seconds: how long stop, partition and store-error last; how much slow-eval adds to
            each evaluation, delay-rpc to the reply, slow-link to each call.
        index: the target's index (worker, server or rank number); None = every one.
        attempt: the start of the process it fires on (0 = the first).
        role: worker, server, rank or coordinator (keyword only, required).
        factor: slow: how many times its normal duration each step takes.
        until: slow: the step from which it no longer slows (0: never).
    """

    action: str
    step: int = 0
    seconds: float = 0.0
    index: int | None = None
    attempt: int = 0
    role: str = field(kw_only=True)
    factor: float = 1.0
    until: int = 0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS or self.role not in ACTIONS[self.action][1]:
            raise ValueError(f"{self!r}: no such fault; accepted forms: {FORMS}")

    def slows(self, step: int, action: str = "slow") -> bool:
        """Whether this is a fault of `action` (slow or slow-link) in force at `step`."""
        return self.action == action and self.step <= step and (not self.until or step < self.until)

    def applies_to(self, role: str, index: int, attempt: int) -> bool:
        """Whether this fault is meant for process `index` of `role` on start `attempt`."""
        return (role == self.role and (self.index is None or self.index == index)
                and self.attempt == attempt)


def parse_fault(text: str) -> Fault:
    """Parse a fault written `ACTION:TARGET[:KEY=VALUE...]` (see the module docstring).

    Raises:
        ValueError: names the bad part and shows the accepted forms.
    """
    action, _, rest = text.partition(":")
    if action not in ACTIONS:
        raise ValueError(f"fault {text!r}: unknown action {action!r}; accepted forms: {FORMS}")
    target, *pairs = rest.split(":")
    role, index = _parse_target(text, action, target)
    values: dict[str, int | float] = {}
    for part in pairs:
        key, value = _parse_pair(text, part)
        if key in values:
            raise ValueError(f"fault {text!r}: {key}= is given twice")
        values[key] = value
    required, _ = ACTIONS[action]
    missing = [f"{key}=..." for key in required if key not in values]
    extra = [f"{key}=" for key in values
             if key not in required and key != "attempt" and key not in OPTIONAL.get(action, ())]
    if missing or extra:
        wrong = f"needs {' and '.join(missing)}" if missing else f"does not take {extra[0]}"
        raise ValueError(f"fault {text!r}: {action} {wrong}; accepted forms: {FORMS}")
    return Fault(action, role=role, index=index, **{KEY_FIELDS[k]: v for k, v in values.items()})


def format_fault(fault: Fault) -> str:
    """The text `parse_fault` reads back as `fault` (to hand faults to child processes)."""
    target = fault.role if fault.index is None else f"{fault.role}={fault.index}"
    required, _ = ACTIONS[fault.action]
    written = {"step": str(fault.step), "for": f"{_shortest(fault.seconds)}s",
               "factor": _shortest(fault.factor), "until": str(fault.until)}
    optional = [key for key in OPTIONAL.get(fault.action, ()) if getattr(fault, KEY_FIELDS[key])]
    parts = [f"{key}={written[key]}" for key in (*required, *optional)]
    parts += [f"attempt={fault.attempt}"] if fault.attempt else []
    return ":".join([fault.action, target, *parts])


def _shortest(number: float) -> str:
    """`number` as written back exactly, without a trailing `.0` (1.0 -> 1, 0.5 -> 0.5)."""
    text = repr(float(number))
    return text.removesuffix(".0")


def load_fault_plan(path: str | Path) -> list[Fault]:
    """Read a YAML fault plan: a list under `faults:` whose entries are either strings in
    the `--inject` grammar or mappings such as
    `{action: kill, target: worker, index: 1, step: 30}` (keys: action, target, index,
    step, for, factor, attempt, until).

    Raises:
        ValueError: the file cannot be read, or an entry is wrong (the file and the
            entry's position are named).
    """
    try:
        document = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"fault plan {path}: cannot read it: {e}") from e
    entries = document.get("faults") if isinstance(document, dict) else None
    if not isinstance(entries, list) or set(document) != {"faults"}:
        raise ValueError(f"fault plan {path}: expected a mapping with one key, `faults:`, "
                         "holding a list of faults")
    faults = []
    for number, entry in enumerate(entries, start=1):
        try:
            faults.append(parse_fault(_plan_entry_text(entry)))
        except ValueError as e:
            raise ValueError(f"fault plan {path}: entry {number} ({entry!r}): {e}") from e
    return faults


PLAN_KEYS = ("action", "target", "index", "step", "for", "factor", "attempt", "until")


def _plan_entry_text(entry: Any) -> str:
    """A plan entry as `--inject` text, so both go through one parser."""
    if isinstance(entry, str):
        return entry
    if not isinstance(entry, dict):
        raise ValueError("expected a string such as kill:worker=1:step=30 or a mapping "
                         "such as {action: kill, target: worker, index: 1, step: 30}")
    unknown = sorted(set(map(str, entry)) - set(PLAN_KEYS))
    if unknown or "action" not in entry or "target" not in entry:
        raise ValueError(f"a mapping needs action and target and may have {', '.join(PLAN_KEYS[2:])}"
                         + (f"; unknown key {unknown[0]!r}" if unknown else ""))
    target = str(entry["target"]) + (f"={entry['index']}" if entry.get("index") is not None else "")
    pairs = [f"{key}={entry[key]}" for key in PLAN_KEYS[3:] if key in entry]
    return ":".join([str(entry["action"]), target, *pairs])


def _parse_target(text: str, action: str, target: str) -> tuple[str, int | None]:
    role, eq, value = target.partition("=")
    if role not in ROLES or (eq and role == "coordinator"):
        raise ValueError(f"fault {text!r}: bad target {target!r}; use worker=N, server=N, "
                         "rank=N or coordinator")
    _, roles = ACTIONS[action]
    if role not in roles:
        raise ValueError(f"fault {text!r}: {action} applies to {' or '.join(roles)}, not {role}")
    return role, _number(text, target, value, int) if eq else None


def _parse_pair(text: str, part: str) -> tuple[str, int | float]:
    key, eq, value = part.partition("=")
    parsers: dict[str, Callable[[str, str, str], int | float]] = {
        "step": lambda t, p, v: _number(t, p, v, int),
        "until": lambda t, p, v: _number(t, p, v, int),
        "attempt": lambda t, p, v: _number(t, p, v, int),
        "factor": _factor,
        "for": _duration,
    }
    if key not in parsers or not eq:
        raise ValueError(f"fault {text!r}: bad part {part!r}; keys are step=N, for=DURATION, "
                         "factor=F, until=N, attempt=A")
    return key, parsers[key](text, part, value)


def _number(text: str, part: str, value: str, type_: type[int] | type[float]) -> int | float:
    try:
        number = type_(value)
        if number >= 0 and math.isfinite(number):
            return number
    except ValueError:
        pass
    raise ValueError(f"fault {text!r}: bad part {part!r}: expected a number >= 0")


def _factor(text: str, part: str, value: str) -> float:
    factor = _number(text, part, value, float)
    if factor < 1:
        raise ValueError(f"fault {text!r}: bad part {part!r}: the factor must be >= 1 "
                         "(3 = each step takes three times as long)")
    return float(factor)


def _duration(text: str, part: str, value: str) -> float:
    """`5s`, `500ms` or `5` (seconds), > 0."""
    scale = 1e-3 if value.endswith("ms") else 1.0
    seconds = _number(text, part, value.removesuffix("ms").removesuffix("s"), float) * scale
    if seconds <= 0:
        raise ValueError(f"fault {text!r}: bad part {part!r}: expected a duration > 0 "
                         "such as 5s, 500ms or 5")
    return seconds


# The faults after which a process may start again (a hang or a cut past the heartbeat
# timeout is declared a failure, and the process killed and restarted).
RESTARTING = ("kill", "crash-checkpoint", "stop", "partition")


@dataclass(frozen=True)
class RunShape:
    """What a run has, to check its faults against before anything starts.

    Attributes:
        name: the run as a message names it ("this DDP run").
        processes: role -> how many processes of it (worker, server, rank, coordinator).
        last_step: role -> the highest step a fault on it can fire at (a shard's: its
            version); a role not named: unknown, not checked.
        restarted: the roles whose processes are started again after a failure.
        group_restart: a failure restarts every process of the role (DDP restart mode).
    """

    name: str
    processes: dict[str, int]
    last_step: dict[str, int] = field(default_factory=dict)
    restarted: tuple[str, ...] = ROLES
    group_restart: bool = False

    def targets(self) -> str:
        """The targets this run offers, as a message lists them."""
        return ", ".join(role if role == "coordinator" else f"{role}=0..{count - 1}" if count > 1
                         else f"{role}=0" for role, count in self.processes.items() if count)


def check_faults(faults: list[Fault] | tuple[Fault, ...], shape: RunShape) -> None:
    """Refuse a fault that can never fire in this run: a role it does not have, an index
    past its processes, a step past its end, or an attempt (a restart) that no earlier
    fault of the plan brings about.

    Raises:
        ValueError: one line naming the fault, what the run has, and how to fix it.
    """
    for fault in faults:
        text = format_fault(fault)
        count = shape.processes.get(fault.role, 0)
        if not count:
            raise ValueError(f"fault {text}: {shape.name} has no {fault.role}; its processes are "
                             f"{shape.targets()}")
        if fault.index is not None and fault.index >= count:
            raise ValueError(f"fault {text}: {shape.name} has {count} {fault.role}(s), so "
                             f"{fault.role}={fault.index} does not exist; use one of {shape.targets()}")
        last = shape.last_step.get(fault.role)
        if last is not None and fault.step > last:
            raise ValueError(f"fault {text}: step {fault.step} is past the run's end (a {fault.role} "
                             f"reaches step {last} at most), so it would never fire; use a step up to {last}")
        if fault.attempt and fault.role not in shape.restarted:
            raise ValueError(f"fault {text}: attempt {fault.attempt} never comes: {shape.name} does not "
                             f"restart its {fault.role}; drop :attempt=")
        if fault.attempt and not any(_restarts(earlier, fault, shape) for earlier in faults):
            raise ValueError(f"fault {text}: attempt {fault.attempt} never comes: no fault of the plan "
                             f"restarts that {fault.role} on its attempt {fault.attempt - 1}; add one "
                             f"(e.g. kill:{fault.role}{'' if fault.index is None else f'={fault.index}'}:"
                             f"step=N:attempt={fault.attempt - 1}) or drop :attempt=")


def _restarts(earlier: Fault, fault: Fault, shape: RunShape) -> bool:
    """Whether `earlier` may restart the process `fault` names, on the start before `fault`'s."""
    same = earlier.role == fault.role and (
        shape.group_restart or earlier.index is None or fault.index is None or earlier.index == fault.index)
    return same and fault.role in shape.restarted and earlier.action in RESTARTING \
        and earlier.attempt == fault.attempt - 1
