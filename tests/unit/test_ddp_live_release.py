"""A past generation's process group is freed on the rank's own thread once nothing else
holds it (its sockets close only then): one held in a reference cycle is found by a
collection; one still held at the end of the wait stays, and a warning names its holder.
Plain objects stand for the groups (`release` only counts references); the peer that fails
at once when the group goes is `tests/distributed/test_ddp_live_group.py`'s."""

from __future__ import annotations

import logging
import subprocess
import sys
import weakref

import pytest

from disttrain.strategies.ddp.live.group import release


class Group:
    """Stands for a process group."""


def test_a_group_held_only_by_a_reference_cycle_is_freed():
    group = Group()
    freed = weakref.finalize(group, lambda: None)
    cycle: dict = {"group": group}
    cycle["self"] = cycle  # unreachable once dropped, but freed only by the collector
    del cycle
    groups = [group]
    del group
    release(groups, wait_s=5.0)  # type: ignore[arg-type]
    assert groups == [] and not freed.alive


def test_a_group_still_held_stays_and_the_warning_names_its_holder(caplog):
    group = Group()
    holder = {"group": group}  # a live reference: nothing frees it
    groups = [group]
    del group
    with caplog.at_level(logging.WARNING, logger="disttrain.strategies.ddp.live.group"):
        release(groups, wait_s=0.2)  # type: ignore[arg-type]
    assert groups == [holder["group"]]
    assert "still held after 0.2 s (by dict)" in caplog.text and "waits until its timeout" in caplog.text


def test_a_group_nothing_else_holds_is_freed_at_once():
    group = Group()
    freed = weakref.finalize(group, lambda: None)
    groups = [group]
    del group
    release(groups, wait_s=5.0)  # type: ignore[arg-type]
    assert groups == [] and not freed.alive


@pytest.mark.slow  # a new interpreter
def test_the_module_that_would_keep_the_first_group_is_imported_before_any_group():
    # torch.distributed.nn's functions take the default group as a default argument,
    # evaluated at its import; imported while generation 0's group exists, it would hold
    # that group for the life of the process. The live group imports it first.
    probe = ("import sys; import disttrain.strategies.ddp.live.group; "
             "print('torch.distributed.nn' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          check=True)
    assert done.stdout.strip() == "True", done.stderr
