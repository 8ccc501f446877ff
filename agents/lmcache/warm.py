"""The prefetch agent's side of a node's LMCache MP server: its HTTP API.

:class:`LMCacheWarmClient` is what an agent backend (``lmcache-mp``) calls:

- start-up: :meth:`~LMCacheWarmClient.check_compatible` compares our chunk size and hash
  algorithm with the server's ``GET /config`` (and, optionally, that an engine has
  registered the model's KV layout), so a mismatch fails loudly instead of every warm
  silently finding nothing;
- warm: :meth:`~LMCacheWarmClient.prefetch` submits ``POST /cache/prefetches`` (L2 -> L1,
  retained, not pinned) and polls ``GET /cache/prefetches/{id}`` with backoff until it
  completes, returning found/total keys and the time to last byte;
- capacity: :meth:`~LMCacheWarmClient.l1_usage` reads L1's used and total bytes from
  ``GET /status``, and :meth:`~LMCacheWarmClient.kv_events_enabled` whether the server
  publishes L1's changes (:mod:`kvprefetch.agents.lmcache.kv_events` follows them);
- eviction advice: :meth:`~LMCacheWarmClient.delete` (``DELETE /cache/objects``, L1, L2 or
  both) and :meth:`~LMCacheWarmClient.clear_l1` (``POST /cache/clear``);
- attribution: :meth:`~LMCacheWarmClient.lookup_hits` reads the server's per-model lookup
  counters from ``GET /metrics``, which split every engine lookup into tokens L1 already
  held and tokens loaded from L2 -- how to tell a warmed request from an on-demand one.

How tokens become keys: LMCache keys whole chunks of ``chunk_size`` tokens (a trailing
partial chunk is never stored, warmed or counted). Chunk ``i`` has the chained hash
``h_i = H(h_{i-1}, tokens[i*C:(i+1)*C])`` and one object per KV rank:
``ObjectKey(chunk_hash=h_i, model_name, kv_rank, object_group_id=0, cache_salt)``. A warm
of ``n`` complete chunks for world size ``w`` therefore asks for ``n * w`` keys (times the
number of object groups, 1 unless the server splits hybrid models with
``--separate-object-groups``). :func:`object_keys` computes them with LMCache's own
``TokenHasher`` for :meth:`~LMCacheWarmClient.delete`.

httpx is imported when the client is first used; the constructor does no I/O.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvprefetch.agents.lmcache.errors import (
    LMCacheConfigMismatchError,
    LMCacheError,
    LMCacheNoLayoutError,
    LMCacheRequestError,
    LMCacheTimeoutError,
    LMCacheUnavailableError,
)

if TYPE_CHECKING:
    import httpx

Tier = Literal["l1", "l2", "all"]

#: LMCache's detail text when a warm prefetch names a model no engine registered.
_NO_LAYOUT = "no layout registered"
#: Polling backoff for a pending warm prefetch: first pause, growth, cap (seconds).
POLL_FIRST_S, POLL_GROWTH, POLL_MAX_S = 0.001, 2.0, 0.05


@dataclass(frozen=True)
class ServerSettings:
    """The settings of an LMCache MP server that decide whether our keys match its own."""

    chunk_size: int
    hash_algorithm: str
    supported_transfer_mode: str
    shm_name: str
    l1_size_bytes: int
    #: The request endpoint engines connect to: ``zmq`` or ``grpc``, the bound host, port.
    transport: str = "zmq"
    host: str = ""
    port: int = 0
    #: Records of L1 changes kept for KV-event subscribers (0: the channel is off).
    kv_event_log_size: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ServerSettings:
        """Read them from the server's ``GET /config`` body."""
        try:
            mp = config["mp"]
            l1 = config["storage_manager"]["l1_manager_config"]["memory_config"]
            return cls(chunk_size=int(mp["chunk_size"]),
                       hash_algorithm=str(mp["hash_algorithm"]),
                       supported_transfer_mode=str(mp["supported_transfer_mode"]),
                       shm_name=str(mp.get("shm_name") or ""),
                       l1_size_bytes=int(l1["size_in_bytes"]),
                       transport=str(mp.get("transport") or "zmq"),
                       host=str(mp.get("host") or ""), port=int(mp.get("port") or 0),
                       kv_event_log_size=int(mp.get("kv_event_log_size") or 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise LMCacheError(f"unexpected /config body from the LMCache server: {exc!r}") \
                from exc


@dataclass(frozen=True)
class PrefetchSubmission:
    """The answer to ``POST /cache/prefetches``: ``request_id`` is ``None`` when the
    sequence has no complete chunk (LMCache answers ``noop``; there is nothing to poll)."""

    request_id: str | None
    chunks: int


@dataclass(frozen=True)
class PrefetchStatus:
    """One poll of a warm prefetch (``found_keys``/``total_keys`` once ``done``)."""

    request_id: str
    done: bool
    found_keys: int = 0
    total_keys: int = 0


@dataclass(frozen=True)
class WarmResult:
    """A finished warm prefetch of one token sequence from L2 into L1.

    ``found_keys`` counts the requested keys now resident in L1 (already there or loaded
    from L2); ``total_keys = chunks * keys_per_chunk``. ``ttlb_s`` runs from the submit to
    the poll that saw completion. ``bytes`` is ``found_keys * key_bytes`` when the caller
    gave the size of one object (the server does not report it).
    """

    request_id: str | None
    chunks: int
    found_keys: int
    total_keys: int
    ttlb_s: float
    bytes: int | None = None

    @property
    def keys_per_chunk(self) -> int:
        return self.total_keys // self.chunks if self.chunks else 0

    @property
    def found_chunks(self) -> int:
        """Chunks whose every key was found, assuming found keys fill whole chunks (true
        for one object group: all ranks of a chunk are stored and evicted together)."""
        return self.found_keys // self.keys_per_chunk if self.keys_per_chunk else 0

    @property
    def complete(self) -> bool:
        return self.found_keys == self.total_keys


@dataclass(frozen=True)
class L1Usage:
    """L1 occupancy from ``GET /status``."""

    used_bytes: int
    total_bytes: int
    object_count: int


@dataclass(frozen=True)
class DeleteResult:
    """The answer to ``DELETE /cache/objects``: ``skipped`` L1 keys were locked."""

    deleted: int
    skipped: int
    ok: bool
    error: str | None = None


@dataclass(frozen=True)
class LookupHits:
    """The server's cumulative lookup counters for one model (and salt), in tokens.

    ``l1_tokens`` were served by objects L1 already held (a warm hit); ``l2_tokens`` had
    to be loaded from L2 during the lookup (an on-demand hit). Differences of two
    snapshots attribute the lookups in between.
    """

    lookups: int = 0
    requested_tokens: int = 0
    hit_tokens: int = 0
    l1_tokens: int = 0
    l2_tokens: int = 0

    def __sub__(self, other: LookupHits) -> LookupHits:
        return LookupHits(self.lookups - other.lookups,
                          self.requested_tokens - other.requested_tokens,
                          self.hit_tokens - other.hit_tokens,
                          self.l1_tokens - other.l1_tokens, self.l2_tokens - other.l2_tokens)


_LOOKUP_METRICS = {
    "lmcache_mp_lookups_requests_total": "lookups",
    "lmcache_mp_lookup_requested_tokens_total": "requested_tokens",
    "lmcache_mp_lookup_hit_tokens_total": "hit_tokens",
    "lmcache_mp_lookup_hit_l1_tokens_total": "l1_tokens",
    "lmcache_mp_lookup_hit_l2_tokens_total": "l2_tokens",
}
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def object_keys(
    token_ids: Sequence[int],
    *,
    model_name: str,
    world_size: int = 1,
    chunk_size: int = 256,
    hash_algorithm: str = "blake3",
    cache_salt: str = "",
) -> list[dict[str, Any]]:
    """The LMCache object keys of the complete chunks of ``token_ids``, in the JSON form
    ``DELETE /cache/objects`` takes: chunk-major, one key per KV rank, object group 0.

    Computed by :mod:`kvprefetch.agents.lmcache.keys` (LMCache's own hashing where installed,
    parity-tested otherwise), so they match the server's keys exactly when ``chunk_size``
    and ``hash_algorithm`` match the server's (see
    :meth:`LMCacheWarmClient.check_compatible`).
    """
    from kvprefetch.agents.lmcache.keys import LMCacheKeySettings, chunk_hashes, kv_rank

    settings = LMCacheKeySettings(model_name=model_name, chunk_size=chunk_size,
                                  hash_algorithm=hash_algorithm, world_size=world_size,
                                  cache_salt=cache_salt)
    ranks = [kv_rank(world_size, r) for r in range(world_size)]
    return [{"chunk_hash_hex": h, "model_name": model_name, "kv_rank": rank,
             "object_group_id": 0, "cache_salt": cache_salt}
            for h in chunk_hashes(settings, token_ids) for rank in ranks]


class LMCacheWarmClient:
    """A synchronous client of one LMCache MP server's HTTP API (``http_url`` is
    ``http://host:port``; ``timeout_s`` bounds each HTTP request)."""

    def __init__(self, http_url: str, timeout_s: float = 10.0, *,
                 transport: httpx.BaseTransport | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.http_url = http_url.rstrip("/")
        self.timeout_s = timeout_s
        self._transport = transport
        self._client: httpx.Client | None = None

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> LMCacheWarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- settings --------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The server's whole ``GET /config`` body."""
        body = self._request("GET", "/config")
        if not isinstance(body, dict):
            raise LMCacheError(f"unexpected /config body from {self.http_url}: {body!r}")
        return body

    def settings(self) -> ServerSettings:
        return ServerSettings.from_config(self.config())

    def check_compatible(
        self,
        *,
        chunk_size: int | None = None,
        hash_algorithm: str | None = None,
        model_name: str | None = None,
        world_size: int | None = None,
        require_layout: bool = False,
    ) -> ServerSettings:
        """Fail at start-up if the server's keys cannot match ours.

        Compares ``chunk_size`` and ``hash_algorithm`` with ``GET /config``. With
        ``model_name``, also looks at the layouts engines registered (``GET /status``): a
        layout of that model under another world size is a mismatch; none at all raises
        :class:`LMCacheNoLayoutError` when ``require_layout`` (else it is fine: the engine
        may register later, and warm prefetches answer 503 until it does).

        Raises:
            LMCacheConfigMismatchError: naming the field, our value and the server's.
        """
        settings = self.settings()
        for field, ours, theirs in (("chunk_size", chunk_size, settings.chunk_size),
                                    ("hash_algorithm", hash_algorithm,
                                     settings.hash_algorithm)):
            if ours is not None and ours != theirs:
                raise LMCacheConfigMismatchError(
                    field, ours, theirs, where=self.http_url,
                    hint="our chunk keys would never match the server's; configure both "
                         "sides alike")
        if model_name is not None:
            self._check_layout(model_name, world_size, require_layout)
        return settings

    def registered_layouts(self) -> list[tuple[str, int]]:
        """``(model_name, world_size)`` of every KV layout an engine registered, GPU
        (``cache_context_meta``) or engine-driven (``non_cuda_context_meta``)."""
        status = self._status()
        found: set[tuple[str, int]] = set()
        for section in ("cache_context_meta", "non_cuda_context_meta"):
            entries = status.get(section) or {}
            if isinstance(entries, dict):
                for entry in entries.values():
                    if isinstance(entry, dict) and "model_name" in entry:
                        found.add((str(entry["model_name"]), int(entry.get("world_size", 1))))
        return sorted(found)

    def _check_layout(self, model_name: str, world_size: int | None,
                      require_layout: bool) -> None:
        sizes = sorted({ws for name, ws in self.registered_layouts() if name == model_name})
        if sizes and world_size is not None and world_size not in sizes:
            raise LMCacheConfigMismatchError(
                "world_size", world_size, sizes[0] if len(sizes) == 1 else sizes,
                where=self.http_url, hint=f"as registered by the engine for {model_name!r}")
        if not sizes and require_layout:
            raise LMCacheNoLayoutError(
                f"no engine has registered a KV layout for model_name={model_name!r} at "
                f"{self.http_url}", model_name=model_name, world_size=world_size or 0)

    # -- warm ------------------------------------------------------------------------

    def submit_prefetch(self, model_name: str, world_size: int, token_ids: Sequence[int],
                        cache_salt: str = "") -> PrefetchSubmission:
        """Start a warm prefetch of ``token_ids``' complete chunks from L2 into L1.

        Raises:
            LMCacheNoLayoutError: no engine on the node registered ``(model_name,
                world_size)`` (LMCache's 503).
        """
        body = self._request("POST", "/cache/prefetches", json={
            "model_name": model_name, "world_size": world_size,
            "token_ids": list(token_ids), "cache_salt": cache_salt},
            model=(model_name, world_size))
        try:
            chunks = int(body.get("chunks", 0))
            request_id = body.get("request_id")
        except (AttributeError, TypeError, ValueError) as exc:
            raise LMCacheError(f"unexpected prefetch answer from {self.http_url}: "
                               f"{body!r}") from exc
        if body.get("status") == "noop" or not chunks:
            return PrefetchSubmission(None, 0)
        return PrefetchSubmission(str(request_id), chunks)

    def poll(self, request_id: str) -> PrefetchStatus:
        """One look at a warm prefetch. LMCache forgets a job once a poll saw it complete:
        polling it again raises :class:`LMCacheRequestError` (404)."""
        body = self._request("GET", f"/cache/prefetches/{request_id}")
        if body.get("status") == "completed":
            return PrefetchStatus(request_id, True, int(body.get("found_keys", 0)),
                                  int(body.get("total_keys", 0)))
        return PrefetchStatus(request_id, False)

    def prefetch(self, model_name: str, world_size: int, token_ids: Sequence[int], *,
                 cache_salt: str = "", timeout_s: float = 30.0,
                 key_bytes: int | None = None) -> WarmResult:
        """Warm ``token_ids`` into L1 and wait for it (polling with backoff).

        Raises:
            LMCacheNoLayoutError: see :meth:`submit_prefetch`.
            LMCacheTimeoutError: not complete within ``timeout_s`` (the load goes on; the
                keys it reaches still land in L1).
        """
        started = time.perf_counter()
        submission = self.submit_prefetch(model_name, world_size, token_ids, cache_salt)
        if submission.request_id is None:
            return WarmResult(None, 0, 0, 0, time.perf_counter() - started,
                              0 if key_bytes is not None else None)
        pause = POLL_FIRST_S
        while True:
            status = self.poll(submission.request_id)
            elapsed = time.perf_counter() - started
            if status.done:
                return WarmResult(
                    submission.request_id, submission.chunks, status.found_keys,
                    status.total_keys, elapsed,
                    status.found_keys * key_bytes if key_bytes is not None else None)
            if elapsed > timeout_s:
                raise LMCacheTimeoutError(
                    f"warm prefetch {submission.request_id} of {submission.chunks} chunks at "
                    f"{self.http_url} still pending after {timeout_s:g} s",
                    operation="warm_prefetch")
            time.sleep(pause)
            pause = min(pause * POLL_GROWTH, POLL_MAX_S)

    # -- capacity and eviction -------------------------------------------------------

    def l1_usage(self) -> L1Usage:
        """L1's used and total bytes (and object count) from ``GET /status``."""
        status = self._status()
        try:
            manager = status["storage_manager"]
            used, total = manager["l1_usage"]
            objects = int((manager.get("l1_manager") or {}).get("total_object_count", 0))
            return L1Usage(int(used), int(total), objects)
        except (KeyError, TypeError, ValueError) as exc:
            raise LMCacheError(f"unexpected /status body from {self.http_url}: {exc!r}") \
                from exc

    def kv_events_enabled(self) -> bool | None:
        """Whether the server publishes its L1 changes to KV-event subscribers
        (``kv_events.enabled`` in ``GET /status``); ``None`` when its LMCache has no such
        channel."""
        section = self._status().get("kv_events")
        if not isinstance(section, dict):
            return None
        return bool(section.get("enabled"))

    def l2_write_backlog(self) -> int:
        """Keys stored into L1 whose write-through to L2 has not finished yet (pending plus
        in flight, from ``GET /status``). A store is durable in L2 once this reaches 0."""
        status = self._status()
        try:
            manager = status["storage_manager"]
            controllers = manager.get("store_controllers") or {
                "_default": manager["store_controller"]}
            return sum(int(c.get("pending_keys_count", 0)) + int(c.get("in_flight_task_count", 0))
                       for c in controllers.values())
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LMCacheError(f"unexpected /status body from {self.http_url}: {exc!r}") \
                from exc

    def delete(self, keys: Sequence[Mapping[str, Any]], tier: Tier = "l1", *,
               force: bool = False) -> DeleteResult:
        """Delete objects by key (see :func:`object_keys`) from L1, L2 or both. Locked L1
        objects are skipped unless ``force``. Idempotent: absent keys are not an error."""
        body = self._request("DELETE", "/cache/objects", json={
            "keys": [dict(k) for k in keys], "tier": tier, "force": force})
        return DeleteResult(int(body.get("deleted", 0)), int(body.get("skipped", 0)),
                            bool(body.get("ok", True)), body.get("error"))

    def clear_l1(self, *, force: bool = False) -> None:
        """Drop every unlocked object from L1 (all of them with ``force``, even ones being
        read or written: only for tests and emergencies)."""
        self._request("POST", "/cache/clear", json={"tier": "l1", "force": force})

    # -- attribution -----------------------------------------------------------------

    def lookup_hits(self, model_name: str, cache_salt: str = "") -> LookupHits:
        """The server's cumulative lookup counters for one model, from ``GET /metrics``
        (zero before its first lookup). They are updated off the request path: allow a
        moment after a lookup before reading them."""
        text = self._request("GET", "/metrics", text=True)
        values: dict[str, int] = {}
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if not match or match["name"] not in _LOOKUP_METRICS:
                continue
            labels = dict(_LABEL.findall(match["labels"] or ""))
            if labels.get("model_name") == model_name and labels.get(
                    "cache_salt", "") == cache_salt:
                field = _LOOKUP_METRICS[match["name"]]
                values[field] = values.get(field, 0) + int(float(match["value"]))
        return LookupHits(**values)

    # -- transport -------------------------------------------------------------------

    def _status(self) -> dict[str, Any]:
        body = self._request("GET", "/status")
        if not isinstance(body, dict):
            raise LMCacheError(f"unexpected /status body from {self.http_url}: {body!r}")
        return body

    def _http(self) -> httpx.Client:
        if self._client is None:
            import httpx

            self._client = httpx.Client(base_url=self.http_url, timeout=self.timeout_s,
                                        transport=self._transport)
        return self._client

    def _request(self, method: str, path: str, *, json: Any = None, text: bool = False,
                 model: tuple[str, int] | None = None) -> Any:
        import httpx

        try:
            response = self._http().request(method, path, json=json)
        except httpx.TimeoutException as exc:
            raise LMCacheTimeoutError(
                f"{method} {self.http_url}{path} timed out after {self.timeout_s:g} s",
                operation=f"{method} {path}") from exc
        except httpx.HTTPError as exc:
            raise LMCacheUnavailableError(
                f"{method} {self.http_url}{path} failed: {exc}") from exc
        if response.status_code >= 400:
            raise self._error(method, path, response, model)
        if text:
            return response.text
        try:
            return response.json()
        except ValueError as exc:
            raise LMCacheError(f"{method} {self.http_url}{path} answered non-JSON: "
                               f"{response.text[:200]!r}") from exc

    def _error(self, method: str, path: str, response: httpx.Response,
               model: tuple[str, int] | None) -> LMCacheError:
        try:
            body = response.json()
            detail = body.get("detail") or body.get("error") or body
        except (ValueError, AttributeError):
            detail = response.text[:500]
        message = f"{method} {self.http_url}{path} -> {response.status_code}: {detail}"
        if response.status_code == 503:
            if _NO_LAYOUT in str(detail):
                name, size = model or ("", 0)
                return LMCacheNoLayoutError(message, model_name=name, world_size=size)
            return LMCacheUnavailableError(message)
        if response.status_code >= 500:
            return LMCacheUnavailableError(message)
        return LMCacheRequestError(message, status_code=response.status_code)


__all__ = [
    "DeleteResult",
    "L1Usage",
    "LMCacheWarmClient",
    "LookupHits",
    "PrefetchStatus",
    "PrefetchSubmission",
    "ServerSettings",
    "WarmResult",
    "object_keys",
]
