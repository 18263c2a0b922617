"""The places of a live run in its store, and the arrivals and spares that take them.

A run whose size has a ceiling that ranks compete for (an elastic run, `--world-size
MIN:MAX`, or a run with hot spares, `ddp.spares`) counts its places: MAX of them (the
run's size when it is not elastic), each a key `place/<i>` naming the slot that holds it,
`OPEN` (never taken: an elastic run's room to grow) or `FREED` (a lost member's). The
run's first slots hold the first places from the start; an arrival (`--join`) takes an
open or freed one, a spare a freed one only (it restores the group's size, it does not
grow it), by compare-and-set, so two never take the same; and a place names its holder,
so the launcher frees exactly the places of a process that left, was given up or (in a
run with spares) died, whatever moment it went. A freed place is taken again by whoever
comes first: a waiting spare (started beside the group and ready), an arrival, or the
slot's own process started again.

A process that holds no place when it starts (a spare, an arrival at the maximum of a run
with spares, a lost member's process started again in a run with spares) waits for one
(`wait_for_place`), then asks to join the group as any joiner does; having taken a free
place it is a spare that stepped in (`spare_key`, which the group's leader reads).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from disttrain.config import Config
from disttrain.core.errors import ConfigError, DistributedError
from disttrain.strategies.ddp.live.group import DONE_KEY, mark_dead
from disttrain.strategies.ddp.live.membership import FREED, OPEN, arrival_slot, place_to_take

logger = logging.getLogger(__name__)

NUM_PLACES_KEY = "places/count"  # MAX: the run counts its places (absent: it does not)
SPARES_KEY = "places/spares"  # the run's hot spares (an arrival at MAX waits as one when > 0)
ARRIVALS_KEY = "elastic/arrivals"  # ranks started past the run's first ones (their slots: `arrival_slot`)
RANGE_KEY = "elastic/range"  # MIN:MAX, as the host launcher was started
ARRIVAL_WAIT_S = 30.0  # how long an arrival waits for the host to publish the range
SPARE_POLL_S = 0.1  # how often a waiting process looks for a freed place


def place_key(index: int) -> str:
    return f"place/{index}"


def spare_key(slot: int, attempt: int) -> str:
    """Set when that process took a freed place: a spare that steps in (when, wall clock)."""
    return f"spare/{slot}/{attempt}"


def num_places(config: Config) -> int:
    """The places a run counts: MAX, its size when not elastic; 0: it counts none (a run of
    fixed size without spares: a dead rank's process started again takes its slot back)."""
    ddp = config.ddp
    if ddp.max_world_size:
        return ddp.max_world_size
    return config.system.num_workers if ddp.spares else 0


def open_places(store: dist.Store, config: Config, store_at: str) -> None:
    """The host launcher, before any rank starts: the run's first slots hold the first
    places, the others are free; an elastic run publishes its range, which an arrival
    checks against its own (`claim_arrival`)."""
    count, first = num_places(config), config.system.num_workers
    for index in range(count):
        store.set(place_key(index), str(index) if index < first else OPEN)
    store.set(SPARES_KEY, str(config.ddp.spares))
    store.set(NUM_PLACES_KEY, str(count))
    if not config.ddp.max_world_size:
        return
    store.set(RANGE_KEY, f"{first}:{config.ddp.max_world_size}")
    maximum = config.ddp.max_world_size
    logger.info("an elastic run of %d to %d ranks: add one with `disttrain ddp --ddp-recovery live "
                "--world-size %d:%d --join --rdzv-endpoint %s` and the run's settings (a SIGTERM to a rank "
                "makes it leave)", first, maximum, first, maximum, store_at)


def spare_slots(store: dist.Store, config: Config) -> list[int]:
    """The slots of the run's `ddp.spares` spares: the first slots past the run's first
    ones, taken like arrivals' (never reused)."""
    return [arrival_slot(config.system.num_workers, int(store.add(ARRIVALS_KEY, 1)))
            for _ in range(config.ddp.spares)]


def holders(store: dist.Store) -> list[str]:
    """Each place's holder (a slot, `OPEN` or `FREED`), in place order; empty when the run
    counts none."""
    if not store.check([NUM_PLACES_KEY]):
        return []
    return [store.get(place_key(index)).decode() for index in range(int(store.get(NUM_PLACES_KEY)))]


def take_place(store: dist.Store, slot: int, spare: bool = True) -> str:
    """Take a place for `slot` (a spare: only a lost member's, see `place_to_take`):
    "held" (it held one already), "taken" (a free one, now its), "full" (none it may take)
    or "uncounted" (the run counts no places)."""
    while True:
        current = holders(store)
        if not current:
            return "uncounted"
        index = place_to_take(current, slot, spare)
        if index is None:
            return "full"
        if current[index] == str(slot):
            return "held"
        if store.compare_set(place_key(index), current[index], str(slot)).decode() == str(slot):
            return "taken"  # else another took it first: look again


def free_places(store: dist.Store, slot: int) -> None:
    """Whatever place `slot` holds is free again (its process left, was given up, or died in
    a run with spares)."""
    for index, holder in enumerate(holders(store)):
        if holder == str(slot):
            store.compare_set(place_key(index), str(slot), FREED)


def has_spares(store: dist.Store) -> bool:
    """Whether the run was started with spares (a lost member's place is then freed for
    them at once, and its process started again waits as one)."""
    return store.check([SPARES_KEY]) and int(store.get(SPARES_KEY)) > 0


def left(store: dist.Store, slot: int) -> None:
    """`slot`'s process left the group: a generation forming with it (it was admitted as it
    left) stops waiting for it, as for a death (`group.mark_dead`), and its place is free."""
    mark_dead(store, slot)
    free_places(store, slot)


def claim_arrival(store: dist.Store, config: Config) -> int:
    """A slot in the running elastic run for this launcher's one rank, and a place for it
    when one is free; at the maximum it waits as a spare when the run has spares
    (`wait_for_place`, in the rank), and is refused when it has none.

    Raises:
        ConfigError: the run's range is not this command's.
        DistributedError: the run is not elastic, has ended, or is at its maximum without spares.
    """
    endpoint, mine = config.ddp.rdzv_endpoint, f"{config.system.num_workers}:{config.ddp.max_world_size}"
    try:
        store.wait([RANGE_KEY], timedelta(seconds=min(config.ddp.timeout_s, ARRIVAL_WAIT_S)))
    except (RuntimeError, dist.DistError) as e:
        raise DistributedError(f"the live store at {endpoint} holds no elastic run (started with "
                               "--world-size MIN:MAX); check --rdzv-endpoint") from e
    theirs = store.get(RANGE_KEY).decode()
    if theirs != mine:
        raise ConfigError(f"--world-size {mine}: the run at {endpoint} was started with --world-size "
                          f"{theirs}; pass --world-size {theirs}")
    if store.check([DONE_KEY]):
        raise DistributedError(f"the run at {endpoint} has ended; nothing to join")
    if place_to_take(holders(store), -1, spare=False) is None and not has_spares(store):
        raise DistributedError(f"the run at {endpoint} has its maximum of {config.ddp.max_world_size} "
                               "ranks (--world-size MIN:MAX) and no spares (ddp.spares); start this one when "
                               "a rank has left")
    slot = arrival_slot(config.system.num_workers, int(store.add(ARRIVALS_KEY, 1)))
    if take_place(store, slot, spare=False) == "taken":
        logger.info("joining the run at %s as slot %d (up to %d ranks)", endpoint, slot,
                    config.ddp.max_world_size)
    else:
        logger.info("the run at %s has its maximum of %d ranks: slot %d waits as a spare and steps in when "
                    "a member is lost", endpoint, config.ddp.max_world_size, slot)
    return slot


def wait_for_place(store: dist.Store, slot: int, attempt: int, stop: Callable[[], bool],
                   clock: Callable[[], float] = time.time) -> bool:
    """Hold a place before asking to join (a process that holds none waits as a spare);
    True once it does (or the run counts no places), False when the run ended or `stop()`
    (a SIGTERM) came first. A free place taken marks this process a spare that stepped in
    (`spare_key`, with the wall-clock time)."""
    waited = False
    while True:
        took = take_place(store, slot)
        if took in ("held", "uncounted"):
            return True
        if took == "taken":
            store.set(spare_key(slot, attempt), repr(clock()))
            logger.info("slot %d steps in: it took a lost member's place%s", slot,
                        ", after it waited as a spare" if waited else "")
            return True
        if store.check([DONE_KEY]) or stop():
            return False
        if not waited:
            logger.info("slot %d waits as a spare: every place of the run is held; it steps in when a "
                        "member is lost", slot)
            waited = True
        time.sleep(SPARE_POLL_S)


__all__ = ["claim_arrival", "free_places", "has_spares", "left", "open_places", "spare_slots",
           "take_place", "wait_for_place"]
