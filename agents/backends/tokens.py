"""A session's token ids, kept in the token store next to its KV.

LMCache's warm-prefetch API (``POST /cache/prefetches``) names content by token ids, not by
chunk keys, and the scheduler keeps no token ids (10,000 sessions of 100k tokens would be
gigabytes). So whoever stores a session's KV also stores its token ids, once per turn, under
``{tenant}/{session}/tokens`` in the remote store (Valkey in front of S3): the engine
emulator does it after each request, and on a GPU node the gateway glue does it beside
vLLM (``examples/gpu_check.py``). An ``lmcache-mp`` agent reads them back to warm the
session on whichever node it was predicted to return to.

The payload is the token ids as little-endian uint32 (the object format around it carries
length and checksum). :func:`synthetic_tokens` gives deterministic token ids for traces
that carry only token counts (the demo): a session's ids at ``m`` tokens are a prefix of
its ids at ``n > m`` tokens, as in a real conversation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvprefetch.agents.stores.base import ObjectStore
from kvprefetch.controlplane.base.errors import KvPrefetchError
from kvprefetch.controlplane.base.keys import session_prefix
from kvprefetch.controlplane.base.types import SessionKey

TOKENS_NAME = "tokens"
_MAX_TOKEN = 2**32 - 1


def tokens_key(tenant: str, session_id: str) -> str:
    """Where a session's token ids live (inside its key prefix, so a session-wide delete
    covers it)."""
    return session_prefix(tenant, session_id) + TOKENS_NAME


def encode_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise KvPrefetchError(f"token ids must be a flat sequence, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN):
        raise KvPrefetchError(f"token ids must be in [0, {_MAX_TOKEN}]")
    return arr.astype("<u4").tobytes()


def decode_tokens(data: bytes | memoryview) -> list[int]:
    if len(data) % 4:
        raise KvPrefetchError(f"token payload of {len(data)} bytes is not a whole number of "
                              "uint32 token ids")
    return np.frombuffer(data, dtype="<u4").astype(np.int64).tolist()


def put_session_tokens(store: ObjectStore, tenant: str, session_id: str,
                       token_ids: Sequence[int] | np.ndarray, *,
                       ttl_s: float | None = None) -> bool:
    """Store the session's token ids (the whole context so far); True when stored."""
    [result] = store.put([(tokens_key(tenant, session_id), encode_tokens(token_ids))],
                         ttl_s=ttl_s)
    return result.ok


def get_session_tokens(store: ObjectStore, tenant: str, session_id: str) -> list[int] | None:
    """The session's stored token ids; None when the store has none (or lost them)."""
    [result] = store.get([tokens_key(tenant, session_id)])
    if not result.ok or result.data is None:
        return None
    return decode_tokens(result.data)


def synthetic_tokens(tenant: str, session_id: str, n: int, *,
                     vocab_size: int = 128_000) -> np.ndarray:
    """``n`` deterministic token ids for a session known only by its token counts."""
    if n < 0:
        raise KvPrefetchError(f"token count must be >= 0, got {n}")
    seed = int.from_bytes(hashlib.blake2b(SessionKey(tenant, session_id).wire.encode(),
                                          digest_size=8).digest(), "little")
    # One uint32 per token drawn in order, so the ids at n tokens extend those at m < n.
    raw = np.random.Generator(np.random.PCG64(seed)).integers(
        0, 2**32, size=n, dtype=np.uint64)
    return (raw % vocab_size).astype(np.int64)
