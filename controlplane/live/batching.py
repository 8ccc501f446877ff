"""Fire-and-forget events to a Ray scheduler actor, queued and sent in batches:
:class:`EventBatching` (the knobs), :class:`EventBatcher` (the queue, one per actor) and
:class:`BatchStats` (what it did). :class:`~kvprefetch.controlplane.live.client.RayTransport`
holds one when it is given ``batching``."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvprefetch.controlplane.base.errors import (
    InvalidRequestError,
    KvPrefetchError,
    ServiceUnavailableError,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class EventBatching:
    """How :class:`RayTransport` queues fire-and-forget events (``request_started``,
    ``request_finished``, hints, session closes, agent and engine reports) instead of one
    actor call each: flushed when ``max_events`` are queued, every ``flush_interval_s``,
    and ahead of every ``route`` (in the same actor call, so the scheduler sees them
    first). At most ``max_batches_in_flight`` batches are unanswered and ``max_queued``
    events queued: past either a caller waits (back-pressure, counted), no event is
    dropped."""

    max_events: int = 256
    flush_interval_s: float = 0.005
    max_queued: int = 10_000
    max_batches_in_flight: int = 8

    def __post_init__(self) -> None:
        if self.max_events < 1 or self.max_queued < self.max_events:
            raise InvalidRequestError("max_events must be >= 1 and <= max_queued")
        if not self.flush_interval_s > 0 or self.max_batches_in_flight < 1:
            raise InvalidRequestError("flush_interval_s must be > 0 and "
                                      "max_batches_in_flight >= 1")


@dataclass(slots=True)
class BatchStats:
    """What an :class:`EventBatcher` did (cumulative)."""

    queued: int = 0
    batches: int = 0
    #: Events that went with a route (in its actor call).
    with_route: int = 0
    #: Times a caller waited: the queue full or too many batches unanswered.
    backpressure_waits: int = 0
    #: Events the scheduler refused or failed (each one's message is logged).
    refused: int = 0
    #: Events sent again after the actor was unavailable (Ray restarts it).
    resent: int = 0


class EventBatcher:
    """The queue of :class:`EventBatching` for one scheduler actor (thread-safe; a
    daemon thread flushes it on the timer). Events leave in the order they were queued, and
    Ray runs one caller's calls to an actor in the order they were sent."""

    def __init__(self, handle: Any, cfg: EventBatching, get: Callable[[str, Any], Any]
                 ) -> None:
        self._handle = handle
        self.cfg = cfg
        self._get = get
        self._lock = threading.Lock()
        self._queue: list[tuple[str, Any]] = []
        self._oldest_s = 0.0
        #: (reference to the actor's answer, the events it carries)
        self._in_flight: deque[tuple[Any, list[tuple[str, Any]]]] = deque()
        self.stats = BatchStats()
        self._stop = threading.Event()
        self._timer = threading.Thread(target=self._run, name="kvprefetch-batcher",
                                       daemon=True)
        self._timer.start()

    def submit(self, kind: str, call: Any) -> None:
        with self._lock:
            if len(self._queue) >= self.cfg.max_queued:
                self.stats.backpressure_waits += 1
                self._flush_locked()
            if not self._queue:
                self._oldest_s = time.monotonic()
            self._queue.append((kind, call))
            self.stats.queued += 1
            if len(self._queue) >= self.cfg.max_events:
                self._flush_locked()

    def send_with(self, send: Callable[[list[tuple[str, Any]]], _T]
                  ) -> tuple[_T, list[tuple[str, Any]]]:
        """The queued events, handed to ``send`` (which submits the synchronous call that
        carries them) under the queue's lock, so that no call of another thread (a flush,
        another gateway thread's route) is submitted between taking them and sending
        them: a session's events reach the actor in the order they were queued. Returns
        what ``send`` returned and the events."""
        with self._lock:
            events, self._queue = self._queue, []
            self.stats.with_route += len(events)
            return send(events), events

    def put_back(self, events: list[tuple[str, Any]]) -> None:
        """Events :meth:`send_with` gave out whose call failed before the actor had them: queued
        again ahead of the rest (counted as resent)."""
        if events:
            with self._lock:
                if not self._queue:
                    self._oldest_s = time.monotonic()
                self._queue[:0] = events
                self.stats.resent += len(events)

    def settle_refusals(self, refused: Sequence[str]) -> None:
        if refused:
            with self._lock:
                self.stats.refused += len(refused)
            for msg in refused:
                log.warning("batched event refused: %s", msg)

    def flush(self, *, wait: bool = False) -> None:
        """Send what is queued; ``wait``: until every batch is answered."""
        with self._lock:
            self._flush_locked()
            if wait:
                while self._in_flight:
                    self._settle_oldest()

    def _flush_locked(self) -> None:
        if self._queue:
            events, self._queue = self._queue, []
            self._in_flight.append((self._handle.apply_events.remote(events), events))
            self.stats.batches += 1
        self._reap()
        while len(self._in_flight) > self.cfg.max_batches_in_flight:
            self.stats.backpressure_waits += 1
            self._settle_oldest()

    def _reap(self) -> None:
        """Settle the answered batches at the head (without waiting)."""
        import ray

        while self._in_flight:
            ready, _ = ray.wait([self._in_flight[0][0]], timeout=0)
            if not ready:
                return
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        ref, events = self._in_flight.popleft()
        try:
            refused = self._get("apply_events", ref)
        except TimeoutError:
            # Still running (a slow actor): waited for again, never sent twice.
            self.stats.backpressure_waits += 1
            self._in_flight.appendleft((ref, events))
            return
        except ServiceUnavailableError as exc:
            # The actor died under it (Ray restarts it): sent again, ahead of anything
            # queued since; an event it had applied before dying is refused the second
            # time (counted) or is idempotent.
            log.warning("batch of %d events: %s; sending it again", len(events), exc)
            self.stats.resent += len(events)
            self._in_flight.appendleft((self._handle.apply_events.remote(events), events))
            return
        except KvPrefetchError as exc:
            refused = [f"batch: {exc}"] * len(events)
        self.stats.refused += len(refused)
        for msg in refused:
            log.warning("batched event refused: %s", msg)

    def _run(self) -> None:
        interval = self.cfg.flush_interval_s
        while not self._stop.wait(interval):
            try:
                with self._lock:
                    if self._queue and time.monotonic() - self._oldest_s >= interval:
                        self._flush_locked()
                    else:
                        self._reap()
            except Exception:  # the timer never dies; the next tick tries again
                log.exception("event batcher flush failed")

    def close(self) -> None:
        """Send everything and wait for the answers, then stop the timer."""
        try:
            self.flush(wait=True)
        finally:
            self._stop.set()
