"""How busy a node's engine is, from vLLM's Prometheus page (``GET /metrics``).

:class:`EngineLoadProbe` reads ``vllm:num_requests_waiting`` and
``vllm:num_requests_running`` (gauges, summed over label sets: one per model or engine
process) at most once per ``interval_s`` and answers from its last read in between, so
that a caller may ask on every order. An engine that does not answer, or whose page lacks
both gauges (an engine without vLLM's metrics), reads as idle: warming then goes on as if
nothing yielded, and the probe tries again only after :data:`FAILED_READ_BACKOFF_S`.

Who calls it: the prefetch agent's warm gate (:mod:`kvprefetch.agents.warm_gate`), on each
prefetch order and while it holds deferred ones. Thread-safe; one read at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: After a failed read, the engine is taken as idle for this long (wall seconds) before
#: the next try: an engine without the page costs one attempt per this, not per order.
FAILED_READ_BACKOFF_S = 5.0
#: The longest one read of the page may take (wall seconds).
READ_TIMEOUT_S = 0.5
_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Requests the engine holds now: ``waiting`` (queued, not yet scheduled) and
    ``running`` (being prefilled or decoded). ``known``: the engine answered with them."""

    waiting: int = 0
    running: int = 0
    known: bool = False


def parse_engine_load(text: str) -> EngineLoad:
    """:class:`EngineLoad` from vLLM's Prometheus text; ``known`` is False when the page
    names neither gauge."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = {_WAITING: 0.0, _RUNNING: 0.0}
    seen = False
    for family in text_string_to_metric_families(text):
        if family.name in sums:
            seen = True
            sums[family.name] += sum(s.value for s in family.samples)
    return EngineLoad(int(sums[_WAITING]), int(sums[_RUNNING]), seen)


def metrics_url_of(engine_url: str) -> str:
    """The Prometheus page of an engine whose OpenAI base URL is ``engine_url``
    (``http://host:8000`` or ``http://host:8000/v1``: ``http://host:8000/metrics``);
    "" for "" (no engine named)."""
    base = engine_url.strip().rstrip("/")
    if not base:
        return ""
    if base.endswith("/v1"):
        base = base[:-3]
    return f"{base}/metrics"


class EngineLoadProbe:
    """See the module docstring. ``fetch`` returns the page's text for a URL (the default
    is an HTTP GET); ``clock`` gives wall seconds (monotonic)."""

    def __init__(self, url: str, interval_s: float, *,
                 fetch: Callable[[str], str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.interval_s = interval_s
        self._fetch = fetch or _http_get
        self._clock = clock
        self._lock = threading.Lock()
        self._last = EngineLoad()
        self._next_read_s = float("-inf")
        self.reads = 0
        self.failed_reads = 0

    def load(self) -> EngineLoad:
        """The engine's load as of the last read, reading again first when that read is
        older than ``interval_s``."""
        with self._lock:
            now = self._clock()
            if now < self._next_read_s:
                return self._last
            self.reads += 1
            try:
                load = parse_engine_load(self._fetch(self.url))
            except Exception as exc:  # an engine without the page reads as idle
                load = EngineLoad()
                self.failed_reads += 1
                if self.failed_reads == 1:
                    log.warning("engine load at %s not readable (%s): warming does not "
                                "yield to the engine until it is", self.url, exc)
            delay = self.interval_s if load.known else max(self.interval_s,
                                                           FAILED_READ_BACKOFF_S)
            self._next_read_s = self._clock() + delay
            self._last = load
            return load


def _http_get(url: str) -> str:
    import httpx

    response = httpx.get(url, timeout=READ_TIMEOUT_S)
    response.raise_for_status()
    return response.text
