"""A scheduler in this process called from an event loop, in batches
(:class:`LocalBatchingTransport`): what the HTTP API served in the scheduler actor's
process (:mod:`~kvprefetch.controlplane.live.scheduler_http`) calls.

The calls of one event loop gather while it runs: the fire-and-forget events
(``request_started``, ``request_finished``, ``hint``, ``session_closed``) answer
``accepted`` once queued, as with a batching Ray transport; the calls that answer
(``route``, ``cancel_route``, ``session_state``) wait, as does an event past
:data:`MAX_QUEUED_EVENTS` queued (back-pressure while the service is stuck). At the
loop's next turn everything gathered is applied as one
:meth:`~kvprefetch.controlplane.live.service.SchedulerService.batch` (one lock hold, one
wake-up of the control loop): the events first, in the order they came, then the calls.
While the service is free the batch runs on the event loop itself (no thread hop); while
another thread holds it (the control loop's planning step, a Ray call), it runs on a
worker thread, one batch at a time, and what arrives meanwhile goes in the next. A call
waits at most ``timeout_s`` for its answer (then TimeoutError; a batch already running
still applies it, as a remote call that timed out may). An event the service refuses is
counted (:attr:`LocalBatchStats.refused`) and logged, never fatal to the rest.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.live.client import InProcessTransport

if TYPE_CHECKING:
    from kvprefetch.controlplane.live.service import SchedulerService

log = logging.getLogger(__name__)

__all__ = ["LocalBatchStats", "LocalBatchingTransport"]

#: The fire-and-forget calls, queued and answered ``accepted``.
EVENTS = frozenset({"request_started", "request_finished", "hint", "session_closed"})
#: The calls that wait for the service's answer.
ANSWERED = frozenset({"route", "cancel_route", "session_state"})
#: Events queued at most (as :class:`~kvprefetch.controlplane.live.batching.EventBatching`
#: queues for a Ray scheduler); past it an event waits for its batch like a call.
MAX_QUEUED_EVENTS = 10_000


@dataclass(slots=True)
class LocalBatchStats:
    """Cumulative counts of a :class:`LocalBatchingTransport`."""

    batches: int = 0
    #: Batches applied on the event loop (the service was free).
    in_place: int = 0
    events: int = 0
    calls: int = 0
    #: Events the service refused or failed (logged).
    refused: int = 0
    #: Events that waited for their batch: the queue held ``MAX_QUEUED_EVENTS``.
    backpressure_waits: int = 0


class _Gathered:
    """What one event loop gathered for the next batch (shared by a transport's timeout
    views)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.calls: list[tuple[str, Any, asyncio.Future[Any]]] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.scheduled = False
        #: A batch is on a worker thread.
        self.running = False
        self.stats = LocalBatchStats()


class LocalBatchingTransport(InProcessTransport):
    """:class:`InProcessTransport` whose coroutine calls (:meth:`acall`, one event loop)
    are applied in batches (see the module docstring); its blocking calls are the
    parent's. ``batcher`` holds what is gathered and the counts."""

    def __init__(self, scheduler: SchedulerService, *, timeout_s: float = 2.0) -> None:
        super().__init__(scheduler, timeout_s=timeout_s)
        self._service = scheduler
        self.batcher = _Gathered()

    @property
    def stats(self) -> LocalBatchStats:
        return self.batcher.stats

    async def acall(self, op: str, call: Any) -> Any:
        """The gateway call ``op`` as a coroutine: an event answers ``accepted`` once
        queued; a call waits for its batch, at most ``timeout_s``."""
        gathered = self.batcher
        loop = asyncio.get_running_loop()
        if gathered.loop is None:
            gathered.loop = loop
        elif gathered.loop is not loop:
            raise RuntimeError("a LocalBatchingTransport serves one event loop")
        if op in EVENTS:
            if len(gathered.events) < MAX_QUEUED_EVENTS:
                gathered.events.append((op, call))
                self._kick()
                return api.ACCEPTED
            gathered.stats.backpressure_waits += 1  # the service is stuck: wait, bounded
        elif op not in ANSWERED:
            raise ValueError(f"not a gateway call: {op!r}")
        future: asyncio.Future[Any] = loop.create_future()
        gathered.calls.append((op, call, future))
        self._kick()
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{op} timed out after {self.timeout_s} s") from None

    def _kick(self) -> None:
        gathered = self.batcher
        if not gathered.scheduled and not gathered.running:
            gathered.scheduled = True
            assert gathered.loop is not None
            gathered.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Apply what is gathered: in place while the service is free, else on a worker
        thread."""
        gathered = self.batcher
        gathered.scheduled = False
        if gathered.running:
            return
        events = gathered.events
        calls = [c for c in gathered.calls if not c[2].done()]  # not timed out or cancelled
        gathered.events, gathered.calls = [], []
        if not events and not calls:
            return
        answers: list[Any] = []
        try:
            with self._service.try_batch() as free:
                if free:
                    answers = self._apply(events, calls)
        except Exception as exc:  # the batch itself failed: every call of it fails
            log.exception("a batch of %d events and %d calls failed", len(events), len(calls))
            _settle(calls, [exc] * len(calls))
            return
        if free:
            gathered.stats.in_place += 1
            _settle(calls, answers)
            return
        gathered.running = True
        job: Future[list[Any]] = self._pool.submit(self._apply_batch, events, calls)
        loop = gathered.loop
        assert loop is not None
        job.add_done_callback(lambda done: loop.call_soon_threadsafe(self._ran, done, calls))

    def _apply_batch(self, events: list[tuple[str, Any]],
                     calls: list[tuple[str, Any, asyncio.Future[Any]]]) -> list[Any]:
        with self._service.batch():
            return self._apply(events, calls)

    def _apply(self, events: list[tuple[str, Any]],
               calls: list[tuple[str, Any, asyncio.Future[Any]]]) -> list[Any]:
        """The events, then the calls (each answer, or the exception it raised); the
        caller holds the service's batch."""
        stats = self.batcher.stats
        stats.batches += 1
        stats.events += len(events)
        stats.calls += len(calls)
        service: Any = self._service
        for op, call in events:
            try:
                getattr(service, op)(call)
            except Exception as exc:  # counted and logged, never fatal to the batch
                stats.refused += 1
                log.warning("%s %s refused: %s: %s", op, getattr(call, "session_id", ""),
                            type(exc).__name__, exc)
        answers: list[Any] = []
        for op, call, _ in calls:
            try:
                answers.append(getattr(service, op)(call))
            except Exception as exc:  # the caller's own answer (a typed error)
                answers.append(exc)
        return answers

    def _ran(self, job: Future[list[Any]], calls: list[tuple[str, Any,
                                                             asyncio.Future[Any]]]) -> None:
        gathered = self.batcher
        gathered.running = False
        try:
            answers = job.result()
        except Exception as exc:  # the batch itself failed: every call of it fails
            answers = [exc] * len(calls)
        _settle(calls, answers)
        if gathered.events or gathered.calls:
            self._kick()


def _settle(calls: list[tuple[str, Any, asyncio.Future[Any]]], answers: list[Any]) -> None:
    for (_, _, future), answer in zip(calls, answers, strict=True):
        if future.done():
            continue
        if isinstance(answer, Exception):
            future.set_exception(answer)
        else:
            future.set_result(answer)
