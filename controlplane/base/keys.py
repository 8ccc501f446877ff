"""Chunk keys of a session's KV in the token store: namespaced by tenant, one per chunk.

A session's context of ``n`` tokens is cut into chunks of ``chunk_tokens`` (LMCache's
default is 256). Two ways to name them:

* by position (the gateway only knows token counts): ``{tenant}/{session}/{i}`` for a full
  chunk and ``{tenant}/{session}/{i}.{k}`` for a last, partial chunk of ``k`` tokens (the
  partial chunk of the next turn is a different object, so a stale one is never served);
* by content (the gateway sends token ids or precomputed chunk hashes, as LMCache keys its
  chunks): ``{tenant}/h/{hash}``. :func:`chunk_hashes` computes chained hashes from token
  ids, ``h_i = sha256(h_{i-1} || tokens of chunk i)``, so equal prefixes share keys.

The engines' own keys (LMCache's object keys, SGLang's page hashes) are named from token
ids alone; what keeps tenants apart there is the request's *cache salt*, which
:func:`tenant_cache_salt` gives per tenant.

Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvprefetch.controlplane.base.errors import KvPrefetchError
from kvprefetch.controlplane.base.types import DEFAULT_TENANT

DEFAULT_CHUNK_TOKENS = 256
_SEP = "/"


def _check_part(value: str, what: str) -> None:
    if not value or _SEP in value or value.strip() != value or len(value) > 256:
        raise KvPrefetchError(f"{what} {value!r} must be 1-256 characters without '/' or "
                              "surrounding spaces")


def _escape(session_id: str) -> str:
    """Session ids may contain '/' (sub-agents): escaped so that one session's key prefix
    never covers another's."""
    return session_id.replace("%", "%25").replace(_SEP, "%2F")


def session_prefix(tenant: str, session_id: str) -> str:
    """The prefix of every position-named key of the session."""
    _check_part(tenant, "tenant")
    if not session_id or len(session_id) > 256:
        raise KvPrefetchError(f"session id {session_id!r} must be 1-256 characters")
    return f"{tenant}{_SEP}{_escape(session_id)}{_SEP}"


def parse_session_prefix(prefix: str) -> tuple[str, str]:
    """(tenant, session id) of a :func:`session_prefix`."""
    tenant, sep, rest = prefix.partition(_SEP)
    if not sep or not rest.endswith(_SEP) or _SEP in rest[:-1]:
        raise KvPrefetchError(f"{prefix!r} is not a session key prefix")
    return tenant, rest[:-1].replace("%2F", _SEP).replace("%25", "%")


def chunk_count(tokens: int, chunk_tokens: int) -> int:
    return -(-max(0, tokens) // chunk_tokens)


def chunk_sizes(tokens: int, chunk_tokens: int) -> list[int]:
    """Tokens in each chunk of a context of ``tokens`` tokens."""
    full, rest = divmod(max(0, tokens), chunk_tokens)
    return [chunk_tokens] * full + ([rest] if rest else [])


def position_keys(tenant: str, session_id: str, tokens: int, chunk_tokens: int) -> list[str]:
    """Keys of the first ``tokens`` tokens of a session named by position."""
    base = session_prefix(tenant, session_id)
    full, rest = divmod(max(0, tokens), chunk_tokens)
    out = [f"{base}{i}" for i in range(full)]
    if rest:
        out.append(f"{base}{full}.{rest}")
    return out


def position_key_session(key: str) -> tuple[str, str] | None:
    """(tenant, session id) of a chunk key named by position (:func:`position_keys`); None
    for a key named by content (its session is not in its name) or not a chunk key."""
    prefix, sep, chunk = key.rpartition(_SEP)
    index, _, partial = chunk.partition(".")
    if not sep or not index.isdigit() or (partial and not partial.isdigit()) or len(chunk) > 24:
        return None
    try:
        return parse_session_prefix(prefix + _SEP)
    except KvPrefetchError:
        return None


def hash_keys(tenant: str, hashes: Sequence[str]) -> list[str]:
    """Keys of chunks named by content hash."""
    _check_part(tenant, "tenant")
    return [f"{tenant}{_SEP}h{_SEP}{h}" for h in hashes]


def chunk_hashes(token_ids: Sequence[int], chunk_tokens: int, *, seed: bytes = b"") -> list[str]:
    """Chained sha256 hashes (hex, 32 characters) of the chunks of ``token_ids``."""
    prev = hashlib.sha256(b"kvprefetch" + seed).digest()
    out = []
    for start in range(0, len(token_ids), chunk_tokens):
        chunk = token_ids[start:start + chunk_tokens]
        try:
            packed = struct.pack(f"<{len(chunk)}q", *chunk)
        except struct.error as exc:
            raise KvPrefetchError(f"token ids must be 64-bit integers: {exc}") from exc
        prev = hashlib.sha256(prev + packed).digest()
        out.append(prev.hex()[:32])
    return out


def session_keys(tenant: str, session_id: str, tokens: int, chunk_tokens: int,
                 hashes: Sequence[str] | None = None) -> list[str]:
    """The keys of the first ``tokens`` tokens: by content where hashes are known (as many
    chunks as there are hashes), by position otherwise."""
    if hashes:
        return hash_keys(tenant, hashes[: chunk_count(tokens, chunk_tokens)])
    return position_keys(tenant, session_id, tokens, chunk_tokens)


def payload(key: str, nbytes: int) -> bytes:
    """Deterministic stand-in KV bytes for ``key`` (a reader can check it got this key's)."""
    seed = hashlib.blake2b(key.encode(), digest_size=16).digest()
    reps, rest = divmod(nbytes, len(seed))
    return seed * reps + seed[:rest]


def tenant_cache_salt(tenant: str, base_salt: str = "") -> str:
    """The cache salt of ``tenant``'s requests and KV keys in the engines: vLLM's and
    SGLang's per-request ``cache_salt``, which LMCache's multiprocess keys carry
    (``ObjectKey.cache_salt``) and SGLang's page hashes start from, so two tenants' equal
    prefixes name different objects and neither can hit the other's KV.

    The default tenant keeps ``base_salt`` (a node's configured salt, ``""`` for none):
    its keys are exactly those of before. Any other tenant's salt is
    ``sha256(base_salt + NUL + tenant)`` in hex, the way LMCache's SGLang connector folds
    a namespace into a salt (``build_cache_salt``): 64 characters that LMCache's salt
    rule accepts (no ``@``, ``/``, ``\\``, NUL; tenant names may hold ``@``). A secret
    ``base_salt`` makes the salts unguessable; without one a caller who can set a
    request's salt could name another tenant's (the gateway sets it, callers should not).
    """
    if tenant == DEFAULT_TENANT:
        return base_salt
    return hashlib.sha256(f"{base_salt}\0{tenant}".encode()).hexdigest()
