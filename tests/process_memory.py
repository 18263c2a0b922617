"""What a running process holds in its memory, read through /proc/PID/mem (the caller
must be allowed to trace it: its own descendants, or root). A process forked from the
fork server sets its environment after it started, so /proc/PID/environ shows the fork
server's start-up variables, not the process's own; its memory holds them."""

from __future__ import annotations

import re
from collections.abc import Iterator


def writable_memory(pid: int) -> Iterator[bytes]:
    """The contents of each writable mapping of process `pid` (heap, stacks, anonymous)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("rw"):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(start)
                yield mem.read(end - start)
            except OSError:  # a mapping that cannot be read (a guard page), or gone meanwhile
                continue


def memory_holds(pid: int, needle: bytes) -> bool:
    return any(needle in chunk for chunk in writable_memory(pid))


def environment_values(pid: int, name: str, value_pattern: bytes) -> set[str]:
    """Every value of variable `name` matching `value_pattern` in process `pid`'s memory, as
    the C library keeps an environment entry (`NAME=value` and a NUL)."""
    entry = re.compile(re.escape(name.encode()) + b"=(" + value_pattern + b")\0")
    return {m.group(1).decode() for chunk in writable_memory(pid) for m in entry.finditer(chunk)}
