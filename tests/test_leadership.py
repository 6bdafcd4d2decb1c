"""Leader election's core on a fake clock: acquisition, renewal, expiry, fencing, release,
and the safety property (never two leaders at one instant) under random schedules of
replicas frozen and delayed, against an in-memory Lease store with resourceVersion checks
(the integration suite runs the real loop against a stand-in API server process)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.leadership import Leadership, LeaseRecord, Write, micro_time

LEASE, RENEW, RETRY = 2.0, 1.5, 0.25


class Store:
    """One Lease, optimistic concurrency as the API server does it."""

    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.version = 0

    def read(self) -> LeaseRecord | None:
        return self.record

    def write(self, w: Write) -> LeaseRecord | None:
        if w.create and self.record is not None:
            return None  # 409 AlreadyExists
        if not w.create and (self.record is None
                             or w.record.resource_version != self.record.resource_version):
            return None  # 409 Conflict
        self.version += 1
        self.record = replace(w.record, resource_version=str(self.version))
        return self.record


def step(le: Leadership, store: Store, now: float) -> None:
    le.observe(now, store.read())
    w = le.decide(now, 1.7e9 + now)
    if w is not None:
        out = store.write(w)
        if out is not None:  # a refused write changes nothing in the core
            le.written(now, now, out)


def make(name: str) -> Leadership:
    return Leadership(name, LEASE, RENEW, RETRY)


def test_first_replica_creates_the_lease_and_leads_while_it_renews():
    store, a = Store(), make("a")
    assert a.reason(0.0) == "standby"
    step(a, store, 0.0)
    assert a.leading(0.0) and a.token == 0 and store.record.holder == "a"
    assert a.leading(RENEW - 0.01) and not a.leading(RENEW)  # no renewal: fenced
    assert a.reason(RENEW) == "fenced"
    step(a, store, RENEW + 0.1)  # renewing again restores it, same token
    assert a.leading(RENEW + 0.1) and a.token == 0 and a.acquisitions == 1


def test_standby_takes_over_only_after_the_lease_expires_on_its_own_clock():
    store, a, b = Store(), make("a"), make("b")
    step(a, store, 0.0)
    step(b, store, 0.1)
    assert not b.leading(0.1) and b.reason(0.1) == "standby"
    # a is frozen from here; b keeps reading an unchanged record.
    t = 0.1
    while t < 0.1 + LEASE - RETRY:
        t += RETRY
        step(b, store, t)
        assert not b.leading(t)
    assert not a.leading(t)  # a stopped admitting at RENEW, before b may start
    step(b, store, 0.1 + LEASE)
    assert b.leading(0.1 + LEASE) and b.token == 1 and store.record.transitions == 1
    # a resumes: refuses before it reads anything, and reads that b holds the lease.
    now = 0.1 + LEASE + 5
    assert a.reason(now) == "fenced"
    step(a, store, now)
    assert not a.leading(now) and a.reason(now) == "fenced" and a.holder() == "b"


def test_two_replicas_racing_for_one_version_cannot_both_win():
    store, a, b = Store(), make("a"), make("b")
    a.observe(0.0, store.read())
    b.observe(0.0, store.read())
    wa, wb = a.decide(0.0, 1.0), b.decide(0.0, 1.0)
    assert wa is not None and wb is not None and wa.create and wb.create
    ra, rb = store.write(wa), store.write(wb)
    assert ra is not None and rb is None
    a.written(0.0, 0.0, ra)  # b's write was refused: it is told nothing
    assert a.leading(0.0) and not b.leading(0.0)


def test_release_hands_over_at_the_next_read_and_the_token_grows():
    store, a, b = Store(), make("a"), make("b")
    step(a, store, 0.0)
    step(b, store, 0.1)
    w = a.release()
    assert w is not None and w.record.holder == ""
    assert not a.leading(0.2)  # stops admitting before the write even lands
    store.write(w)
    step(b, store, 0.3)
    assert b.leading(0.3) and b.token == 1


def test_invalid_timing_is_refused():
    with pytest.raises(ValueError):
        Leadership("a", 2.0, 2.0, 0.5)


def test_record_round_trips_a_lease_object():
    rec = LeaseRecord("a", 2.0, 3, micro_time(0.5), micro_time(0.25), "17")
    obj = {"metadata": {"resourceVersion": "17"}, "spec": rec.to_spec()}
    assert LeaseRecord.from_object(obj) == rec
    assert rec.to_spec()["renewTime"] == "1970-01-01T00:00:00.500000Z"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.floats(0.0, 4.0), st.floats(0.0, 0.3)),
                min_size=1, max_size=12))
def test_never_two_leaders_at_one_instant(events):
    """Three replicas step every RETRY; each event freezes one replica for a while at some
    moment, and its writes then take up to 0.3 s to be answered (sent before, stored on
    arrival): at every tick at most one replica may admit."""
    store = Store()
    reps = [make(n) for n in "abc"]
    frozen_until = [0.0, 0.0, 0.0]
    latency = [0.0, 0.0, 0.0]
    next_step = [0.0, 0.05, 0.1]
    plan = sorted((i * 1.0 + start, rep, dur, lat)
                  for i, (rep, dur, lat) in enumerate(events) for start in [0.5])
    t, dt, end = 0.0, 0.05, len(events) * 1.0 + 6.0
    leaders_seen = set()
    while t < end:
        while plan and plan[0][0] <= t:
            _, rep, dur, lat = plan.pop(0)
            frozen_until[rep] = t + dur
            latency[rep] = lat
        for i, le in enumerate(reps):
            if t < frozen_until[i] or t < next_step[i]:
                continue
            le.observe(t, store.read())
            w = le.decide(t, 1.7e9 + t)
            if w is not None:
                out = store.write(w)  # stored now; the answer comes after the latency
                if out is not None:
                    le.written(t, t + latency[i], out)
            next_step[i] = t + RETRY + latency[i]
        leading = [le.identity for le in reps if le.leading(t)]
        assert len(leading) <= 1, (t, leading)
        leaders_seen.update(leading)
        t = round(t + dt, 6)
    assert leaders_seen  # someone led
