"""Ambiguous closes wait for Envoy's verdict, on a fake clock."""

from __future__ import annotations

from narwhal.core.closes import CloseVerdicts
from narwhal.core.errors import CANCELLED, FAILED


def test_verdict_after_close():
    v = CloseVerdicts(1.0)
    got = []
    v.closed("r1", got.append, 10.0)
    assert got == [] and v.wake_at() == 11.0
    v.logged("r1", FAILED)
    assert got == [FAILED] and v.wake_at() is None
    v.expire(12.0)  # the wait would have run out later: nothing more
    assert got == [FAILED]


def test_no_verdict_counts_cancelled_when_the_wait_runs_out():
    v = CloseVerdicts(1.0)
    got = []
    v.closed("r1", got.append, 10.0)
    v.closed("r2", got.append, 10.5)
    v.expire(10.99)
    assert got == []
    v.expire(11.0)
    assert got == [CANCELLED] and v.wake_at() == 11.5
    v.expire(11.5)
    assert got == [CANCELLED, CANCELLED] and not v.pending and v.wake_at() is None


def test_verdict_before_close_is_kept_bounded():
    v = CloseVerdicts(1.0, capacity=2)
    for rid in ("a", "b", "c"):
        v.logged(rid, FAILED)
    assert list(v.early) == ["b", "c"]
    got = []
    v.closed("c", got.append, 0.0)
    assert got == [FAILED]


def test_without_a_request_id_or_a_wait_it_is_cancelled_at_once():
    got = []
    CloseVerdicts(1.0).closed("", got.append, 0.0)
    CloseVerdicts(0.0).closed("r", got.append, 0.0)
    assert got == [CANCELLED, CANCELLED]
