"""When a node's prefetch warms start: they give way to the engine's own work, and an order
that could not start by its deadline is dropped rather than served late.

Two mechanisms, each with its own knob in :class:`WarmingConfig` (the agent's ``warming``
section):

- **Yield.** While the node's engine is busy (at least ``defer_while_waiting_requests``
  requests waiting, or ``defer_while_running_requests`` running, as its load probe says:
  :class:`~kvprefetch.agents.vllm.engine_load.EngineLoadProbe`), a new prefetch order is
  held instead of started. A held order starts as soon as the engine is no longer busy, or
  ``start_before_deadline_s`` before its deadline, whichever comes first, or at once when
  the engine waits on it (the request came). Without a probe (no ``engine_url``), or for an
  engine that does not publish its load, nothing is held.
- **Late drop.** A prefetch order not started within ``late_grace_s`` after its deadline is
  dropped: never handed to the backend, reported as not done, and counted.

A demand load (``prefetch`` false) is the engine's own work: it is never held nor dropped.
An order's deadline on this node is its ``due_in_wall_s`` counted from its arrival here
(the scheduler sends it relative, so that the nodes' clocks need not agree); an order
without one is never held nor dropped.

Who calls what: the agent calls :meth:`WarmGate.offer` once per new order (from Ray's call
threads), :meth:`WarmGate.release` when the engine waits on an order, and
:meth:`WarmGate.withdraw` on a cancel; the gate's own thread polls the engine's load while
it holds orders and calls the agent's ``start`` and ``drop`` callbacks, never under its
lock. Thread-safe.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.vllm.engine_load import EngineLoad
from kvprefetch.controlplane.base.wire import TransferOrder

log = logging.getLogger(__name__)


class WarmingConfig(BaseModel):
    """How the node's prefetch warms yield to its engine (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Hold a new prefetch while the engine has at least this many requests waiting
    #: (vLLM's ``vllm:num_requests_waiting``); 0: waiting requests hold nothing.
    defer_while_waiting_requests: int = Field(1, ge=0)
    #: ... or at least this many requests running (``vllm:num_requests_running``: a prefill
    #: or decode under way); 0: running requests hold nothing.
    defer_while_running_requests: int = Field(0, ge=0)
    #: Read the engine's load at most this often (milliseconds); between reads the last
    #: answer holds.
    engine_poll_interval_ms: float = Field(100.0, gt=0, le=60_000)
    #: A held order starts anyway this long before its deadline (wall seconds), busy engine
    #: or not.
    start_before_deadline_s: float = Field(0.0, ge=0)
    #: A prefetch not started within this long after its deadline (wall seconds) is
    #: dropped and counted; None: never dropped.
    late_grace_s: float | None = Field(0.5, ge=0)
    #: The engine's Prometheus page; "" = ``engine_url``'s ``/metrics``.
    engine_metrics_url: str = ""

    @property
    def defers(self) -> bool:
        """Whether any engine load holds a warm."""
        return self.defer_while_waiting_requests > 0 or self.defer_while_running_requests > 0

    def busy(self, load: EngineLoad) -> bool:
        """Whether ``load`` holds a new warm."""
        if not load.known:
            return False
        waiting, running = self.defer_while_waiting_requests, self.defer_while_running_requests
        return (0 < waiting <= load.waiting) or (0 < running <= load.running)


class Verdict(enum.Enum):
    """What :meth:`WarmGate.offer` decided for an order."""

    START = "start"  # the caller starts it now
    HELD = "held"  # the gate starts it later (its ``start`` callback) or drops it
    LATE = "late"  # past its deadline and grace: the caller reports it dropped


@dataclass(frozen=True, slots=True)
class WarmGateStats:
    """Counters since start: ``deferred`` orders held at least once; ``dropped_late``
    orders dropped past their deadline; ``held`` orders held now."""

    deferred: int = 0
    dropped_late: int = 0
    held: int = 0


@dataclass(frozen=True, slots=True)
class _Held:
    order: TransferOrder
    #: The order's deadline on ``clock`` (wall seconds).
    due_s: float


