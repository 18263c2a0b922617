"""The stop step of a preempted synchronous parameter-server worker (`worker.preemption`):
the step its SIGTERM handler commits it to, and where the training loop's stop points stop
it once the workers' answer is in. The handler is called directly; the barrier is a
function the test answers."""

import threading

import pytest

from disttrain.core.errors import DistributedError
from disttrain.strategies.ps.worker.preemption import PreemptionAgreement


class Barrier:
    """Records the step each arrival brings; answers with the rows the test gives."""

    def __init__(self, others: list[float], error: Exception | None = None):
        self.others, self.error = others, error
        self.arrived: list[int] = []
        self.release = threading.Event()

    def __call__(self, step: int) -> list[list[float]]:
        self.arrived.append(step)
        self.release.wait(10)
        if self.error is not None:
            raise self.error
        return [[float(step)], *([value] for value in self.others)]


def agreement(barrier: Barrier, step: list[int], grace_s: float = 10.0) -> PreemptionAgreement:
    return PreemptionAgreement(barrier, lambda: step[0], grace_s)


@pytest.mark.timeout(30)
def test_a_worker_stops_at_the_highest_step_any_worker_committed_to():
    barrier, step = Barrier([9.0]), [7]
    stop = agreement(barrier, step)
    assert not stop.is_set()  # a stop point at step 7: committed to step 8 from here
    stop.handle()
    barrier.release.set()
    step[0] = 8
    assert not stop.is_set()  # the other worker is in step 9: go on to it
    step[0] = 9
    assert stop.is_set()
    assert barrier.arrived == [8] and stop.stop_step == 9


@pytest.mark.timeout(30)
def test_a_signal_before_the_first_stop_point_commits_to_the_step_in_progress():
    barrier, step = Barrier([5.0]), [4]
    stop = agreement(barrier, step)
    stop.handle()
    stop.handle()  # a second SIGTERM (the machine's and the launcher's) changes nothing
    barrier.release.set()
    step[0] = 5
    assert stop.is_set()
    assert barrier.arrived == [5]


@pytest.mark.timeout(30)
def test_a_reassigned_worker_s_row_is_left_out_and_a_failed_barrier_stops_at_the_next_point():
    barrier, step = Barrier([float("nan")]), [3]
    stop = agreement(barrier, step)
    assert not stop.is_set()
    stop.handle()
    barrier.release.set()
    step[0] = 4
    assert stop.is_set() and stop.stop_step == 4

    failing = Barrier([], error=DistributedError("shard 0 unreachable"))
    stop = agreement(failing, [3])
    stop.handle()
    failing.release.set()
    assert stop.is_set() and stop.stop_step is None


@pytest.mark.timeout(30)
def test_no_answer_within_the_grace_stops_at_the_stop_point_and_no_signal_never_stops():
    barrier, step = Barrier([]), [2]
    stop = agreement(barrier, step, grace_s=0.05)
    assert not stop.is_set() and not stop.is_set()
    stop.handle()
    assert stop.is_set()  # the barrier never answers (a peer was not signalled)
    barrier.release.set()
    assert stop.answered.wait(10)  # its thread done before the test's log capture closes
