"""The engine emulator's KV path through a real LMCache MP server (``backend: lmcache-mp``).

In this mode the emulated engine is what vLLM's ``LMCacheMPConnector`` is on a GPU node: a
client of the node's ``lmcache server``, here in its engine-driven (CPU) context mode
(:class:`~kvprefetch.agents.lmcache.mp_client.LMCacheMPClient`). Before prefill it retrieves the
session's cached prefix (LMCache's lookup loads from L2 whatever L1 lacks: LMCache's own
on-demand path, which a warm prefetch makes unnecessary); after the response it stores the
context's whole chunks (LMCache writes them through to L2, our adapter) and writes the
session's token ids to the remote store, where the node's agent reads them to warm the
session wherever it returns (:mod:`kvprefetch.agents.backends.tokens`).

Token ids: the traces carry token counts only, so a session's ids are
:func:`~kvprefetch.agents.backends.tokens.synthetic_tokens` (a turn's ids extend the previous
turn's). The KV of token ``t`` holds ``t mod 127`` in every element, so a retrieve checks that it
got the right session's KV back.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.backends.tokens import put_session_tokens, synthetic_tokens
from kvprefetch.agents.lmcache.errors import LMCacheError
from kvprefetch.agents.lmcache.mp_client import KVLayout, LMCacheMPClient
from kvprefetch.agents.stores.base import ObjectStore
from kvprefetch.agents.stores.errors import StoreError
from kvprefetch.controlplane.base.keys import tenant_cache_salt

log = logging.getLogger(__name__)

#: KV elements of token t hold t mod this (exact in float16).
_MARK = 127


class LMCacheEngineConfig(BaseModel):
    """The node's LMCache MP server, as its engine sees it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(gt=0, lt=65536)
    http_url: str = Field(min_length=1)
    model_name: str = Field("kvp-emulated", min_length=1)
    chunk_size: int = Field(256, gt=0)
    #: Real bytes of KV per token (the modelled size times kv_scale); rounded to the layout.
    token_bytes: int = Field(128, ge=4)
    timeout_s: float = Field(30.0, gt=0)
    #: The base of the tenants' cache salts, as the agents' ``lmcache.cache_salt``: a
    #: session's KV is stored and read under its tenant's salt, as vLLM does with the
    #: ``cache_salt`` the gateway puts in each request.
    cache_salt: str = ""

    def layout(self) -> KVLayout:
        """One layer, one KV head, float16: K and V planes of ``token_bytes / 4`` each."""
        return KVLayout(model_name=self.model_name, num_layers=1, num_kv_heads=1,
                        head_size=max(1, self.token_bytes // 4), dtype="float16",
                        block_size=self.chunk_size)


class LMCacheEngineKV:
    """Reads and writes one node's KV through its LMCache server (thread-safe; LMCache
    calls are serialised by the client)."""

    def __init__(self, config: LMCacheEngineConfig, store: ObjectStore | None) -> None:
        self.config = config
        self._store = store
        self._client = LMCacheMPClient(config.host, config.port, config.layout(),
                                       chunk_size=config.chunk_size,
                                       http_url=config.http_url, timeout_s=config.timeout_s)
        self._lock = threading.Lock()

    def start(self) -> LMCacheEngineKV:
        self._client.connect()
        return self

    def close(self) -> None:
        self._client.close()

    def read(self, tenant: str, session_id: str, stored: int, reuse: int
             ) -> tuple[int, int, float]:
        """Retrieve the cached prefix of the session's first ``reuse`` tokens: (tokens,
        bytes, seconds the GPU waited for them). The wait is the lookup's, which includes
        LMCache loading from L2 what L1 lacks; the copy out of L1 that follows stands for
        the host-to-GPU copy, which the cost model times."""
        tokens = synthetic_tokens(tenant, session_id, min(stored, reuse))
        try:
            got = self._client.retrieve(
                tokens.tolist(), cache_salt=tenant_cache_salt(tenant, self.config.cache_salt))
        except LMCacheError as exc:
            log.warning("lmcache retrieve of %s/%s failed: %s", tenant, session_id, exc)
            return 0, 0, 0.0
        if got.kv is None:
            return 0, 0, got.lookup.elapsed_s
        self._check(got.kv, tokens[: got.hit_tokens], f"{tenant}/{session_id}")
        nbytes = got.hit_tokens * self._client.layout.token_bytes
        return min(got.hit_tokens, reuse), nbytes, got.lookup.elapsed_s

    def write(self, tenant: str, session_id: str, ctx: int) -> int:
        """Store the context's whole chunks (LMCache skips those it has) and its token ids;
        returns the bytes LMCache wrote."""
        import torch

        tokens = synthetic_tokens(tenant, session_id, ctx)
        layout = self._client.layout
        size = self.config.chunk_size
        marks = torch.from_numpy(tokens % _MARK).to(torch.float16)

        def chunk_kv(i: int) -> Any:
            mark = marks[i * size:(i + 1) * size]
            return mark.view(1, 1, size, 1).expand(layout.kv_shape(size)).contiguous()

        try:
            result = self._client.store(
                tokens.tolist(), chunk_kv,
                cache_salt=tenant_cache_salt(tenant, self.config.cache_salt))
        except LMCacheError as exc:
            log.warning("lmcache store of %s/%s failed: %s", tenant, session_id, exc)
            return 0
        if self._store is not None:
            try:
                put_session_tokens(self._store, tenant, session_id, tokens)
            except StoreError as exc:
                log.warning("token ids of %s/%s not stored: %s", tenant, session_id, exc)
        return result.bytes

    @staticmethod
    def _check(kv: Any, tokens: Any, what: str) -> None:
        import torch

        # kv: [2, layers, tokens, hidden]; every element of token t is t mod _MARK.
        want = torch.from_numpy(tokens % _MARK).to(torch.float16)
        if not torch.equal(kv[0, 0, :, 0], want):
            raise LMCacheError(f"LMCache returned KV that is not {what}'s")