class WarmGate:
    """See the module docstring. ``load`` reads the engine's load (None: no probe, nothing
    is held); ``start`` and ``drop`` carry a held order out (called on the gate's thread)."""

    def __init__(self, config: WarmingConfig, load: Callable[[], EngineLoad] | None,
                 start: Callable[[TransferOrder], None],
                 drop: Callable[[TransferOrder], None], *,
                 clock: Callable[[], float] = time.monotonic, name: str = "warm-gate") -> None:
        self.config = config
        self._load = load if config.defers else None
        self._start = start
        self._drop = drop
        self._clock = clock
        self.name = name
        self._cv = threading.Condition()
        self._held: dict[int, _Held] = {}
        self._thread: threading.Thread | None = None
        self._closing = False
        self._deferred = self._dropped = 0

    def start(self) -> None:
        """Start the thread that releases held orders (none without a probe)."""
        if self._load is None or self._thread is not None:
            return
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def close(self) -> list[TransferOrder]:
        """Stop the thread; returns the orders still held (never started). Idempotent."""
        with self._cv:
            self._closing = True
            held = [h.order for h in self._held.values()]
            self._held.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return held

    # ------------------------------------------------------------------ the agent's calls
    def offer(self, order: TransferOrder) -> Verdict:
        """Decide a new order's start (see :class:`Verdict`); a held order is the gate's
        until it starts, is dropped, released or withdrawn."""
        if not order.prefetch or order.due_in_wall_s is None:
            return Verdict.START
        now = self._clock()
        due = now + order.due_in_wall_s
        if self._late(due, now):
            with self._cv:
                self._dropped += 1
            return Verdict.LATE
        if (self._load is None or self._thread is None
                or now >= due - self.config.start_before_deadline_s or not self._busy()):
            return Verdict.START
        with self._cv:
            if self._closing:
                return Verdict.START
            self._held[order.order_id] = _Held(order, due)
            self._deferred += 1
            self._cv.notify_all()
        return Verdict.HELD

    def release(self, order_id: int) -> TransferOrder | None:
        """Take a held order back to start it now (the engine waits on it), or None when
        it is not held."""
        with self._cv:
            held = self._held.pop(order_id, None)
        return held.order if held is not None else None

    def withdraw(self, session_id: str, order_id: int | None = None) -> list[TransferOrder]:
        """Take back the session's held orders (or one of them): cancelled before they
        started."""
        with self._cv:
            gone = [oid for oid, h in self._held.items() if h.order.session_id == session_id
                    and (order_id is None or oid == order_id)]
            return [self._held.pop(oid).order for oid in gone]

    def holds(self, order_id: int) -> bool:
        with self._cv:
            return order_id in self._held

    def stats(self) -> WarmGateStats:
        with self._cv:
            return WarmGateStats(self._deferred, self._dropped, len(self._held))

    # ------------------------------------------------------------------ the gate's thread
    def _late(self, due_s: float, now_s: float) -> bool:
        grace = self.config.late_grace_s
        return grace is not None and now_s > due_s + grace

    def _busy(self) -> bool:
        """Whether the engine's load holds a warm; a load that cannot be read is idle."""
        if self._load is None:
            return False
        try:
            return self.config.busy(self._load())
        except Exception:  # keep warming: an unreadable load reads as idle
            log.exception("%s: reading the engine's load failed", self.name)
            return False

    def _run(self) -> None:
        interval_s = self.config.engine_poll_interval_ms / 1000
        lead_s = self.config.start_before_deadline_s
        while True:
            with self._cv:
                while not self._held and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
            busy = self._busy()
            now = self._clock()
            with self._cv:
                late = [oid for oid, h in self._held.items() if self._late(h.due_s, now)]
                go = [oid for oid, h in self._held.items() if oid not in late
                      and (not busy or now >= h.due_s - lead_s)]
                dropped = [self._held.pop(oid).order for oid in late]
                started = sorted((self._held.pop(oid).order for oid in go),
                                 key=lambda o: -o.priority)
                self._dropped += len(dropped)
            for order in dropped:
                self._carry(self._drop, order)
            for order in started:
                self._carry(self._start, order)
            with self._cv:
                if self._held and not self._closing:
                    next_due = min(h.due_s - lead_s for h in self._held.values())
                    self._cv.wait(max(0.0, min(interval_s, next_due - self._clock())))

    def _carry(self, call: Callable[[TransferOrder], None], order: TransferOrder) -> None:
        try:
            call(order)
        except Exception:  # the agent reports its own failures; the gate goes on
            log.exception("%s: order %d could not be carried out", self.name, order.order_id)
