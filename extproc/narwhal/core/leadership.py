"""Active/standby through a ``coordination.k8s.io/v1`` Lease, sans I/O.

The algorithm is client-go's leader election, with the safety argument made explicit:

* Every ``retry_period`` the adapter reads the Lease and asks ``decide`` what to write:
  create it, renew it (we hold it), take it over (it expired), or nothing (someone else
  holds it). Writes carry the ``resourceVersion`` read, so two replicas racing for one
  Lease cannot both succeed: the API server answers the loser 409 Conflict.
* Expiry is judged on the **local** clock, from when this replica last saw the Lease
  change, never from the ``renewTime`` written by another machine's clock.
* A leader counts its lease from the moment it **sent** the write that renewed it, and
  stops admitting ``renew_deadline`` later unless a newer renewal succeeded. A standby
  takes over no earlier than ``lease_duration`` after it saw that renewal land, which is
  after it was sent. With ``renew_deadline < lease_duration`` the old leader has stopped
  admitting before anyone else can start: a leader frozen (SIGSTOP, a long GC pause)
  finds on resume that its deadline passed and refuses before it reads anything.
* The fencing token is the Lease's ``leaseTransitions`` when this replica acquired it:
  it grows with every change of holder, so admissions logged with it are ordered.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The fields of a Lease's spec (and its version) that leader election uses."""

    holder: str
    duration_s: float
    transitions: int
    renew_time: str  # RFC 3339, informational: expiry is judged on the local clock
    acquire_time: str = ""
    resource_version: str = ""  # empty: not yet created

    def to_spec(self) -> dict[str, object]:
        spec: dict[str, object] = {"holderIdentity": self.holder,
                                   "leaseDurationSeconds": max(1, math.ceil(self.duration_s)),
                                   "leaseTransitions": self.transitions}
        if self.renew_time:
            spec["renewTime"] = self.renew_time
        if self.acquire_time:
            spec["acquireTime"] = self.acquire_time
        return spec

    @classmethod
    def from_object(cls, obj: dict) -> LeaseRecord:
        """From a Lease object as the API server returns it (``spec`` fields optional)."""
        spec = obj.get("spec") or {}
        meta = obj.get("metadata") or {}
        return cls(holder=str(spec.get("holderIdentity") or ""),
                   duration_s=float(spec.get("leaseDurationSeconds") or 0),
                   transitions=int(spec.get("leaseTransitions") or 0),
                   renew_time=str(spec.get("renewTime") or ""),
                   acquire_time=str(spec.get("acquireTime") or ""),
                   resource_version=str(meta.get("resourceVersion") or ""))


def micro_time(wall: float) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return dt.datetime.fromtimestamp(wall, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True, slots=True)
class Write:
    """What to send: ``create`` a Lease that does not exist, else replace it, carrying the
    ``resource_version`` read (optimistic concurrency)."""

    record: LeaseRecord
    create: bool
    acquiring: bool  # a change of holder (else a renewal)


class Leadership:
    def __init__(self, identity: str, lease_duration_s: float, renew_deadline_s: float,
                 retry_period_s: float) -> None:
        if not 0 < retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError("leader election needs retry_period < renew_deadline < "
                             "lease_duration")
        self.identity = identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self.observed: LeaseRecord | None = None
        self.observed_at = 0.0  # local time the observed record last changed
        self.renewed_at: float | None = None  # when our last successful write was sent
        self.token: int | None = None  # leaseTransitions when we acquired
        self.was_leader = False
        self.acquisitions = 0
        self.releasing = False

    # -- state -------------------------------------------------------------------------
    def leading(self, now: float) -> bool:
        """True while this replica may admit: it holds the Lease and its last renewal was
        sent less than ``renew_deadline`` ago."""
        return (self.renewed_at is not None and not self.releasing
                and now - self.renewed_at < self.renew_deadline_s)

    def reason(self, now: float) -> str | None:
        """None while leading; ``fenced`` once it led and lost the lease, else ``standby``."""
        if self.leading(now):
            return None
        return "fenced" if self.was_leader else "standby"

    def holder(self) -> str:
        return self.observed.holder if self.observed is not None else ""

    # -- the loop ------------------------------------------------------------------------
    def observe(self, now: float, record: LeaseRecord | None) -> None:
        """What a read of the Lease returned (None: it does not exist)."""
        if record != self.observed:
            self.observed = record
            self.observed_at = now
        if record is not None and record.holder != self.identity:
            self.renewed_at = None  # someone else holds it: we are not leading, whatever
            self.token = None       # our deadline says

    def decide(self, now: float, wall: float) -> Write | None:
        """The write to attempt after ``observe``, or None (another replica leads)."""
        rec = self.observed
        stamp = micro_time(wall)
        if rec is None:
            return Write(LeaseRecord(self.identity, self.lease_duration_s, 0, stamp, stamp),
                         create=True, acquiring=True)
        if rec.holder == self.identity:  # identities are unique per process
            return Write(replace(rec, renew_time=stamp, duration_s=self.lease_duration_s),
                         create=False, acquiring=self.token is None)
        # The holder's own duration (as written), judged on our clock from when we saw it.
        duration = rec.duration_s or self.lease_duration_s
        expired = not rec.holder or now - self.observed_at >= duration
        return self._acquire(rec, stamp) if expired else None

    def _acquire(self, rec: LeaseRecord, stamp: str) -> Write:
        return Write(replace(rec, holder=self.identity, duration_s=self.lease_duration_s,
                             transitions=rec.transitions + 1, renew_time=stamp,
                             acquire_time=stamp), create=False, acquiring=True)

    def written(self, sent_at: float, now: float, result: LeaseRecord) -> None:
        """The write sent at ``sent_at`` succeeded; ``result`` is the stored Lease."""
        self.observed = result
        self.observed_at = now
        if result.holder != self.identity:
            return
        if self.token is None or result.transitions != self.token:
            self.acquisitions += 1
        self.token = result.transitions
        self.renewed_at = sent_at
        self.was_leader = True

    def release(self) -> Write | None:
        """On shutdown: stop admitting now, and hand the Lease over (empty holder, so a
        standby takes it at its next read instead of waiting for expiry)."""
        self.releasing = True
        rec = self.observed
        if rec is None or rec.holder != self.identity or self.token is None:
            return None
        return Write(replace(rec, holder="", duration_s=1.0, renew_time=""),
                     create=False, acquiring=False)
