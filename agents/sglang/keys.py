"""SGLang HiCache's page hashes and our object names for them, from token ids.

SGLang (0.5.23) names each page of ``page_size`` tokens in its L3 storage by a chained
SHA-256 (``sglang.srt.mem_cache.utils.get_hash_str``, a C++ extension over OpenSSL)::

    h_0 = sha256([seed ||] page_0)        h_i = sha256(h_{i-1} || page_i)

as 64 lowercase hex characters, where a page is its token ids as little-endian uint32, or,
when any id of the page exceeds 2**32 - 1, the byte ``0xff`` followed by the ids as
little-endian uint64 (the odd length keeps the two encodings apart). A trailing partial
page is hashed like a full one. The chain of a request with an ``extra_key`` or a
``cache_salt`` starts from a namespace seed (``storage_namespace_seed``); without both it
starts from nothing (the first page is hashed alone).

SGLang hands a storage backend only the page hashes; the backend chooses object names. Ours
follow SGLang's own file backend (``HiCacheFile``): the hash, then the model (``/`` as
``-``) and, for models whose KV is sharded by tensor parallelism, the TP rank and size, so
ranks never read each other's shards; pipeline and attention-CP shards add their suffixes.
All under one prefix (``sglang/``) in our store. This module has no dependency on SGLang;
tests compare it with SGLang's functions byte for byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: The prefix of every SGLang page object in our stores.
OBJECT_PREFIX = "sglang/"
_U32_MAX = 2**32 - 1
_I64_MAX = 2**63 - 1
_NAMESPACE_TAG = b"sglang-cache-namespace-v1"


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """The hex digest a request's chain starts from (None: no namespace)."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(_NAMESPACE_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def _page_bytes(page: np.ndarray) -> bytes:
    if page.size and int(page.max()) > _U32_MAX:
        return b"\xff" + page.astype("<u8").tobytes()
    return page.astype("<u4").tobytes()


def page_hashes(
    token_ids: Sequence[int] | np.ndarray,
    page_size: int,
    *,
    prior_hash: str | None = None,
    extra_key: str | None = None,
    cache_salt: str | None = None,
) -> list[str]:
    """The hex page hashes of ``token_ids``, one per page (a partial last page included).

    ``prior_hash``: the hash of the page before ``token_ids`` (to continue a chain); when
    None, the chain starts from the request's namespace seed, as SGLang's storage does.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    ids = np.asarray(token_ids, dtype=np.int64) if len(token_ids) else np.zeros(0, np.int64)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {ids.shape}")
    if ids.size and int(ids.min()) < 0:
        raise ValueError("token ids must be non-negative")
    seed = prior_hash if prior_hash is not None else namespace_seed(extra_key, cache_salt)
    prior = bytes.fromhex(seed) if seed else b""
    if seed and len(prior) != 32:
        raise ValueError(f"a prior hash is 64 hex characters, got {seed!r}")
    out = []
    for start in range(0, ids.size, page_size):
        h = hashlib.sha256(prior)
        h.update(_page_bytes(ids[start : start + page_size]))
        prior = h.digest()
        out.append(h.hexdigest())
    return out


@dataclass(frozen=True, slots=True)
class PageKeyScheme:
    """How one SGLang rank's page objects are named (see the module docstring)."""

    model_name: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    #: MLA KV is the same on every TP rank: one object per page, shared by the ranks.
    is_mla: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1

    @classmethod
    def from_storage_config(cls, config: Any) -> PageKeyScheme:
        """From SGLang's ``HiCacheStorageConfig`` (read by attribute, not imported)."""
        return cls(model_name=config.model_name or "", tp_rank=config.tp_rank,
                   tp_size=config.tp_size, is_mla=bool(config.is_mla_model),
                   pp_rank=config.pp_rank, pp_size=config.pp_size,
                   attn_cp_rank=getattr(config, "attn_cp_rank", 0),
                   attn_cp_size=getattr(config, "attn_cp_size", 1))

    @property
    def suffix(self) -> str:
        """What ``HiCacheFile`` appends to a page hash for this rank."""
        model = "-".join(self.model_name.split("/"))
        shard = f"_{self.pp_size}_{self.pp_rank}" if self.pp_size > 1 else ""
        if self.attn_cp_size > 1:
            shard += f"_cp{self.attn_cp_rank}_{self.attn_cp_size}"
        if self.is_mla:
            return f"_{model}{shard}"
        return f"_{model}_{self.tp_rank}_{self.tp_size}{shard}"

    def object_name(self, page_hash: str) -> str:
        """Our store's key for one page hash (SGLang's storage keys are page hashes)."""
        return f"{OBJECT_PREFIX}{page_hash}{self.suffix}"

    def object_names(self, token_ids: Sequence[int] | np.ndarray, page_size: int, *,
                     extra_key: str | None = None, cache_salt: str | None = None,
                     full_pages_only: bool = True) -> list[str]:
        """The keys of the pages SGLang stores for ``token_ids``: full pages only by
        default (HiCache writes back and prefetches whole pages)."""
        n = len(token_ids)
        if full_pages_only:
            n -= n % page_size
        hashes = page_hashes(token_ids[:n], page_size, extra_key=extra_key,
                             cache_salt=cache_salt)
        return [self.object_name(h) for h in hashes]


