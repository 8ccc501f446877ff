"""An engine on CPU as a real client of the node's LMCache multiprocess server.

vLLM talks to ``lmcache server`` over ZMQ and hands it CUDA IPC handles to its paged KV
("lmcache-driven" transfer). A process without a GPU uses the server's *engine-driven*
context mode instead, which is what :class:`LMCacheMPClient` speaks:

1. ``REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT`` declares the KV layout of one worker
   (``instance_id``, model name, world size, layers, hidden size = kv heads x head size,
   dtype, tokens per chunk). The server records it in its layout registry, which is what
   later lets ``POST /cache/prefetches`` size a warm prefetch for this model (until then it
   answers 503), and answers with the name and size of its L1 shared-memory pool when it
   was started with ``--shm-name`` (else the data travels pickled inside the ZMQ messages).
2. A store is ``PREPARE_STORE`` (the server reserves one L1 object per chunk not yet
   cached and returns their offsets in the shared pool) then ``COMMIT_STORE`` (we have
   copied each chunk into its slot; the server publishes the objects and its store
   controller writes them through to L2).
3. A lookup is ``LOOKUP`` (the server hashes the tokens, finds the longest cached prefix in
   L1 and L2, loads the L2 part into L1 and read-locks it) then ``QUERY_PREFETCH_STATUS``
   until it answers the number of hit chunks; ``FREE_LOOKUP_LOCKS`` / ``END_SESSION``
   release the locks and the session when nothing is retrieved.
4. A retrieve is a lookup, then ``PREPARE_RETRIEVE`` (offsets of the locked objects) and
   ``COMMIT_RETRIEVE`` once we have copied them out (releases the read locks).

The wire messages, the key type and the shared-memory mapping are LMCache's own
(``RequestClientFactory``, ``IPCCacheServerKey``, ``create_engine_driven_context``); this
module adds a layout record, chunk bookkeeping, timing and typed errors. LMCache, torch and
ZMQ are imported in :meth:`LMCacheMPClient.connect`, never at import time; the constructor
does no I/O.

One client is one worker (rank) of one model. Calls are serialised by a lock, so a client
may be shared between threads, but one call runs at a time.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvprefetch.agents.lmcache.errors import (
    LMCacheConfigMismatchError,
    LMCacheError,
    LMCacheTimeoutError,
    LMCacheTransferError,
    LMCacheUnavailableError,
)
from kvprefetch.agents.lmcache.mp_kv import (
    DTYPE_BYTES,
    KVLayout,
    chunk_source,
    concat_tokens,
    copy_into,
    random_kv,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Transfer modes under which the server accepts engine-driven registrations.
ENGINE_DRIVEN_MODES = ("engine_driven", "auto")


@dataclass(frozen=True)
class StoreResult:
    """One store: ``total_chunks`` complete chunks offered, ``new_chunks`` of them written
    (the rest were already cached; ``None`` on the pickle transport, which does not say)."""

    total_chunks: int
    new_chunks: int | None
    bytes: int
    elapsed_s: float


@dataclass(frozen=True)
class LookupResult:
    """One lookup: the longest cached prefix, in chunks, found in L1 and L2 together (the
    L2 part has been loaded into L1 by the lookup itself)."""

    hit_chunks: int
    total_chunks: int
    chunk_size: int
    elapsed_s: float

    @property
    def hit_tokens(self) -> int:
        return self.hit_chunks * self.chunk_size

    @property
    def full_hit(self) -> bool:
        return self.total_chunks > 0 and self.hit_chunks == self.total_chunks


@dataclass(frozen=True)
class RetrieveResult:
    """One retrieve: the KV of the cached prefix (``None`` on a full miss)."""

    lookup: LookupResult
    kv: torch.Tensor | None
    elapsed_s: float

    @property
    def hit_tokens(self) -> int:
        return self.lookup.hit_tokens

    def kv_bytes(self) -> bytes:
        """The retrieved KV as raw bytes (empty on a miss)."""
        if self.kv is None:
            return b""
        import torch

        return bytes(self.kv.contiguous().view(torch.uint8).numpy().tobytes())


class LMCacheMPClient:
    """One emulated engine worker, registered with the node's LMCache MP server in
    engine-driven mode.

    ``chunk_size`` is what the caller expects; :meth:`connect` compares it with the
    server's and raises :class:`LMCacheConfigMismatchError` on a difference. With
    ``http_url`` it also checks the server's ``supported_transfer_mode`` first (a server in
    ``lmcache_driven`` mode never answers the registration).
    """

    def __init__(
        self,
        host: str,
        port: int,
        layout: KVLayout | None = None,
        *,
        chunk_size: int | None = None,
        http_url: str | None = None,
        timeout_s: float = 10.0,
        instance_id: int | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.url = f"tcp://{host}:{port}"
        self.layout = layout or KVLayout()
        self.http_url = http_url.rstrip("/") if http_url else None
        self.timeout_s = timeout_s
        self.instance_id = instance_id if instance_id is not None else (
            uuid.uuid4().int & ((1 << 62) - 1))
        self._expected_chunk_size = chunk_size
        self._chunk_size = 0
        self._lock = threading.RLock()
        self._zmq_context: Any = None
        self._req: Any = None
        self._ctx: Any = None
        self._transport = ""

    # -- lifecycle -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._ctx is not None

    @property
    def chunk_size(self) -> int:
        """The server's chunk size (tokens), known after :meth:`connect`."""
        self._require()
        return self._chunk_size

    @property
    def transport(self) -> str:
        """``"shm"`` (L1 shared-memory pool mapped here) or ``"pickle"`` (data inside the
        ZMQ messages), known after :meth:`connect`."""
        self._require()
        return self._transport

    def connect(self) -> LMCacheMPClient:
        """Open the request channel, check settings, register the layout. Idempotent."""
        with self._lock:
            if self._ctx is not None:
                return self
            try:
                self._open()
                self._chunk_size = self._query_chunk_size()
                self._check_settings()
                self._register()
            except BaseException:
                self._teardown()
                raise
            log.info("registered engine-driven worker %d (%s rank %d/%d) with %s, %s, "
                     "chunk_size=%d", self.instance_id, self.layout.model_name,
                     self.layout.rank, self.layout.world_size, self.url, self._transport,
                     self._chunk_size)
            return self

    def close(self) -> None:
        """Unregister the layout (best effort) and release ZMQ and shared memory."""
        with self._lock:
            if self._req is not None and self._ctx is not None:
                try:
                    self._req.unregister_kv_cache_engine_driven_context(
                        self.instance_id).result(timeout=min(self.timeout_s, 5.0))
                except Exception as exc:  # server gone: nothing left to unregister
                    log.warning("unregistering worker %d from %s failed: %s",
                                self.instance_id, self.url, exc)
            self._teardown()

    def __enter__(self) -> LMCacheMPClient:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ping(self) -> bool:
        """Tell the server this worker is alive. Once a worker has pinged, the server
        reaps its registration after ``--worker-reap-timeout-seconds`` (120 s) of silence,
        so a caller that pings must keep pinging (every ~30 s)."""
        with self._lock:
            req = self._require()
            return bool(self._result(req.ping(self.instance_id), "ping"))

    # -- data path -------------------------------------------------------------------

    def store(self, token_ids: Sequence[int], kv: Any, *, cache_salt: str = "") -> StoreResult:
        """Store the KV of the complete chunks of ``token_ids``.

        ``kv`` is a tensor or array of shape :meth:`KVLayout.kv_shape` covering either all
        of ``token_ids`` or just its chunk-aligned prefix, or raw bytes of such an array in
        the layout's dtype; or a callable ``kv(chunk_index)`` returning one chunk's KV, so
        that a long context need not be materialised when only its last chunks are new (on
        the shared-memory transport it is called for the chunks the server lacks only; if
        it raises, the reserved objects stay locked on the server until its write TTL).
        The trailing partial chunk is not stored (LMCache keys whole chunks only). Chunks
        already cached are skipped by the server.
        """
        with self._lock:
            self._require()
            tokens = list(token_ids)
            aligned = self._aligned(len(tokens))
            total = aligned // self._chunk_size
            chunk_of = chunk_source(self.layout, self._chunk_size, kv, len(tokens), aligned)
            if total == 0:
                return StoreResult(0, 0, 0, 0.0)
            started = time.perf_counter()
            key = self._key(tokens[:aligned], f"kvp-store-{uuid.uuid4().hex}",
                            worker=True, cache_salt=cache_salt)
            try:
                new_chunks = self._store_chunks(key, chunk_of)
            finally:
                self._end_session(key.request_id)
            written = total if new_chunks is None else new_chunks
            return StoreResult(total, new_chunks, written * self.layout.chunk_bytes(
                self._chunk_size), time.perf_counter() - started)

    def lookup(self, token_ids: Sequence[int], *, cache_salt: str = "") -> LookupResult:
        """How many leading chunks of ``token_ids`` the node can serve (L1 + L2).

        Like an engine's scheduler-side lookup, this loads the L2 part of the hit into L1
        and read-locks it; since nothing is retrieved here, the locks and the session are
        released before returning."""
        with self._lock:
            self._require()
            tokens = list(token_ids)
            key = self._key(tokens[: self._aligned(len(tokens))],
                            f"kvp-lookup-{uuid.uuid4().hex}", worker=False,
                            cache_salt=cache_salt)
            try:
                result = self._lookup(key)
                if result.hit_chunks:
                    self._result(self._req.free_lookup_locks(key, self.layout.world_size),
                                 "free_lookup_locks")
            finally:
                self._end_session(key.request_id)
            return result

    def retrieve(self, token_ids: Sequence[int], *, cache_salt: str = "") -> RetrieveResult:
        """Look up ``token_ids`` and copy out the KV of the cached prefix.

        Returns a tensor of shape ``kv_shape(hit_tokens)`` (owned by the caller, not a view
        of the server's memory), or ``None`` when not even the first chunk is cached."""
        with self._lock:
            self._require()
            tokens = list(token_ids)
            started = time.perf_counter()
            request_id = f"kvp-retrieve-{uuid.uuid4().hex}"
            lookup_key = self._key(tokens[: self._aligned(len(tokens))], request_id,
                                   worker=False, cache_salt=cache_salt)
            try:
                found = self._lookup(lookup_key)
                if not found.hit_chunks:
                    return RetrieveResult(found, None, time.perf_counter() - started)
                key = self._key(tokens[: found.hit_tokens], request_id, worker=True,
                                cache_salt=cache_salt)
                kv = self._retrieve_chunks(key, found.hit_chunks)
                self._release_other_ranks(tokens[: found.hit_tokens], request_id, cache_salt)
            finally:
                self._end_session(request_id)
            return RetrieveResult(found, kv, time.perf_counter() - started)

    def make_kv(self, num_tokens: int, *, seed: int = 0) -> torch.Tensor:
        """Random KV of this layout for ``num_tokens`` (deterministic per ``seed``)."""
        return random_kv(self.layout, num_tokens, seed=seed)

    # -- internals -------------------------------------------------------------------

    def _require(self) -> Any:
        if self._req is None or self._ctx is None:
            raise LMCacheError(f"LMCacheMPClient for {self.url} is not connected; call "
                               "connect() (or use it as a context manager) first")
        return self._req

    def _open(self) -> None:
        try:
            import zmq
            from lmcache.v1.multiprocess.transport.factory import RequestClientFactory
        except ImportError as exc:
            raise LMCacheError("the lmcache-mp client needs LMCache: pip install "
                               "'kvprefetch[lmcache]'") from exc
        self._zmq_context = zmq.Context()
        self._zmq_context.setsockopt(zmq.LINGER, 0)
        self._req = RequestClientFactory.create(self.url, context=self._zmq_context)

    def _teardown(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            try:
                ctx.close()
            except BufferError as exc:  # a view of the shared pool is still alive
                log.warning("closing the LMCache shared-memory mapping: %s", exc)
        req, self._req = self._req, None
        if req is not None:
            req.close()
        zmq_context, self._zmq_context = self._zmq_context, None
        if zmq_context is not None:
            zmq_context.term()
        self._transport = ""

    def _result(self, future: Any, operation: str) -> Any:
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError as exc:
            raise LMCacheTimeoutError(
                f"LMCache server at {self.url} did not answer {operation.upper()} within "
                f"{self.timeout_s:g} s (it sends no reply when the handler fails: see its "
                "log)", operation=operation) from exc

    def _query_chunk_size(self) -> int:
        try:
            chunk_size = int(self._result(self._req.get_chunk_size(), "get_chunk_size"))
        except LMCacheTimeoutError as exc:
            raise LMCacheUnavailableError(
                f"no LMCache server answers at {self.url} (GET_CHUNK_SIZE timed out after "
                f"{self.timeout_s:g} s)") from exc
        if self._expected_chunk_size is not None and chunk_size != self._expected_chunk_size:
            raise LMCacheConfigMismatchError(
                "chunk_size", self._expected_chunk_size, chunk_size, where=self.url,
                hint="stored chunks and their keys would not line up")
        if chunk_size % self.layout.block_size:
            raise LMCacheConfigMismatchError(
                "chunk_size", f"a multiple of block_size={self.layout.block_size}",
                chunk_size, where=self.url)
        return chunk_size

    def _check_settings(self) -> None:
        if self.http_url is None:
            return
        import httpx

        try:
            response = httpx.get(f"{self.http_url}/config", timeout=self.timeout_s)
            response.raise_for_status()
            mode = response.json()["mp"]["supported_transfer_mode"]
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            raise LMCacheUnavailableError(
                f"cannot read {self.http_url}/config: {exc}") from exc
        if mode not in ENGINE_DRIVEN_MODES:
            raise LMCacheConfigMismatchError(
                "supported_transfer_mode", " or ".join(ENGINE_DRIVEN_MODES), mode,
                where=self.http_url, hint="a CPU engine registers through the engine-driven "
                "path: start the server with --supported-transfer-mode auto")

    def _register(self) -> None:
        import torch
        from lmcache.v1.distributed.api import MemoryLayoutDesc
        from lmcache.v1.multiprocess.custom_types import (
            RegisterEngineDrivenContextPayload,
            RegisterEngineDrivenContextResponse,
        )
        from lmcache.v1.multiprocess.transfer_context.base import (
            EngineDrivenContextMetadata,
            create_engine_driven_context,
        )

        layout = self.layout
        payload = RegisterEngineDrivenContextPayload(
            instance_id=self.instance_id, model_name=layout.model_name,
            world_size=layout.world_size, block_size=layout.block_size,
            num_layers=layout.num_layers, hidden_dim_size=layout.hidden_size,
            dtype_str=layout.dtype, use_mla=layout.use_mla,
            num_physical_slots=self._chunk_size)
        try:
            response = self._result(self._req.register_kv_cache_engine_driven_context(payload),
                                    "register_kv_cache_engine_driven_context")
        except LMCacheTimeoutError as exc:
            raise LMCacheTimeoutError(
                f"{exc}; a server started with --supported-transfer-mode lmcache_driven has "
                "no handler for it (use engine_driven or auto)",
                operation=exc.operation) from exc
        shm_name, pool_size = "", 0
        if isinstance(response, RegisterEngineDrivenContextResponse):
            shm_name, pool_size = response.shm_name, response.pool_size
        metadata = EngineDrivenContextMetadata(
            layout_desc=MemoryLayoutDesc(shapes=[torch.Size(layout.kv_shape(self._chunk_size))],
                                         dtypes=[getattr(torch, layout.dtype)]),
            block_size=layout.block_size, use_mla=layout.use_mla)
        self._ctx = create_engine_driven_context(metadata, self._req, self.timeout_s,
                                                 shm_name=shm_name, pool_size=pool_size)
        self._transport = "shm" if type(self._ctx).__name__.endswith("Shm") else "pickle"

    def _aligned(self, num_tokens: int) -> int:
        return num_tokens - num_tokens % self._chunk_size

    def _key(self, tokens: list[int], request_id: str, *, worker: bool,
             cache_salt: str, rank: int | None = None) -> Any:
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        worker_id = (self.layout.rank if rank is None else rank) if worker else None
        try:
            return IPCCacheServerKey(
                model_name=self.layout.model_name, world_size=self.layout.world_size,
                worker_id=worker_id, token_ids=tuple(tokens),
                start=0, end=len(tokens), request_id=request_id, cache_salt=cache_salt,
                num_kv_readers=1)
        except ValueError as exc:  # a cache_salt LMCache refuses
            raise LMCacheError(str(exc)) from exc

    def _store_chunks(self, key: Any, chunk_of: Callable[[int], torch.Tensor]) -> int | None:
        total = key.end // self._chunk_size
        try:
            prepared = self._ctx.prepare_store(key, self.instance_id)
        except TimeoutError as exc:
            raise LMCacheTimeoutError(f"PREPARE_STORE to {self.url} timed out: {exc}",
                                      operation="prepare_store") from exc
        if prepared is None:  # pickle: send every chunk, the server keeps the new ones
            chunks = [chunk_of(i).contiguous() for i in range(total)]
            new_chunks = None
        else:
            slots, indices = prepared
            if not indices:  # every chunk already cached
                return 0
            for slot, index in zip(slots, indices, strict=True):
                copy_into(slot, chunk_of(index))
            del slots
            chunks, new_chunks = [], len(indices)
        if not self._ctx.commit_store(key, self.instance_id, chunks):
            raise LMCacheTransferError(
                f"COMMIT_STORE of {total} chunks to {self.url} failed or timed out "
                "(see the server log)")
        return new_chunks

    def _lookup(self, key: Any) -> LookupResult:
        total = key.end // self._chunk_size
        started = time.perf_counter()
        if total == 0:
            return LookupResult(0, 0, self._chunk_size, 0.0)
        self._result(self._req.lookup(key, self.layout.world_size), "lookup")
        deadline = started + self.timeout_s
        pause = 0.0005
        while True:
            hits = self._result(self._req.query_prefetch_status(key.request_id),
                                "query_prefetch_status")
            if hits is not None:
                return LookupResult(int(hits), total, self._chunk_size,
                                    time.perf_counter() - started)
            if time.perf_counter() > deadline:
                raise LMCacheTimeoutError(
                    f"lookup of {total} chunks at {self.url} did not finish within "
                    f"{self.timeout_s:g} s", operation="query_prefetch_status")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _retrieve_chunks(self, key: Any, hit_chunks: int) -> torch.Tensor:
        slots = self._ctx.prepare_retrieve(key, self.instance_id)
        try:
            if not slots or len(slots) != hit_chunks:
                raise LMCacheTransferError(
                    f"PREPARE_RETRIEVE at {self.url} returned {len(slots or [])} of the "
                    f"{hit_chunks} chunks its lookup had locked")
            # Copy out of the shared pool before COMMIT_RETRIEVE lets the server reuse it.
            return concat_tokens(list(slots))
        finally:
            slots = None  # drop the views of the shared pool
            self._ctx.commit_retrieve(key, self.instance_id)

    def _release_other_ranks(self, tokens: list[int], request_id: str, cache_salt: str) -> None:
        """A lookup read-locks the hit of every rank; our retrieve released our rank's."""
        for rank in range(self.layout.world_size):
            if rank != self.layout.rank:
                key = self._key(tokens, request_id, worker=True, cache_salt=cache_salt,
                                rank=rank)
                self._result(self._req.free_lookup_locks(key, self.layout.world_size),
                             "free_lookup_locks")

    def _end_session(self, request_id: str) -> None:
        try:
            self._result(self._req.end_session(request_id), "end_session")
        except LMCacheTimeoutError as exc:  # sessions also expire on the server
            log.warning("%s", exc)


__all__ = [
    "DTYPE_BYTES",
    "KVLayout",
    "LMCacheMPClient",
    "LookupResult",
    "RetrieveResult",
    "StoreResult",
]
