"""Who may act as a worker on a shard: worker ids bound to keys, and sessions.

A worker process picks a random key (kept in its checkpoint folder, so its restart with
`--resume` presents it again) and registers with it. A shard binds the worker id to the
key's digest and to the membership generation it registered in, and answers with a
random session, which every later push, pull, barrier and WorkerDone must carry.

- The same key again (a retry whose reply was lost, or the worker restarted with
  `--resume`) takes the id back with a new session; the old session stops working.
- Another key is refused while the id is bound (ALREADY_EXISTS), unless it registers in
  a newer generation that the coordinator's membership confirms for that id: the run
  declared the old process failed and this one is its restart.

Digests and generations are saved with the shard's checkpoint, so a restarted shard
still knows who holds each id; sessions are not, so every worker registers again after
a shard restarts (it notices by the shard's incarnation). Comparisons take constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from disttrain.strategies.ps.server.roster import Roster, UnknownGeneration

MIN_KEY_BYTES = 16
MAX_ID_CHARS = 128
SESSION_BYTES = 16


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
