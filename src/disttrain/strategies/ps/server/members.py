"""Who a shard's workers are, and whether a call or push of theirs is taken: worker ids
bound to keys and sessions, the run's membership as the coordinator tells it, and each
worker's steps in order. Pure bookkeeping, which the rules and the shard consult before
they decide (`aggregation`, `shard`).

**Identity.** A worker process picks a random key (kept in its checkpoint folder, so its
restart with `--resume` presents it again) and registers with it. A shard binds the
worker id to the key's digest and to the membership generation it registered in, and
answers with a random session, which every later push, pull, barrier and WorkerDone must
carry.

- The same key again (a retry whose reply was lost, or the worker restarted with
  `--resume`) takes the id back with a new session; the old session stops working.
- Another key is refused while the id is bound (ALREADY_EXISTS), unless it registers in
  a newer generation that the coordinator's membership confirms for that id: the run
  declared the old process failed and this one is its restart.

Digests and generations are saved with the shard's checkpoint, so a restarted shard
still knows who holds each id; sessions are not, so every worker registers again after
a shard restarts (it notices by the shard's incarnation). Comparisons take constant time.

**Membership.** The roster is the shard's view of the run's membership. Without a
coordinator every registered worker counts. With one, the coordinator's membership
decides: a live worker counts, registered here or not yet (a shard restarted before its
first checkpoint learns each one's rank only as it registers again), a worker it declared
failed leaves the synchronous quorum at once, and a push stamped with a generation its
worker has since been declared failed in is refused (a worker that hung and woke up
cannot apply its late gradients). A worker that sent its last block of an epoch is
*parked* for that epoch: synchronous steps of that epoch stop waiting for it, so a
worker that fell behind (it was restarted) finishes its epoch alone. A worker the
coordinator *reassigned* (failed for longer than `coordinator.reassign_after`) is given
up on: the other workers take over its blocks (`worker.takeover`), the barriers stop
waiting for it, and it counts as done; if it rejoins it is a live worker again.

**Step order.** A worker pushes its steps one at a time (`StepOrder`).

Which data blocks a worker may push, and which are applied, is `ledger`'s.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from typing import Any

from disttrain.strategies.ps.server.decisions import PushRefused

MIN_KEY_BYTES = 16
MAX_ID_CHARS = 128
SESSION_BYTES = 16


class FencedPush(ValueError):
    """A push from a worker the run declared failed, or of a generation it left."""


class UnknownGeneration(ValueError):
    """A push stamped with a generation this shard has not heard of yet (retry soon)."""


class InvalidIdentity(ValueError):
    """An empty or overlong worker id, or a key too short to be secret (INVALID_ARGUMENT)."""


class IdentityTaken(ValueError):
    """The worker id is held by another live worker (ALREADY_EXISTS)."""


class SessionRefused(PermissionError):
    """A call without the worker's current session (PERMISSION_DENIED)."""


