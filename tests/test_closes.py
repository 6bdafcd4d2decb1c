"""Ambiguous closes wait for Envoy's verdict, on a fake clock."""

from __future__ import annotations

from narwhal.core.closes import CloseVerdicts
from narwhal.core.errors import CANCELLED, FAILED


class Timers:
    def __init__(self) -> None:
        self.calls: list = []

    def call_later(self, delay, callback):
        self.calls.append((delay, callback))


def test_verdict_after_close():
    timers = Timers()
    v = CloseVerdicts(1.0, timers)
    got = []
    v.closed("r1", got.append)
    assert got == [] and timers.calls[0][0] == 1.0
    v.logged("r1", FAILED)
    assert got == [FAILED]
    timers.calls[0][1]()  # the fallback fires later: nothing more
    assert got == [FAILED]


def test_no_verdict_counts_cancelled():
    timers = Timers()
    v = CloseVerdicts(1.0, timers)
    got = []
    v.closed("r1", got.append)
    timers.calls[0][1]()
    assert got == [CANCELLED] and not v.pending


def test_verdict_before_close_is_kept_bounded():
    v = CloseVerdicts(1.0, Timers(), capacity=2)
    for rid in ("a", "b", "c"):
        v.logged(rid, FAILED)
    assert list(v.early) == ["b", "c"]
    got = []
    v.closed("c", got.append)
    assert got == [FAILED]


def test_without_a_request_id_or_a_wait_it_is_cancelled_at_once():
    got = []
    CloseVerdicts(1.0, Timers()).closed("", got.append)
    CloseVerdicts(0.0, Timers()).closed("r", got.append)
    assert got == [CANCELLED, CANCELLED]
