"""Refusal warnings at a bounded rate, with a fake clock."""

import logging

from disttrain.core.refusal_log import MAX_KINDS, RateLimitedLog


def test_one_line_per_kind_per_interval_then_a_count_of_those_left_out(caplog):
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("limit-test"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="limit-test"):
        written = [log.warning("UNAUTHENTICATED", "refused %s", i) for i in range(1000)]
        assert log.warning("INVALID_ARGUMENT", "bad field")  # another kind is not held back
        now[0] = 10.0
        assert log.warning("UNAUTHENTICATED", "refused %s", "again")
    assert written.count(True) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "refused 0", "bad field", "refused again (and 999 more like it in the last 10s)"]


def test_the_table_of_kinds_stays_bounded():
    log = RateLimitedLog(logging.getLogger("limit-test"), clock=lambda: 0.0)
    for i in range(3 * MAX_KINDS):
        log.warning(f"kind {i}", "line")
    assert len(log.kinds._callers) == MAX_KINDS
