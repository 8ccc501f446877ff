"""LMCache's own account of its L1: the MP server's CPU KV events, followed over its
request transport.

LMCache 0.5.6's MP server records every change to its CPU tier (L1) in a bounded,
sequenced log (``KVEventModule``, ``lmcache/v1/multiprocess/modules/kv_events.py``) and
streams it: the ``subscribe_kv_events(instance_id, model_name, cursor, max_events)`` RPC of
its request client (``RequestClient``, ``lmcache/v1/multiprocess/transport/base.py``; ZMQ
for ``tcp://``, gRPC for ``grpc://``, chosen by ``RequestClientFactory``) answers a
``MessagingStream`` of ``KVEventBatch(enabled, incarnation, next_cursor, lost, events)``
(``lmcache/v1/multiprocess/custom_types.py``). A ``removed`` record names the chunk hashes
of one model that L1 no longer holds, whatever removed them: its eviction policy past the
watermark, ``DELETE /cache/objects``, ``POST /cache/clear``, a one-off read's temporary
object freed (every ``L1_KEYS_EVICTED`` event of ``lmcache/v1/distributed/l1_manager.py``).
``stored`` records need token bindings that only the GPU (LMCache-driven) transfer path
publishes; they are not used here. The server keeps the channel when
``--kv-event-log-size`` is positive (32768 records by default) and its observability event
bus is on (no ``--disable-observability``); it then lists ``kv_event_stream`` in
``get_experimental`` and ``GET /status`` shows ``kv_events.enabled``.

:class:`KVEventSubscriber` follows that stream for one model and hands each batch's
removed chunk hashes to a :class:`KVEventSink`, keeping the contract ``KVEventBatch``
states:

* The first subscription starts from now (a cursor past the end of the log): the records
  before it describe chunks nobody here warmed.
* A batch with ``lost`` (the server's event bus dropped events, or the log was trimmed past
  our cursor) or with another ``incarnation`` than the last one (the server restarted, and
  its L1 with it) means records were missed: the sink resyncs (:meth:`KVEventSink.resync`).
  So does a first contact that came after :meth:`KVEventSubscriber.start` stopped waiting
  for it, and a server that stops publishing.
* A stream that ends (the server restarted or went away, reaped the subscription, or the
  connection dropped) is subscribed again from the last cursor after a backoff that doubles
  from ``BACKOFF_FIRST_S`` up to ``BACKOFF_MAX_S`` and resets once a stream delivers; the
  loop logs, counts and goes on, and never takes the agent down.
* Every ``PING_INTERVAL_S`` the subscriber pings the server under its instance id: the
  server closes a subscription silent for ``--worker-reap-timeout-seconds`` (PING refreshes
  it), and a ping that gets no answer within ``timeout_s`` closes the stream, so a server
  that hangs without dropping the connection is noticed.

Bounded: the server sends the next batch (at most ``max_events`` records) only once the
previous one has been handed to the sink; the subscriber keeps counters and the cursor.
LMCache and ZMQ are imported in :meth:`KVEventSubscriber.start`; the constructor does no
I/O.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from kvprefetch.agents.lmcache.errors import LMCacheError

log = logging.getLogger(__name__)

#: Why a sink resyncs: records were lost, the server restarted, the first contact came
#: after start-up stopped waiting for it, or the server stopped publishing.
ResyncReason = Literal["events_lost", "server_restart", "late_subscription",
                       "channel_disabled"]
SubscriptionState = Literal["new", "connecting", "subscribed", "disabled", "closed"]

#: ``KVEventRecord.kind`` and ``.medium`` of a removal from L1 (``KV_EVENT_KIND_REMOVED``,
#: ``KV_EVENT_MEDIUM_CPU`` in ``lmcache/v1/multiprocess/custom_types.py``).
KIND_REMOVED, MEDIUM_CPU = "removed", "cpu"
#: A cursor past any log's end: the first subscription starts from now.
FROM_NOW = 1 << 62
#: Records per batch (the server accepts 1 to 1024).
MAX_EVENTS = 512
#: Seconds between pings (the server's reap timeout is 0 or at least 30 s).
PING_INTERVAL_S = 10.0
#: Backoff between subscription attempts (seconds).
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.2, 10.0


class KVEventSink(Protocol):
    """Where a :class:`KVEventSubscriber` delivers. Called on the subscriber's thread, one
    call at a time, in the log's order; the server holds the next batch until the call
    returns, so a call should be quick. An exception is logged and counted, and the
    stream goes on."""

    def removed(self, chunk_hashes: Sequence[bytes]) -> None:
        """L1 no longer holds these chunks of the subscribed model (one batch's worth)."""

    def resync(self, reason: ResyncReason) -> None:
        """Records were missed: whatever the sink inferred from earlier ones may be wrong."""


@dataclass(frozen=True, slots=True)
class KVEventStats:
    """A snapshot of one subscription. ``state``: ``connecting`` until a stream delivers
    (and again between streams), ``subscribed`` while one does, ``disabled`` while the
    server answers that it publishes nothing, ``closed`` after :meth:`KVEventSubscriber.
    close`."""

    state: SubscriptionState
    #: The server's event-log incarnation (0 before the first contact).
    incarnation: int
    #: The last record seen (the next subscription resumes after it).
    cursor: int
    batches: int
    removed_records: int
    removed_chunks: int
    #: Resyncs, by :data:`ResyncReason` (a copy).
    resyncs: dict[str, int]
    #: Streams opened, and of those the ones that followed an ended one.
    subscriptions: int
    reconnects: int
    #: Failed attempts, unanswered pings and sink errors; the last one's text.
    errors: int
    last_error: str


class KVEventSubscriber:
    """Follows one LMCache MP server's CPU KV events for ``model_name`` (see the module
    docstring). ``url`` is the server's request endpoint (``tcp://host:port``);
    ``timeout_s`` bounds each ping and the wait for a new stream's first batch.

    Who calls what: its owner (:class:`~kvprefetch.agents.backends.lmcache.warmer.LMCacheWarmer`)
    calls :meth:`start` once and :meth:`close` once; monitoring calls :meth:`stats` (any
    thread). Its own threads call the sink.
    """

    def __init__(self, url: str, model_name: str, sink: KVEventSink, *,
                 timeout_s: float = 10.0, max_events: int = MAX_EVENTS,
                 ping_interval_s: float = PING_INTERVAL_S,
                 backoff_s: tuple[float, float] = (BACKOFF_FIRST_S, BACKOFF_MAX_S),
                 name: str = "lmcache-events") -> None:
        if timeout_s <= 0 or ping_interval_s <= 0:
            raise ValueError("timeout_s and ping_interval_s must be positive")
        if not 0 < max_events <= 1024:
            raise ValueError(f"max_events must be in [1, 1024], got {max_events}")
        if not 0 < backoff_s[0] <= backoff_s[1]:
            raise ValueError(f"backoff_s must be (first, max) with 0 < first <= max, "
                             f"got {backoff_s}")
        self.url = url
        self.model_name = model_name
        self.name = name
        self.timeout_s = timeout_s
        self.max_events = max_events
        self.ping_interval_s = ping_interval_s
        self._backoff = backoff_s
        self._sink = sink
        #: The server keeps one subscription per instance id: ours is our own.
        self.instance_id = uuid.uuid4().int & ((1 << 62) - 1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._contact = threading.Event()
        self._threads: list[threading.Thread] = []
        self._zmq_context: Any = None
        self._req: Any = None
        self._stream: Any = None
        self._state: SubscriptionState = "new"
        self._incarnation: int | None = None
        self._cursor: int | None = None
        self._late = False
        self._batches = self._removed_records = self._removed_chunks = 0
        self._subscriptions = self._reconnects = self._errors = 0
        self._last_error = ""
        self._resyncs = dict.fromkeys(get_args(ResyncReason), 0)

    # -- lifecycle -------------------------------------------------------------------

    def start(self, wait_s: float | None = None) -> bool:
        """Open the transport and the subscription's threads, then wait up to ``wait_s``
        (default ``timeout_s``) for the server's first batch. Returns whether one came with
        the channel enabled; if not, the subscription goes on trying in the background, and
        its first contact resyncs the sink (``late_subscription``).

        Raises:
            LMCacheError: LMCache is not installed.
        """
        with self._lock:
            if self._threads:
                return self._incarnation is not None
            self._open()
            self._state = "connecting"
            self._threads = [
                threading.Thread(target=self._run, name=f"{self.name}-stream", daemon=True),
                threading.Thread(target=self._keepalive, name=f"{self.name}-ping",
                                 daemon=True)]
            for thread in self._threads:
                thread.start()
        wait_s = self.timeout_s if wait_s is None else wait_s
        self._contact.wait(wait_s)
        with self._lock:
            if self._incarnation is not None:
                return True
            self._late = True
        log.warning("%s: no KV events from %s within %g s yet; still trying", self.name,
                    self.url, wait_s)
        return False

    def close(self) -> None:
        """Stop following, close the stream and the transport. Idempotent."""
        self._stop.set()
        with self._lock:
            stream, self._stream = self._stream, None
            threads, self._threads = self._threads, []
            self._state = "closed"
        if stream is not None:
            stream.close()
        for thread in threads:
            thread.join(self.timeout_s + 1.0)
        req, self._req = self._req, None
        if req is not None:
            req.close()
        context, self._zmq_context = self._zmq_context, None
        if context is not None:
            context.term()

    def stats(self) -> KVEventStats:
        with self._lock:
            return KVEventStats(
                self._state, self._incarnation or 0, self._cursor or 0, self._batches,
                self._removed_records, self._removed_chunks,
                dict(self._resyncs), self._subscriptions,
                self._reconnects, self._errors, self._last_error)

    # -- the stream ------------------------------------------------------------------

    def _open(self) -> None:
        try:
            import zmq
            from lmcache.v1.multiprocess.transport.factory import RequestClientFactory
        except ImportError as exc:
            raise LMCacheError("following LMCache's KV events needs LMCache: pip install "
                               "'kvprefetch[lmcache]'") from exc
        self._zmq_context = zmq.Context()
        self._zmq_context.setsockopt(zmq.LINGER, 0)
        try:
            self._req = RequestClientFactory.create(self.url, context=self._zmq_context)
        except ValueError as exc:
            raise LMCacheError(f"{self.name}: bad LMCache request endpoint {self.url!r}: "
                               f"{exc}") from exc

    def _run(self) -> None:
        """Subscribe, follow until the stream ends, back off, subscribe again."""
        first, most = self._backoff
        pause = first
        while not self._stop.is_set():
            delivered = False
            try:
                delivered = self._follow()
            except Exception as exc:  # the server is down or answers garbage: try again
                self._count_error(f"subscribing to {self.url}: {exc}")
            if self._stop.is_set():
                return
            pause = first if delivered else min(pause * 2, most)
            with self._lock:
                if self._state == "subscribed":
                    self._state = "connecting"
            if self._stop.wait(pause):
                return

    def _follow(self) -> bool:
        """One subscription, followed until it ends; whether it delivered an enabled
        batch."""
        if not self._ping():
            raise LMCacheError(f"no answer to PING within {self.timeout_s:g} s")
        cursor = FROM_NOW if self._cursor is None else self._cursor
        stream = self._req.subscribe_kv_events(self.instance_id, self.model_name, cursor,
                                               self.max_events)
        with self._lock:
            if self._stop.is_set():
                stream.close()
                return False
            self._stream = stream
            if self._subscriptions:
                self._reconnects += 1
            self._subscriptions += 1
        got_first = threading.Event()

        def no_first_batch() -> None:
            if not got_first.is_set():
                self._count_error(f"no first batch from {self.url} within "
                                  f"{self.timeout_s:g} s")
                stream.close()

        watchdog = threading.Timer(self.timeout_s, no_first_batch)
        watchdog.daemon = True
        watchdog.start()
        delivered = False
        try:
            for batch in stream:
                got_first.set()
                watchdog.cancel()
                delivered = self._apply(batch) or delivered
        finally:
            watchdog.cancel()
            stream.close()
            with self._lock:
                if self._stream is stream:
                    self._stream = None
        if not self._stop.is_set():
            log.info("%s: the KV event stream from %s ended; subscribing again", self.name,
                     self.url)
        return delivered

    def _apply(self, batch: Any) -> bool:
        """One batch: check the log's continuity, then hand on the removals. Returns
        whether the channel is enabled."""
        resync: ResyncReason | None = None
        with self._lock:
            if self._stop.is_set():  # closing: nobody is listening any more
                return False
            self._batches += 1
            if not batch.enabled:
                if self._state != "disabled":
                    resync = "channel_disabled"
                    log.warning(
                        "%s: the LMCache server at %s publishes no KV events (started with "
                        "--kv-event-log-size 0 or --disable-observability): the scheduler "
                        "no longer learns of L1's own evictions; retrying", self.name,
                        self.url)
                self._state = "disabled"
            else:
                if self._incarnation is None:
                    if self._late:
                        resync = "late_subscription"
                elif batch.incarnation != self._incarnation:
                    resync = "server_restart"
                elif batch.lost:
                    resync = "events_lost"
                self._incarnation = batch.incarnation
                self._cursor = batch.next_cursor
                self._state = "subscribed"
            if resync is not None:
                self._resyncs[resync] += 1
            hashes = [h for record in batch.events
                      if record.kind == KIND_REMOVED and record.medium.lower() == MEDIUM_CPU
                      for h in record.block_hashes]
            self._removed_records += sum(1 for r in batch.events if r.kind == KIND_REMOVED)
            self._removed_chunks += len(hashes)
        self._contact.set()
        if resync is not None:
            log.warning("%s: resync after %s (LMCache incarnation %s, cursor %s)", self.name,
                        resync.replace("_", " "), batch.incarnation, batch.next_cursor)
            self._deliver(self._sink.resync, resync)
        if hashes:
            self._deliver(self._sink.removed, hashes)
        return bool(batch.enabled)

    def _deliver(self, call: Callable[[Any], None], arg: Any) -> None:
        try:
            call(arg)
        except Exception as exc:  # the sink's bug must not end the stream
            log.exception("%s: KV event sink failed", self.name)
            self._count_error(f"sink: {type(exc).__name__}: {exc}", warn=False)

    # -- liveness --------------------------------------------------------------------

    def _keepalive(self) -> None:
        """Ping every ``ping_interval_s``; close an open stream whose server is silent."""
        while not self._stop.wait(self.ping_interval_s):
            with self._lock:
                stream = self._stream
            if stream is not None and not self._ping():
                self._count_error(f"no answer to PING from {self.url} within "
                                  f"{self.timeout_s:g} s; subscribing again")
                stream.close()

    def _ping(self) -> bool:
        req = self._req
        if req is None:
            return False
        try:
            return bool(req.ping(self.instance_id).result(timeout=self.timeout_s))
        except Exception:  # a timeout, or a transport that is closing
            return False

    def _count_error(self, text: str, *, warn: bool = True) -> None:
        with self._lock:
            self._errors += 1
            self._last_error = text
        if warn and not self._stop.is_set():
            log.warning("%s: %s", self.name, text)


def request_url(transport: str, host: str, port: int, http_url: str) -> str:
    """The client URL of an MP server's request endpoint from its ``GET /config``
    (``mp.transport``, ``mp.host``, ``mp.port``): a wildcard bind address is reached at the
    host of its HTTP URL."""
    from urllib.parse import urlsplit

    if host in ("", "0.0.0.0", "::", "[::]"):
        host = urlsplit(http_url).hostname or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    scheme = "grpc" if transport == "grpc" else "tcp"
    return f"{scheme}://{host}:{port}"


__all__ = [
    "KVEventSink",
    "KVEventStats",
    "KVEventSubscriber",
    "ResyncReason",
    "request_url",
]
