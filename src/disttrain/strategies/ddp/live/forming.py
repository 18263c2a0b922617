"""Forming a live generation without waiting on a dead member: the store the rendezvous
reads through gives up as soon as the launcher has marked a member's process dead.

A new generation's process group meets through the launcher's store: each member writes
its address and waits for the others'. A member that dies after the member list is fixed
never writes it, and the others would wait out `ddp.timeout_s`. The launcher counts each
slot's deaths (`deaths/<slot>`, bumped the moment it sees the process exit, see
`group.mark_dead`), and a process of slot s started for the a-th time (`attempt` a, from
0) is dead once that count exceeds a: restarts follow deaths one for one, so the count
tells this process from the slot's next one, whenever that one starts. Every member of a
generation is recorded with its attempt (`gen<g>/attempt/<slot>`, see `group`), so the
members forming it watch each other through `WatchedStore`: its waits poll the store and
raise `MemberLost` when a member's count passes its attempt. The caller then starts the
next generation with whoever proposes itself, as after a failed collective.

A member that dies between publishing its address and connecting to its peers leaves the
others inside gloo's connection of a pair, which no store wait sees and nothing can cut
short: gloo gives a pair five times the group's timeout to connect. So the members first
wait for each other in the store (`arrive`, cut short by a death, bounded by
`ddp.timeout_s`), and the group is made with the short `CONNECT_S` as its timeout, which
then bounds only the connections of members all present (a store wait still lasts
`ddp.timeout_s`, whatever gloo asks); its collectives get `ddp.timeout_s` once it is made
(`group.LiveGroup.form`). Such a death costs the others at most 5 x CONNECT_S (20 s), where
it cost 5 x `ddp.timeout_s` (25 minutes at the default). A member alive but stuck (nothing
marks it) stays bounded by the timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch.distributed as dist

POLL_S = 0.05
# A forming group's timeout while it connects its pairs, every member present (`arrive`):
# gloo waits up to five times this for a pair, where the peer must only be scheduled to
# connect (milliseconds on a quiet machine, a second or two on saturated cores).
CONNECT_S = 4.0
# In every MemberLost's message. A MemberLost raised by the store's wait while torch's C++
# rendezvous called it comes back as a plain RuntimeError (only the message crosses):
# torch gives no type there, so the text tells it apart.
LOST_SIGN = "died while generation"


class MemberLost(RuntimeError):
    """A member of the forming generation died (recoverable: form the next one)."""


def deaths_key(slot: int) -> str:
    return f"deaths/{slot}"


def attempt_key(generation: int, slot: int) -> str:
    return f"gen{generation}/attempt/{slot}"


def arrived_key(slot: int, attempt: int) -> str:
    return f"arrived/{slot}/{attempt}"


def arrive(store: WatchedStore, slot: int, attempts: Mapping[int, int]) -> None:
    """Say that this process (`slot`) is at the forming generation, and wait until each of
    its members (`attempts`: slot -> attempt) is too, so that no member starts connecting
    its pairs while another is still on its way.

    Raises:
        MemberLost: a member died meanwhile.
        DistStoreError: a member did not come within the store's timeout (`ddp.timeout_s`).
    """
    store.set(arrived_key(slot, attempts[slot]), "1")
    store.wait([arrived_key(member, attempt) for member, attempt in sorted(attempts.items())])


def is_member_lost(error: BaseException) -> bool:
    """`error` says a member died while a generation formed (raised through the
    rendezvous, its type may come back as RuntimeError; its message does not change)."""
    return isinstance(error, MemberLost) or LOST_SIGN in str(error)


class WatchedStore(dist.Store):
    """`inner` whose waits give up when `lost()` names a dead member.

    Args:
        inner: the store the rendezvous or the state hand-over reads.
        lost: a message naming a member lost, or None while all are alive.
        timeout_s: how long a wait lasts when nobody dies (`ddp.timeout_s`), whatever shorter
            time its caller asks: gloo asks its group's timeout, which while the group forms
            is `CONNECT_S`, meant for a pair's connection, not for a member's arrival.
    """

    def __init__(self, inner: dist.Store, lost: Callable[[], str | None], timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.inner, self.lost, self.timeout_s, self.clock = inner, lost, timeout_s, clock

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Until every key of `keys` is set.

        Raises:
            MemberLost: a member died meanwhile.
            DistStoreError: the timeout passed (the type torch's own stores raise then; a lost
                peer to the caller).
        """
        limit_s = self.timeout_s if timeout is None else max(self.timeout_s, timeout.total_seconds())
        deadline = self.clock() + limit_s
        while not self.inner.check(keys):
            lost = self.lost()
            if lost is not None:
                raise MemberLost(lost)
            if self.clock() > deadline:
                raise dist.DistStoreError(f"Timed out after {limit_s:g}s waiting for {', '.join(keys)} "
                                          "in the store")
            time.sleep(POLL_S)
