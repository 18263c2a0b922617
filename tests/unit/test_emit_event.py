"""`emit_event` from many threads at once: every event is one line the launcher can read.

A worker's preemption event, emitted from its SIGTERM thread while the training thread
reported progress, once shared a line with it and was lost (the generated preemption
schedule ps-sync seed 19): the run then waited out its grace period."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from disttrain.core.processes import EVENT_PREFIX, PARENT_ENV

THREADS, EVENTS = 8, 400

CHILD = f"""
import threading
from disttrain.core.processes import emit_event

def emit(thread):
    for n in range({EVENTS}):
        emit_event("progress", thread=thread, point=n, padding="x" * (n % 50))

threads = [threading.Thread(target=emit, args=(t,)) for t in range({THREADS})]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.mark.timeout(60)
def test_events_emitted_from_many_threads_at_once_are_each_one_readable_line():
    env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, timeout=50,
                            check=True)
    lines = result.stdout.decode().splitlines()
    assert len(lines) == THREADS * EVENTS
    events = [json.loads(line.removeprefix(EVENT_PREFIX)) for line in lines if line.startswith(EVENT_PREFIX)]
    assert len(events) == THREADS * EVENTS
    assert sorted((e["thread"], e["point"]) for e in events) == [(t, n) for t in range(THREADS)
                                                               for n in range(EVENTS)]