class UnknownWorker(ValueError):
    """A call naming a worker id that never registered (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class Binding:
    digest: bytes
    generation: int


def check_worker_id(worker_id: str) -> None:
    if not worker_id or len(worker_id) > MAX_ID_CHARS or not worker_id.isprintable():
        raise InvalidIdentity(f"worker_id must be 1 to {MAX_ID_CHARS} printable characters, got "
                              f"{worker_id[:MAX_ID_CHARS]!r}; give each worker a name such as worker0")


class Identities:
    """The worker ids a shard knows, their bindings and current sessions (callers lock)."""

    def __init__(self) -> None:
        self._bound: dict[str, Binding] = {}
        self._sessions: dict[str, bytes] = {}

    def check_claim(self, worker_id: str, key: bytes, generation: int, roster: Roster) -> None:
        """Raises InvalidIdentity, IdentityTaken, or UnknownGeneration (the membership
        that would confirm a restart has not reached this shard yet: retry) when
        `worker_id` may not be registered with `key` in `generation`."""
        check_worker_id(worker_id)
        if len(key) < MIN_KEY_BYTES:
            raise InvalidIdentity(f"the worker key has {len(key)} bytes; it must have at least "
                                  f"{MIN_KEY_BYTES} random bytes")
        bound = self._bound.get(worker_id)
        if bound is None:
            return
        if hmac.compare_digest(bound.digest, _digest(key)) and generation >= bound.generation:
            return
        if generation > bound.generation and roster.members is not None:
            if generation > roster.generation:
                raise UnknownGeneration(f"generation {generation} is newer than this shard's "
                                        f"{roster.generation}; the membership is on its way, retry")
            if roster.members.get(worker_id) == generation:
                return
        raise IdentityTaken(
            f"worker id {worker_id!r} is registered by another live worker (generation "
            f"{bound.generation}); give this worker another id, or restart the same worker with "
            "--resume from its checkpoint folder (with a coordinator, a restart after a failure "
            "takes the id over)")

    def bind(self, worker_id: str, key: bytes, generation: int) -> bytes:
        """Bind `worker_id` (after `check_claim`) and return its new session."""
        self._bound[worker_id] = Binding(_digest(key), generation)
        session = self._sessions[worker_id] = secrets.token_bytes(SESSION_BYTES)
        return session

    def check(self, worker_id: str, session: bytes) -> None:
        """Raises UnknownWorker or SessionRefused unless `session` is `worker_id`'s current one."""
        expected = self._sessions.get(worker_id)
        if expected is None and worker_id not in self._bound:
            raise UnknownWorker(f"unknown worker {worker_id!r}: call RegisterWorker first")
        if expected is None or not hmac.compare_digest(expected, session):
            raise SessionRefused(f"the call does not carry worker {worker_id!r}'s current session; "
                                 "only the process that registered it last may act as it (register "
                                 "again to get a session)")

    def state_dict(self) -> dict[str, Any]:
        return {w: {"digest": b.digest.hex(), "generation": b.generation} for w, b in self._bound.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._bound = {str(w): Binding(bytes.fromhex(b["digest"]), int(b["generation"]))
                       for w, b in state.items()}
        self._sessions.clear()


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass
class Roster:
    """The live workers (by rank) as the coordinator last told this shard.

    `generation` 0 means no coordinator: every registered rank is live.
    """

    generation: int = 0
    members: dict[str, int] | None = None  # live worker ids -> the generation each joined in
    live: set[int] | None = None
    away: frozenset[str] = frozenset()  # ids of the workers reassigned
    reassigned: set[int] = field(default_factory=set)  # their ranks here
    joined: dict[int, int] = field(default_factory=dict)
    # live worker ids not registered here (yet): a shard restarted before its first
    # checkpoint knows no worker's rank until each registers again
    unregistered: frozenset[str] = frozenset()
    parked: dict[int, int] = field(default_factory=dict)
    num_fenced: int = 0

    def update(self, generation: int, members: dict[str, int], away: frozenset[str] = frozenset()) -> bool:
        """Take a newer membership (`away`: the workers reassigned); False (nothing
        changes) when it is not newer. Call `resolve` after."""
        if generation <= self.generation:
            return False
        self.generation, self.members, self.away = generation, dict(members), frozenset(away)
        return True

    def resolve(self, ranks: dict[str, int]) -> None:
        """Map the members to the ranks registered here (`ranks`: worker id -> rank)."""
        if self.members is not None:
            self.joined = {ranks[w]: g for w, g in self.members.items() if w in ranks}
            self.live = set(self.joined)
            self.unregistered = frozenset(w for w in self.members if w not in ranks)
            self.reassigned = {ranks[w] for w in self.away if w in ranks} - self.live

    def is_live(self, rank: int) -> bool:
        return self.live is None or rank in self.live

    def check(self, rank: int, generation: int) -> None:
        """Raises FencedPush or UnknownGeneration when `rank`'s push of `generation` may
        not be applied."""
        if self.live is None:
            return
        if generation > self.generation:
            raise UnknownGeneration(f"generation {generation} is newer than this shard's "
                                    f"{self.generation}; the membership is on its way, retry")
        if rank not in self.live or self.joined.get(rank) != generation:
            self.num_fenced += 1
            raise FencedPush(f"worker rank {rank} was declared failed (its push is of generation "
                             f"{generation}, the run is at {self.generation}); its gradient is not "
                             "applied. Restart the worker: it rejoins in a new generation")

    def park(self, rank: int, epoch: int) -> None:
        """`rank` sent its last block of `epoch`."""
        self.parked[rank] = max(epoch, self.parked.get(rank, -1))

    def waits_for(self, rank: int, epoch: int) -> bool:
        """Whether a synchronous step of `epoch` waits for `rank`."""
        return self.is_live(rank) and self.parked.get(rank, -1) < epoch

    def state_dict(self) -> dict[str, Any]:
        """The parked epochs (membership comes again from the coordinator after a restart)."""
        return {"parked": dict(self.parked), "num_fenced": self.num_fenced}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.parked = {int(k): int(v) for k, v in state["parked"].items()}
        self.num_fenced = int(state["num_fenced"])


@dataclass
class StepOrder:
    """Each worker's highest step answered since it last registered (by rank).

    A worker pushes its steps in order: after step s comes s again (a retry: a duplicate)
    or s + 1. The first push after a registration may go on from any step: the worker
    resumed from its checkpoint, or the shard restarted from an older one.
    """

    seen: dict[int, int] = field(default_factory=dict)

    def check(self, rank: int, step: int, last_accepted: int) -> None:
        """Raises PushRefused when `step` skips ahead of `rank`'s last step."""
        if rank not in self.seen:
            return
        last = max(self.seen[rank], last_accepted)
        if step > last + 1:
            raise PushRefused(f"step {step} of worker rank {rank} is ahead of its last step {last}; "
                              "a worker pushes its steps in order, one at a time")

    def record(self, rank: int, step: int) -> None:
        self.seen[rank] = max(step, self.seen.get(rank, 0))

    def forget(self, rank: int) -> None:
        """`rank` registered again: its next push may go on from any step."""
        self.seen.pop(rank, None)
