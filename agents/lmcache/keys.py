"""LMCache's chunk hashes and object keys, computed from token ids.

A prefetch is useful only if it writes the very key the engine will look up, and a key
that differs by one hash seed misses silently. This module names a token sequence's
chunks the way LMCache 0.5.x does, in its two key formats, from the engine's settings
(:class:`LMCacheKeySettings`):

* ``"mp"``, the multiprocess server (``lmcache server``, vLLM's ``LMCacheMPConnector``):
  ``TokenHasher`` in ``lmcache/v1/multiprocess/token_hasher.py`` chains
  ``h_i = H((h_{i-1}, tuple(chunk_i), None))`` over **full** chunks only (a last partial
  chunk is never keyed); ``ipc_key_to_object_keys`` in ``lmcache/v1/distributed/api.py``
  makes one ``ObjectKey(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)``
  per chunk, kv rank and object group, and the L2 adapters name it
  ``<model>@<kv_rank:08x>@<group:x>@<hash hex>[@<salt>]`` (valkey, resp and the other
  native connectors, S3, Bigtable, HF buckets; valkey may put ``<key_prefix>@`` in front)
  or, for the file-system adapter, ``<model, '/' as '-SEP-'>@0x<kv_rank:08x>@...`` plus
  ``.data``. ``kv_rank`` packs ``(world_size << 24) | (rank << 16) | (world_size << 8) |
  rank``; a lookup key without a worker id fans out to every rank of the world size.
* ``"legacy"``, the in-process engine (``LMCacheConnectorV1``): ``ChunkedTokenDatabase``
  in ``lmcache/v1/token_database.py`` chains ``h_i = H((h_{i-1}, tuple(chunk_i), ()))``
  from ``NONE_HASH`` and keys the last partial chunk too when ``save_unfull_chunk`` is on
  (off by default in ``LMCacheEngineConfig``); ``CacheEngineKey.to_string()`` in
  ``lmcache/utils.py`` is ``<model>@<world_size>@<worker_id>@<hash:x>@<dtype>`` plus
  ``@<tag>%<value>`` per ``lmcache.tag.<tag>`` request config. The hash is a Python int
  (``hash:x`` of a negative builtin hash starts with ``-``); MLA engines that save on the
  first rank only put world size 1 in the key. Legacy keys carry no cache salt: tenants
  are told apart by tags.

Hash algorithms, as LMCache 0.5.6 resolves them with vLLM **not** installed (this
control plane's case):

* mp: ``blake3`` (LMCache's own, the server's default): ``h_{-1}`` is
  ``blake3(8 zero bytes + be32(0))``, ``h_i = blake3(h_{i-1} + be32 tokens)``, 32-byte
  digests. ``builtin``: Python's ``hash`` of the tuple, ``h_{-1} = hash((0, (0,), None))``,
  stored as 8 signed big-endian bytes. Any other name silently falls back to ``builtin``.
* legacy: ``builtin`` only (``NONE_HASH = 0``). Every other name, ``blake3`` included,
  silently falls back to ``builtin``; this module refuses such names rather than name keys
  after an algorithm the engine may not run.

With vLLM installed (as on a GPU node), names other than ``blake3`` resolve through vLLM's
``get_hash_fn_by_name`` (``sha256``, ``sha256_cbor`` alias ``sha256_cbor_64bit``, ``xxhash``,
``xxhash_cbor`` on recent vLLM), and the chain's start comes from vLLM's ``init_none_hash``:
``hash_fn(PYTHONHASHSEED)`` when that variable is set, else 32 random bytes per process, so
keys change on every restart unless ``PYTHONHASHSEED`` is set. That applies to ``builtin``
too (the start becomes ``hash(<seed string>)``, which depends on ``PYTHONHASHSEED``); only
mp ``blake3`` never consults vLLM. A legacy engine runs inside vLLM, so unless its vLLM
predates ``init_none_hash`` (vLLM PR #20511), its start is vLLM's, not 0: pass the value it
logs ("Initialized NONE_HASH=... from vLLM") as ``initial_hash``. The native code here does
not implement vLLM's hash functions: those names need ``implementation="lmcache"`` in a
process where vLLM is importable.

Python's builtin hash, measured on CPython 3.10.13, 3.11.7 (pyenv), 3.11.2 (Debian), 3.12.1
and 3.13.0: the hashed tuples hold only ints, tuples, ``()`` and ``None``, none of which
``PYTHONHASHSEED`` randomizes (it salts str and bytes). So from a given start, legacy
``builtin`` hashes are the same in every process of any 64-bit CPython >= 3.8, whatever the
seed. The mp tuple holds ``None``, whose hash up to 3.11 comes from its address: it changes
from run to run, even with a fixed ``PYTHONHASHSEED``, on a position-independent or
``--enable-shared`` interpreter under ASLR (pyenv's 3.11.7), and is fixed but build-specific
on a non-PIE build (Debian's ``/usr/bin/python3.11``). From 3.12 on it is the constant
``0xFCA86420`` (:data:`PY312_NONE_HASH`). So mp ``builtin`` keys are reproducible only when
the LMCache server runs 3.12+ (or its ``hash(None)`` is known): set ``builtin_none_hash``,
and this module recomputes the outer tuple's hash with it (CPython's 64-bit tuple hash).
``PYTHONHASHSEED`` matters only where vLLM sets the start.

``implementation`` picks the code: ``"lmcache"`` calls LMCache's own functions (imported
lazily; they pull in torch), ``"native"`` is this module's code (``blake3`` from PyPI for
blake3, nothing for builtin), ``"auto"`` prefers LMCache when it is importable and can
honour the settings. Token ids must lie in ``[0, 2**32)`` (LMCache packs them as uint32).
Pure functions, no I/O.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeAlias, get_args

import numpy as np

from kvprefetch.controlplane.base.errors import ConfigError, KvPrefetchError

if TYPE_CHECKING:
    from numpy.typing import NDArray

KeyFormat = Literal["mp", "legacy"]
Implementation = Literal["auto", "native", "lmcache"]
KeyStyle = Literal["wire", "fs"]
Resolved = Literal["native", "lmcache"]
TokenIds: TypeAlias = "Sequence[int] | array.array[int] | NDArray[np.integer[Any]]"

#: Hash algorithms this module computes natively, per key format.
NATIVE_HASH_ALGORITHMS: Mapping[str, tuple[str, ...]] = {
    "mp": ("blake3", "builtin"),
    "legacy": ("builtin",),
}
#: Names LMCache resolves through vLLM's ``get_hash_fn_by_name`` (both formats).
VLLM_HASH_ALGORITHMS: tuple[str, ...] = (
    "sha256", "sha256_cbor", "sha256_cbor_64bit", "xxhash", "xxhash_cbor",
)
DEFAULT_HASH_ALGORITHM: Mapping[str, str] = {"mp": "blake3", "legacy": "builtin"}
#: ``hash(None)`` on CPython 3.12 and later (a constant; address-based before).
PY312_NONE_HASH = 0xFCA86420
#: Dtype names a legacy key can carry (``TORCH_DTYPE_TO_STR_DTYPE`` in ``lmcache/utils.py``).
LEGACY_KV_DTYPES: frozenset[str] = frozenset({
    "half", "bfloat16", "float", "double", "int8", "uint8", "int16", "int32", "int64",
    "bool", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2", "fp8_e5m2fnuz",
})

_SALT_FORBIDDEN = frozenset("@/\\\x00")  # ObjectKey.cache_salt's rule in LMCache
_SALT_MAX_LEN = 128
_MAX_WORLD_SIZE_MP = 255  # kv_rank packs world size and rank in 8 bits each
_MAX_TOKEN_ID = 2**32 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FS_SLASH = "-SEP-"  # fs_l2_adapter.py's replacement for '/' in model names
_FS_EXT = ".data"
_UINT32 = "I" if array.array("I").itemsize == 4 else "L"


@dataclass(frozen=True)
class LMCacheKeySettings:
    """What an engine's LMCache keys depend on. Validated on construction; each error is a
    :class:`~kvprefetch.controlplane.base.errors.ConfigError` that names the field."""

    model_name: str
    key_format: KeyFormat = "mp"
    #: Tokens per chunk (LMCache's ``chunk_size``).
    chunk_size: int = 256
    #: ``""`` = the format's default: ``blake3`` for mp, ``builtin`` for legacy.
    hash_algorithm: str = ""
    #: Workers of the engine (TP x PP); at most 255 for mp keys.
    world_size: int = 1
    #: The worker whose keys to name; ``None`` = every worker, in rank order.
    worker_id: int | None = None
    #: mp only: per-tenant isolation salt (vLLM's ``cache_salt``).
    cache_salt: str = ""
    #: mp only: object groups to name keys in (hybrid models register several).
    object_group_ids: tuple[int, ...] = (0,)
    #: legacy only: ``(tag, value)`` pairs from ``lmcache.tag.<tag>`` request configs.
    tags: tuple[tuple[str, str], ...] = ()
    #: legacy only: the KV dtype name in the key.
    kv_dtype: str = "bfloat16"
    #: legacy only: MLA engines that save on the first rank key with world size 1.
    use_mla: bool = False
    save_only_first_rank: bool = True
    #: legacy only: whether the last partial chunk is keyed (LMCache's default: no).
    save_unfull_chunk: bool = False
    #: The chain's start when the engine's differs from LMCache's vLLM-less default
    #: (an engine with vLLM logs it as NONE_HASH); int or bytes as LMCache holds it.
    initial_hash: int | bytes | None = None
    #: mp builtin only: ``hash(None)`` in the LMCache server's interpreter
    #: (:data:`PY312_NONE_HASH` for 3.12+); ``None`` = this interpreter's.
    builtin_none_hash: int | None = None

    def __post_init__(self) -> None:
        if self.key_format not in get_args(KeyFormat):
            _bad("key_format", f"must be one of {get_args(KeyFormat)}, got {self.key_format!r}")
        mp = self.key_format == "mp"
        if not isinstance(self.model_name, str) or not self.model_name or "@" in self.model_name:
            _bad("model_name", f"must be a non-empty string without '@' (LMCache's key "
                               f"separator), got {self.model_name!r}")
        _check_int("chunk_size", self.chunk_size, 1)
        self._check_hash_algorithm()
        _check_int("world_size", self.world_size, 1, _MAX_WORLD_SIZE_MP if mp else None)
        if self.worker_id is not None:
            _check_int("worker_id", self.worker_id, 0, self.world_size - 1)
        self._check_salt_and_groups(mp)
        self._check_tags(mp)
        if self.kv_dtype not in LEGACY_KV_DTYPES:
            _bad("kv_dtype", f"must be one of {sorted(LEGACY_KV_DTYPES)}, got {self.kv_dtype!r}")
        for name in ("use_mla", "save_only_first_rank", "save_unfull_chunk"):
            if not isinstance(getattr(self, name), bool):
                _bad(name, f"must be a bool, got {getattr(self, name)!r}")
        if mp and self.save_unfull_chunk:
            _bad("save_unfull_chunk", "mp keys never cover a partial chunk; legacy only")
        self._check_initial_hashes(mp)

    def _check_hash_algorithm(self) -> None:
        algorithm = self.hash_algorithm or DEFAULT_HASH_ALGORITHM[self.key_format]
        known = NATIVE_HASH_ALGORITHMS[self.key_format] + VLLM_HASH_ALGORITHMS
        if algorithm not in known:
            _bad("hash_algorithm", f"{algorithm!r} is not offered for {self.key_format} keys "
                                   f"(LMCache would silently fall back to Python's builtin "
                                   f"hash); choose one of {known}")
        object.__setattr__(self, "hash_algorithm", algorithm)

    def _check_salt_and_groups(self, mp: bool) -> None:
        salt = self.cache_salt
        if not isinstance(salt, str):
            _bad("cache_salt", f"must be a string, got {salt!r}")
        if salt and not mp:
            _bad("cache_salt", "legacy keys carry no salt; tell tenants apart by tags")
        if _SALT_FORBIDDEN & set(salt) or len(salt) > _SALT_MAX_LEN:
            _bad("cache_salt", f"must be at most {_SALT_MAX_LEN} characters without '@', '/', "
                               f"'\\' or NUL, got {salt!r}")
        groups = self.object_group_ids
        if isinstance(groups, int | str) or not isinstance(groups, Sequence):
            _bad("object_group_ids", f"must be a sequence of ints, got {groups!r}")
        groups = tuple(groups)
        if not groups or any(isinstance(g, bool) or not isinstance(g, int) or g < 0
                             for g in groups):
            _bad("object_group_ids", f"must be one or more ints >= 0, got {groups!r}")
        if not mp and groups != (0,):
            _bad("object_group_ids", "object groups exist in mp keys only")
        object.__setattr__(self, "object_group_ids", groups)

    def _check_tags(self, mp: bool) -> None:
        raw: Any = self.tags
        pairs = tuple(raw.items()) if isinstance(raw, Mapping) else raw
        if not isinstance(pairs, Sequence) or isinstance(pairs, str):
            _bad("tags", f"must be (tag, value) pairs, got {raw!r}")
        pairs = tuple(tuple(p) if isinstance(p, Sequence) and not isinstance(p, str) else p
                      for p in pairs)
        for pair in pairs:
            if (not isinstance(pair, tuple) or len(pair) != 2
                    or not all(isinstance(part, str) for part in pair)):
                _bad("tags", f"must be (tag, value) string pairs, got {pair!r}")
            tag, value = pair
            if not tag or "@" in tag or "%" in tag or "@" in value:
                _bad("tags", f"tag {tag!r} must be non-empty without '@' or '%', and its "
                             f"value {value!r} without '@'")
        if pairs and mp:
            _bad("tags", "mp keys carry no tags; use cache_salt")
        object.__setattr__(self, "tags", pairs)

    def _check_initial_hashes(self, mp: bool) -> None:
        start = self.initial_hash
        if start is not None and (isinstance(start, bool)
                                  or not isinstance(start, int | bytes)):
            _bad("initial_hash", f"must be an int, bytes or None, got {start!r}")
        if isinstance(start, bytes) and not start:
            _bad("initial_hash", "must not be empty bytes")
        if isinstance(start, int) and self.hash_algorithm == "blake3":
            _check_int("initial_hash", start, _INT64_MIN, _INT64_MAX)
        if isinstance(start, bytes) and not mp:
            _bad("initial_hash", "legacy chains start from an int (LMCache folds digests)")
        none_hash = self.builtin_none_hash
        if none_hash is not None:
            if not (mp and self.hash_algorithm == "builtin"):
                _bad("builtin_none_hash", "applies to mp keys with hash_algorithm='builtin' "
                                          "only")
            _check_int("builtin_none_hash", none_hash, _INT64_MIN, _INT64_MAX)

    @property
    def kv_ranks(self) -> tuple[int, ...]:
        """mp: the kv ranks keys are named for, in rank order."""
        workers = range(self.world_size) if self.worker_id is None else (self.worker_id,)
        return tuple(kv_rank(self.world_size, w) for w in workers)


def _bad(field_name: str, message: str) -> NoReturn:
    raise ConfigError(f"LMCacheKeySettings.{field_name}: {message}")


def _check_int(field_name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _bad(field_name, f"must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        _bad(field_name, f"must be {span}, got {value}")


def kv_rank(world_size: int, worker_id: int) -> int:
    """LMCache's ``ObjectKey.ComputeKVRank`` for a single-node layout (what the mp server
    uses): world size and rank, global and local, one byte each."""
    return (world_size << 24) | (worker_id << 16) | (world_size << 8) | worker_id


# --- public functions --------------------------------------------------------------------


def chunk_hashes(settings: LMCacheKeySettings, token_ids: TokenIds, *,
                 implementation: Implementation = "auto") -> list[str]:
    """The chained chunk hashes of ``token_ids``, as the hex text in the keys: mp
    ``ObjectKey.chunk_hash.hex()`` (``bytes.fromhex`` gives the bytes back), legacy
    ``f"{CacheEngineKey.chunk_hash:x}"`` (``int(text, 16)`` gives the int back). One per
    keyed chunk: full chunks, plus the last partial one for legacy ``save_unfull_chunk``."""
    if _choose(settings, implementation) == "lmcache":
        if settings.key_format == "mp":
            return [h.hex() for h in _lmcache_mp_hashes(settings, _token_list(token_ids))]
        return [f"{h:x}" for h, _ in _lmcache_legacy(settings, _token_list(token_ids), 0)]
    if settings.key_format == "mp":
        return [h.hex() for h in _native_mp_hashes(settings, token_ids)]
    return [f"{h:x}" for h in _native_legacy_hashes(settings, _token_list(token_ids))]


def object_keys(settings: LMCacheKeySettings, token_ids: TokenIds, *,
                implementation: Implementation = "auto", style: KeyStyle = "wire",
                key_prefix: str = "") -> list[str]:
    """The storage keys of ``token_ids``' chunks, as LMCache names them.

    mp: ``style="wire"`` is the name the valkey/resp/native-connector, S3 and HF-bucket
    adapters use (Bigtable's and SageMaker HyperPod's encoders read the same),
    ``key_prefix`` (valkey's) put in front with ``@``;
    ``style="fs"`` is the file-system adapter's file name. Ordered object group by object
    group, then chunk by chunk, then kv rank (``ipc_key_to_object_keys``'s order).
    legacy: ``CacheEngineKey.to_string()``, chunk by chunk, then worker; only ``"wire"``.
    """
    if style not in get_args(KeyStyle):
        raise KvPrefetchError(f"style must be one of {get_args(KeyStyle)}, got {style!r}")
    if key_prefix and ("@" in key_prefix or settings.key_format != "mp" or style != "wire"):
        raise KvPrefetchError(f"key_prefix {key_prefix!r} applies to mp wire keys only and "
                              "must not contain '@'")
    if settings.key_format == "legacy" and style != "wire":
        raise KvPrefetchError("legacy keys have one style: 'wire' (CacheEngineKey.to_string)")
    use_lmcache = _choose(settings, implementation) == "lmcache"
    if settings.key_format == "legacy":
        return _legacy_keys(settings, token_ids, use_lmcache)
    keys = _mp_keys(settings, token_ids, use_lmcache, style)
    return [f"{key_prefix}@{k}" for k in keys] if key_prefix else keys


def resolve_implementation(settings: LMCacheKeySettings,
                           implementation: Implementation = "auto") -> Resolved:
    """``"native"`` or ``"lmcache"``: what ``implementation`` resolves to for ``settings``."""
    return _choose(settings, implementation)


def _mp_keys(settings: LMCacheKeySettings, token_ids: TokenIds, use_lmcache: bool,
             style: str) -> list[str]:
    if use_lmcache:
        return _lmcache_mp_keys(settings, _token_list(token_ids), style)
    encode = _mp_wire_key if style == "wire" else _mp_fs_name
    hashes = _native_mp_hashes(settings, token_ids)
    return [encode(settings, h, rank, group) for group in settings.object_group_ids
            for h in hashes for rank in settings.kv_ranks]


def _legacy_keys(settings: LMCacheKeySettings, token_ids: TokenIds,
                 use_lmcache: bool) -> list[str]:
    workers = range(settings.world_size) if settings.worker_id is None else (settings.worker_id,)
    if use_lmcache:
        tokens = _token_list(token_ids)
        per_worker = [_lmcache_legacy(settings, tokens, w) for w in workers]
        return [keys[i][1] for i in range(len(per_worker[0])) for keys in per_worker]
    hashes = _native_legacy_hashes(settings, _token_list(token_ids))
    return [_legacy_key(settings, h, w) for h in hashes for w in workers]


# --- choice of implementation ------------------------------------------------------------


def _choose(settings: LMCacheKeySettings, implementation: str) -> Resolved:
    if implementation not in get_args(Implementation):
        raise KvPrefetchError(
            f"implementation must be one of {get_args(Implementation)}, got {implementation!r}")
    native_ok = settings.hash_algorithm in NATIVE_HASH_ALGORITHMS[settings.key_format]
    if implementation == "native":
        if not native_ok:
            raise ConfigError(
                f"LMCacheKeySettings.hash_algorithm: {settings.hash_algorithm!r} comes from "
                "vLLM and has no native implementation here; use implementation='lmcache' "
                "where vLLM is installed")
        return "native"
    if implementation == "lmcache":
        _lmcache_blocker(settings, raise_it=True)
        return "lmcache"
    # auto: LMCache when it can honour the settings, else native.
    if _lmcache_blocker(settings, raise_it=not native_ok) is None:
        return "lmcache"
    return "native"


def _lmcache_blocker(settings: LMCacheKeySettings, *, raise_it: bool) -> str | None:
    """Why LMCache's own code cannot compute these keys in this process (None: it can)."""
    reason = None
    none_hash = settings.builtin_none_hash
    if none_hash is not None and none_hash != hash(None):
        reason = (f"builtin_none_hash={none_hash:#x} differs from this interpreter's "
                  f"hash(None)={hash(None):#x}, which LMCache's builtin hash uses")
    else:
        try:
            import lmcache.v1.multiprocess.token_hasher  # noqa: F401
        except ImportError as exc:
            reason = f"LMCache is not importable ({exc}): pip install 'kvprefetch[lmcache]'"
    if reason is not None and raise_it:
        raise KvPrefetchError(f"implementation='lmcache' cannot be used: {reason}")
    return reason


# --- token ids ---------------------------------------------------------------------------


def _uint32_tokens(token_ids: TokenIds) -> array.array[int]:
    """Token ids as a native-endian uint32 array (one C-speed pass; rejects what LMCache's
    ``struct.pack('>...I')`` would)."""
    if isinstance(token_ids, array.array) and token_ids.typecode == _UINT32:
        return token_ids
    if isinstance(token_ids, str | bytes | bytearray | memoryview):
        raise KvPrefetchError(f"token ids must be ints, got {type(token_ids).__name__}")
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or (token_ids.size and token_ids.dtype.kind not in "iu"):
            raise KvPrefetchError(f"token ids must be a 1-D integer array, got "
                                  f"{token_ids.dtype} of shape {token_ids.shape}")
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > _MAX_TOKEN_ID):
            raise KvPrefetchError(f"token ids must lie in [0, 2**32), got {token_ids.min()} "
                                  f"to {token_ids.max()}")
        out = array.array(_UINT32)
        out.frombytes(token_ids.astype(np.uint32).tobytes())
        return out
    try:
        return array.array(_UINT32, token_ids)
    except (OverflowError, TypeError) as exc:
        raise KvPrefetchError(f"token ids must be ints in [0, 2**32): {exc}") from exc


def _token_list(token_ids: TokenIds) -> Sequence[int]:
    """Token ids as a sequence of Python ints (checked); a list or tuple is used as is,
    since boxing ints again costs more than the hashing."""
    checked = _uint32_tokens(token_ids)
    if isinstance(token_ids, list | tuple):
        return token_ids
    if isinstance(token_ids, np.ndarray):
        return list(token_ids.tolist())
    return checked.tolist()


# --- native hashing ----------------------------------------------------------------------

# CPython's 64-bit tuple hash (Objects/tupleobject.c, an xxHash variant, 3.8+) and int hash
# (reduction modulo the Mersenne prime 2**61 - 1).
_XXPRIME_1 = 11400714785074694791
_XXPRIME_2 = 14029467366897019727
_XXPRIME_5 = 2870177450012600261
_MASK64 = 2**64 - 1
_PY_HASH_MODULUS = 2**61 - 1


def py_int_hash(value: int) -> int:
    """``hash(value)`` for an int, as 64-bit CPython computes it."""
    h = abs(value) % _PY_HASH_MODULUS
    h = -h if value < 0 else h
    return -2 if h == -1 else h


def py_tuple_hash(item_hashes: Sequence[int]) -> int:
    """``hash(t)`` of a tuple whose items hash to ``item_hashes``, as 64-bit CPython >= 3.8
    computes it (so a tuple holding None can be hashed as another interpreter would)."""
    acc = _XXPRIME_5
    for lane in item_hashes:
        acc = (acc + (lane & _MASK64) * _XXPRIME_2) & _MASK64
        acc = ((acc << 31) | (acc >> 33)) & _MASK64
        acc = (acc * _XXPRIME_1) & _MASK64
    acc = (acc + (len(item_hashes) ^ (_XXPRIME_5 ^ 3527539))) & _MASK64
    if acc == _MASK64:
        return 1546275796
    return acc - 2**64 if acc > _INT64_MAX else acc


def _native_mp_hashes(settings: LMCacheKeySettings, token_ids: TokenIds) -> list[bytes]:
    if settings.hash_algorithm == "blake3":
        return _blake3_chain(settings, _uint32_tokens(token_ids))
    tokens = _token_list(token_ids)
    start = settings.initial_hash
    if isinstance(start, bytes):
        raise ConfigError("LMCacheKeySettings.initial_hash: a bytes start of a builtin chain "
                          "is hashed with PYTHONHASHSEED's salt; natively only an int works")
    none_lane = settings.builtin_none_hash
    if none_lane is None or none_lane == hash(None):
        # The server's hash(None) is ours: Python's own tuple hash is exact and fastest.
        prefix = hash((0, (0,), None)) if start is None else start
        return [(prefix := hash((prefix, tuple(chunk), None))).to_bytes(8, "big", signed=True)
                for chunk in _full_chunks(tokens, settings.chunk_size)]
    # Another interpreter's hash(None): recompute the outer tuple's hash with it. The token
    # tuple holds only ints, so its hash is the same in every CPython process.
    prefix = py_tuple_hash((0, hash((0,)), none_lane)) if start is None else start
    out = []
    for chunk in _full_chunks(tokens, settings.chunk_size):
        prefix = py_tuple_hash((py_int_hash(prefix), hash(tuple(chunk)), none_lane))
        out.append(prefix.to_bytes(8, "big", signed=True))
    return out


def _full_chunks(tokens: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for begin in range(0, len(tokens) - len(tokens) % size, size):
        yield tokens[begin:begin + size]


def _blake3_chain(settings: LMCacheKeySettings, tokens: array.array[int]) -> list[bytes]:
    try:
        from blake3 import blake3
    except ImportError as exc:
        raise KvPrefetchError("native blake3 chunk hashes need the 'blake3' package: "
                              "pip install blake3") from exc
    size = settings.chunk_size
    full = len(tokens) - len(tokens) % size
    big_endian = tokens[:full]  # a copy: byteswap must not touch the caller's array
    if sys.byteorder == "little":
        big_endian.byteswap()
    raw = memoryview(big_endian).cast("B")
    start = settings.initial_hash
    if start is None:
        # LMCache's start: the hash of (0, (0,), None), an int prefix as 8 bytes then token 0.
        prefix = blake3(bytes(12)).digest()
    else:
        prefix = start if isinstance(start, bytes) else start.to_bytes(8, "big", signed=True)
    out = []
    step = 4 * size
    for offset in range(0, 4 * full, step):
        hasher = blake3(prefix)
        hasher.update(raw[offset:offset + step])
        prefix = hasher.digest()
        out.append(prefix)
    return out


def _native_legacy_hashes(settings: LMCacheKeySettings, tokens: Sequence[int]) -> list[int]:
    start = settings.initial_hash
    prefix = 0 if start is None else start  # NONE_HASH is 0 without vLLM
    assert isinstance(prefix, int)  # settings refuse bytes for legacy
    size = settings.chunk_size
    end = len(tokens) if settings.save_unfull_chunk else len(tokens) - len(tokens) % size
    # Ints, tuples and () hash alike in every 64-bit CPython >= 3.8 process, whatever
    # PYTHONHASHSEED: Python's own hash is exact here.
    return [prefix := hash((prefix, tuple(tokens[begin:begin + size]), ()))
            for begin in range(0, end, size)]


# --- native key strings ------------------------------------------------------------------


def mp_wire_name(model_name: str, kv_rank: int, object_group_id: int, chunk_hash: bytes,
                 cache_salt: str = "") -> str:
    """An MP ``ObjectKey`` as LMCache's remote L2 adapters name it (and our adapter):
    ``<model>@<kv_rank:08x>@<group:x>@<chunk hash hex>[@<salt>]``."""
    base = f"{model_name}@{kv_rank:08x}@{object_group_id:x}@{chunk_hash.hex()}"
    return f"{base}@{cache_salt}" if cache_salt else base


def _mp_wire_key(settings: LMCacheKeySettings, chunk_hash: bytes, rank: int, group: int) -> str:
    return mp_wire_name(settings.model_name, rank, group, chunk_hash, settings.cache_salt)


def _mp_fs_name(settings: LMCacheKeySettings, chunk_hash: bytes, rank: int, group: int) -> str:
    model = settings.model_name.replace("/", _FS_SLASH)
    base = f"{model}@{rank:#010x}@{group:x}@{chunk_hash.hex()}"
    salt = f"@{settings.cache_salt}" if settings.cache_salt else ""
    return f"{base}{salt}{_FS_EXT}"


def _legacy_key(settings: LMCacheKeySettings, chunk_hash: int, worker: int) -> str:
    world_size = 1 if settings.use_mla and settings.save_only_first_rank else settings.world_size
    key = f"{settings.model_name}@{world_size}@{worker}@{chunk_hash:x}@{settings.kv_dtype}"
    return key + "".join(f"@{tag}%{value}" for tag, value in settings.tags)


# --- LMCache's own code (imported lazily: it pulls in torch) ------------------------------


def _lmcache_mp_hasher(settings: LMCacheKeySettings) -> Any:
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    hasher = TokenHasher(chunk_size=settings.chunk_size, hash_algorithm=settings.hash_algorithm)
    _refuse_silent_fallback(settings, hasher.hash_func)
    return hasher


def _refuse_silent_fallback(settings: LMCacheKeySettings, hash_func: Callable[..., Any]) -> None:
    # LMCache swaps in Python's hash, with only a log line, for any name vLLM cannot serve.
    if settings.hash_algorithm != "builtin" and hash_func is hash:
        raise KvPrefetchError(
            f"LMCache could not load hash algorithm {settings.hash_algorithm!r} (it comes from "
            "vLLM, which is not importable here) and would silently use Python's builtin hash")


def _lmcache_mp_hashes(settings: LMCacheKeySettings, tokens: Sequence[int]) -> list[bytes]:
    hasher = _lmcache_mp_hasher(settings)
    hashes: list[bytes] = hasher.compute_chunk_hashes(list(tokens),
                                                      prefix_hash=settings.initial_hash)
    return hashes


def _lmcache_mp_keys(settings: LMCacheKeySettings, tokens: Sequence[int],
                     style: str) -> list[str]:
    from lmcache.v1.distributed.api import ipc_key_to_object_keys
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _object_key_to_filename
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        _object_key_to_string,
    )
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

    ipc_key = IPCCacheServerKey(
        model_name=settings.model_name, world_size=settings.world_size,
        worker_id=settings.worker_id, token_ids=tuple(tokens), start=0, end=len(tokens),
        request_id="", cache_salt=settings.cache_salt)
    hashes = _lmcache_mp_hashes(settings, tokens)
    groups = ipc_key_to_object_keys(ipc_key, hashes, list(settings.object_group_ids))
    encode = _object_key_to_string if style == "wire" else _object_key_to_filename
    return [encode(key) for group in groups for key in group]


def _lmcache_legacy(settings: LMCacheKeySettings, tokens: Sequence[int],
                    worker: int) -> list[tuple[int, str]]:
    """(chunk hash, key string) per keyed chunk, from ``ChunkedTokenDatabase``. Building
    one sets LMCache's module-wide ``NONE_HASH`` (and, with vLLM, vLLM's), as in an engine."""
    from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=settings.chunk_size, save_unfull_chunk=settings.save_unfull_chunk,
        pre_caching_hash_algorithm=settings.hash_algorithm,
        extra_config={"save_only_first_rank": settings.save_only_first_rank})
    metadata = LMCacheMetadata(
        model_name=settings.model_name, world_size=settings.world_size,
        local_world_size=settings.world_size, worker_id=worker, local_worker_id=worker,
        kv_dtype=STR_DTYPE_TO_TORCH_DTYPE[settings.kv_dtype],
        kv_shape=(1, 2, settings.chunk_size, 1, 1), use_mla=settings.use_mla)
    database = ChunkedTokenDatabase(config, metadata)
    _refuse_silent_fallback(settings, database.hash_func)
    if settings.initial_hash is not None:
        start = settings.initial_hash
        # The start is LMCache's module-wide NONE_HASH; override it on this instance only.
        database._get_init_hash = lambda: start
    request_configs = {f"lmcache.tag.{tag}": value for tag, value in settings.tags}
    return [(key.chunk_hash, key.to_string())
            for _, _, key in database.process_tokens(tokens=list(tokens),
                                                     request_configs=request_configs)]
