"""One node's ingress link in the simulator: a preemptive-priority single server.

Transfers are served one at a time at the full rate of the link (bounded by the source's
rate), so a node never receives faster than its NIC: the bandwidth invariant holds by
construction. Demand loads (a GPU is waiting) pre-empt the loads of requests still waiting
in the queue, which pre-empt prefetches; within a class, earlier deadlines go first. A
pre-empted transfer keeps the bytes it has received.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

DEMAND = 0
#: A request's load started while it waits in the node's queue, due at its GPU start.
QUEUED = 1
PREFETCH = 2


@dataclass(slots=True, eq=False)
class Transfer:
    tid: int
    session_id: str
    node: int
    tokens: int
    nbytes: int
    s_per_byte: float
    latency_s: float
    klass: int
    deadline_s: float
    submitted_s: float
    from_s3: bool = False
    #: Issued as a prefetch (it keeps this even when a request promotes it to a demand).
    prefetch: bool = False
    remaining_bytes: float = field(init=False)
    latency_left_s: float = field(init=False)
    version: int = 0
    done_s: float | None = None
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.remaining_bytes = float(self.nbytes)
        self.latency_left_s = self.latency_s

    def service_left_s(self) -> float:
        return self.latency_left_s + self.remaining_bytes * self.s_per_byte

    @property
    def moved_bytes(self) -> int:
        return int(self.nbytes - self.remaining_bytes)


class Link:
    """The serving order of one node's transfers. The caller owns the event queue: every
    method that changes what is in service returns the new (finish time, transfer) to
    schedule, or None; stale completions are recognised by ``Transfer.version``."""

    def __init__(self, node: int) -> None:
        self.node = node
        self.current: Transfer | None = None
        self._since = 0.0
        self._waiting: list[tuple[int, float, int, Transfer]] = []
        #: (start, end, bytes) of every service interval, kept for invariant tests.
        self.record: list[tuple[float, float, float]] | None = None

    def _account(self, now: float) -> None:
        t = self.current
        if t is None:
            return
        elapsed = now - self._since
        before = t.remaining_bytes
        lat = min(elapsed, t.latency_left_s)
        t.latency_left_s -= lat
        elapsed -= lat
        if elapsed > 0:
            t.remaining_bytes = max(0.0, t.remaining_bytes - elapsed / t.s_per_byte)
        if self.record is not None:
            self.record.append((self._since, now, before - t.remaining_bytes))
        self._since = now

    def _start_next(self, now: float) -> tuple[float, Transfer] | None:
        while self._waiting:
            _, _, _, t = heapq.heappop(self._waiting)
            if t.cancelled:
                continue
            self.current = t
            self._since = now
            t.version += 1
            return now + t.service_left_s(), t
        self.current = None
        return None

    def submit(self, t: Transfer, now: float) -> tuple[float, Transfer] | None:
        cur = self.current
        if cur is not None and t.klass < cur.klass:
            self._account(now)
            cur.version += 1  # its scheduled completion is now stale
            heapq.heappush(self._waiting, (cur.klass, cur.deadline_s, cur.tid, cur))
            self.current = None
        heapq.heappush(self._waiting, (t.klass, t.deadline_s, t.tid, t))
        if self.current is None:
            return self._start_next(now)
        return None

    def promote(self, t: Transfer, now: float) -> tuple[float, Transfer] | None:
        """Make ``t`` a demand load (a request, or now its GPU, waits for it)."""
        if t.klass == DEMAND or t.done_s is not None or t.cancelled:
            return None
        if self.current is t:
            t.klass = DEMAND
            return None
        self._waiting = [w for w in self._waiting if w[3] is not t]
        heapq.heapify(self._waiting)
        t.klass = DEMAND
        return self.submit(t, now)

    def cancel(self, t: Transfer, now: float) -> tuple[float, Transfer] | None:
        if t.done_s is not None or t.cancelled:
            return None
        t.cancelled = True
        if self.current is t:
            self._account(now)
            t.version += 1
            return self._start_next(now)
        return None

    def complete(self, t: Transfer, now: float) -> tuple[float, Transfer] | None:
        """Called at ``t``'s scheduled finish (with a matching version)."""
        self._account(now)
        t.remaining_bytes = 0.0
        t.latency_left_s = 0.0
        t.done_s = now
        return self._start_next(now)

    def backlog_s(self, now: float) -> float:
        """Seconds of work ahead of a new prefetch-class transfer."""
        total = 0.0
        cur = self.current
        if cur is not None:
            total += max(0.0, cur.service_left_s() - (now - self._since))
        for _, _, _, t in self._waiting:
            if not t.cancelled:
                total += t.service_left_s()
        return total
