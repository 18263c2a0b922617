"""Server-side deadlines: a call still running past its time is cancelled, once; a call
that ended in time is left alone."""

import threading

import pytest

from disttrain.core.deadlines import Deadlines

pytestmark = pytest.mark.timeout(30)


class Call:
    """The part of a gRPC servicer context the deadlines use."""

    def __init__(self):
        self.cancelled = threading.Event()
        self.times = 0

    def cancel(self):
        self.times += 1
        self.cancelled.set()


def test_a_call_past_its_deadline_is_cancelled_and_one_that_ended_is_not():
    deadlines = Deadlines()
    ended, running = Call(), Call()
    with deadlines.limit(ended, 0.05):
        pass
    with deadlines.limit(running, 0.2):
        assert running.cancelled.wait(10)
    assert running.times == 1 and ended.times == 0 and deadlines.num_cancelled == 1


def test_an_earlier_deadline_wakes_the_thread_waiting_for_a_later_one():
    deadlines = Deadlines()
    late, early = Call(), Call()
    with deadlines.limit(late, 60.0), deadlines.limit(early, 0.05):
        assert early.cancelled.wait(10)
    assert late.times == 0
