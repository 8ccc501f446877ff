"""Key parity with the installed LMCache (0.5.x): our native chunk hashes and object keys
equal LMCache's own, byte for byte, for every hash algorithm it offers here and both key
formats. A key that differs by one seed misses silently, so parity is tested, not assumed.

The reference outputs come straight from LMCache's functions (``TokenHasher``,
``ipc_key_to_object_keys`` and the L2 adapters' key encoders for the multiprocess format;
``ChunkedTokenDatabase`` and ``CacheEngineKey.to_string`` for the legacy one), not from
``kvprefetch.agents.lmcache.keys``' own ``implementation="lmcache"`` path, which is checked
against them too. LMCache is imported by the first test that needs it (a run that selects
none of these tests does not import it); CI installs it, and a missing LMCache fails
these tests, not skips them.
"""

from __future__ import annotations

import array
import functools
import importlib.util
import json
import os
import random
import subprocess
import sys
import textwrap
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvprefetch.agents.lmcache.keys import (
    NATIVE_HASH_ALGORITHMS,
    PY312_NONE_HASH,
    VLLM_HASH_ALGORITHMS,
    LMCacheKeySettings,
    chunk_hashes,
    kv_rank,
    object_keys,
    py_int_hash,
    py_tuple_hash,
    resolve_implementation,
)
from kvprefetch.controlplane.base.errors import ConfigError, KvPrefetchError
from kvprefetch.controlplane.base.keys import tenant_cache_salt

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
MP_ALGORITHMS = NATIVE_HASH_ALGORITHMS["mp"]
LEGACY_ALGORITHMS = NATIVE_HASH_ALGORITHMS["legacy"]
# The adapters that name an ObjectKey <model>@<rank:08x>@<group:x>@<hash>[@<salt>].
WIRE_ADAPTERS = ("hfbucket", "native_connector", "s3", "valkey")
FAST = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.cache
def lm() -> SimpleNamespace:
    """LMCache's functions, imported by the first test that calls them rather than at
    collection, so that a run which selects none of these tests does not import LMCache
    (and torch)."""
    import lmcache
    from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.distributed import l2_adapters
    from lmcache.v1.distributed.api import ipc_key_to_object_keys
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.token_hasher import TokenHasher
    from lmcache.v1.token_database import ChunkedTokenDatabase

    adapters = {name: importlib.import_module(f"{l2_adapters.__name__}.{name}_l2_adapter")
                for name in (*WIRE_ADAPTERS, "fs")}
    return SimpleNamespace(
        version=lmcache.__version__, STR_DTYPE_TO_TORCH_DTYPE=STR_DTYPE_TO_TORCH_DTYPE,
        LMCacheEngineConfig=LMCacheEngineConfig, ipc_key_to_object_keys=ipc_key_to_object_keys,
        LMCacheMetadata=LMCacheMetadata, IPCCacheServerKey=IPCCacheServerKey,
        TokenHasher=TokenHasher, ChunkedTokenDatabase=ChunkedTokenDatabase,
        adapters=adapters,
        wire_encoders={name: adapters[name]._object_key_to_string for name in WIRE_ADAPTERS})


def test_the_installed_lmcache_is_0_5() -> None:
    assert lm().version.startswith("0.5."), lm().version


# --- references: LMCache's own functions ----------------------------------------------


def lmcache_mp(s: LMCacheKeySettings, tokens: list[int], encode: Any = None,
               ) -> tuple[list[bytes], list[str]]:
    """(chunk hashes, key strings) as the LMCache MP server and its adapters make them."""
    hasher = lm().TokenHasher(chunk_size=s.chunk_size, hash_algorithm=s.hash_algorithm)
    hashes = hasher.compute_chunk_hashes(tokens, prefix_hash=s.initial_hash)
    ipc_key = lm().IPCCacheServerKey.from_token_ids(
        s.model_name, s.world_size, s.worker_id, tokens, end=len(tokens),
        cache_salt=s.cache_salt)
    groups = lm().ipc_key_to_object_keys(ipc_key, hashes, list(s.object_group_ids))
    encode = encode or lm().wire_encoders["native_connector"]
    return hashes, [encode(key) for group in groups for key in group]


def lmcache_legacy(s: LMCacheKeySettings, tokens: list[int], worker: int,
                   ) -> tuple[list[int], list[str]]:
    """(chunk hashes, key strings) as LMCache's in-process ChunkedTokenDatabase makes them."""
    config = lm().LMCacheEngineConfig.from_defaults(
        chunk_size=s.chunk_size, save_unfull_chunk=s.save_unfull_chunk,
        pre_caching_hash_algorithm=s.hash_algorithm,
        extra_config={"save_only_first_rank": s.save_only_first_rank})
    metadata = lm().LMCacheMetadata(
        model_name=s.model_name, world_size=s.world_size, local_world_size=s.world_size,
        worker_id=worker, local_worker_id=worker,
        kv_dtype=lm().STR_DTYPE_TO_TORCH_DTYPE[s.kv_dtype],
        kv_shape=(1, 2, s.chunk_size, 1, 1), use_mla=s.use_mla)
    database = lm().ChunkedTokenDatabase(config, metadata)
    if s.initial_hash is not None:
        start = s.initial_hash
        database._get_init_hash = lambda: start
    configs = {f"lmcache.tag.{tag}": value for tag, value in s.tags}
    keys = [key for _, _, key in database.process_tokens(tokens=tokens, request_configs=configs)]
    return [k.chunk_hash for k in keys], [k.to_string() for k in keys]


def workers(s: LMCacheKeySettings) -> range | tuple[int]:
    return range(s.world_size) if s.worker_id is None else (s.worker_id,)


def assert_mp_parity(s: LMCacheKeySettings, tokens: list[int]) -> None:
    want_hashes, want_keys = lmcache_mp(s, tokens)
    assert chunk_hashes(s, tokens, implementation="native") == [h.hex() for h in want_hashes]
    assert object_keys(s, tokens, implementation="native") == want_keys
    assert object_keys(s, tokens, implementation="lmcache") == want_keys
    assert chunk_hashes(s, tokens, implementation="lmcache") == [h.hex() for h in want_hashes]
    assert len(want_hashes) == len(tokens) // s.chunk_size  # full chunks only


def assert_legacy_parity(s: LMCacheKeySettings, tokens: list[int]) -> None:
    per_worker = [lmcache_legacy(s, tokens, w) for w in workers(s)]
    want_hashes = [f"{h:x}" for h in per_worker[0][0]]
    want_keys = [keys[i] for i in range(len(want_hashes)) for _, keys in per_worker]
    assert chunk_hashes(s, tokens, implementation="native") == want_hashes
    assert object_keys(s, tokens, implementation="native") == want_keys
    assert object_keys(s, tokens, implementation="lmcache") == want_keys
    full, partial = divmod(len(tokens), s.chunk_size)
    assert len(want_hashes) == full + (1 if partial and s.save_unfull_chunk else 0)


# --- strategies --------------------------------------------------------------------------

NAME_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x24F, exclude_characters="@")
SALT_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x24F,
                           exclude_characters="@/\\%")
model_names = st.one_of(st.sampled_from(["meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-32B",
                                         "m"]),
                        st.text(NAME_CHARS, min_size=1, max_size=20))
chunk_sizes = st.sampled_from([1, 3, 16, 256])
token_values = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 151_935))


@st.composite
def token_lists(draw: st.DrawFn, chunk_size: int) -> list[int]:
    """Empty, partial, exact and several chunks, with and without a tail."""
    chunks = draw(st.integers(0, 3))
    tail = draw(st.sampled_from([0, 0, 1, chunk_size - 1]))
    n = min(chunks * chunk_size + tail, 800)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    wide = draw(st.booleans())
    high = 2**32 - 1 if wide else 151_935
    return [rng.randint(0, high) for _ in range(n)]


@st.composite
def mp_cases(draw: st.DrawFn) -> tuple[LMCacheKeySettings, list[int]]:
    chunk_size = draw(chunk_sizes)
    world_size = draw(st.integers(1, 4))
    algorithm = draw(st.sampled_from(MP_ALGORITHMS))
    start = draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1),
                           st.binary(min_size=8, max_size=32) if algorithm == "blake3"
                           else st.none()))
    s = LMCacheKeySettings(
        model_name=draw(model_names), chunk_size=chunk_size, hash_algorithm=algorithm,
        world_size=world_size,
        worker_id=draw(st.one_of(st.none(), st.integers(0, world_size - 1))),
        cache_salt=draw(st.one_of(st.just(""), st.text(SALT_CHARS, max_size=12))),
        object_group_ids=tuple(draw(st.lists(st.integers(0, 20), min_size=1, max_size=3))),
        initial_hash=start)
    return s, draw(token_lists(chunk_size))


@st.composite
def legacy_cases(draw: st.DrawFn) -> tuple[LMCacheKeySettings, list[int]]:
    chunk_size = draw(chunk_sizes)
    world_size = draw(st.integers(1, 4))
    tags = draw(st.lists(st.tuples(st.text(SALT_CHARS, min_size=1, max_size=6),
                                   st.text(SALT_CHARS, max_size=6)),
                         max_size=2, unique_by=lambda t: t[0]))
    s = LMCacheKeySettings(
        model_name=draw(model_names), key_format="legacy", chunk_size=chunk_size,
        hash_algorithm=draw(st.sampled_from(LEGACY_ALGORITHMS)), world_size=world_size,
        worker_id=draw(st.one_of(st.none(), st.integers(0, world_size - 1))),
        tags=tuple(tags), kv_dtype=draw(st.sampled_from(["bfloat16", "half", "float",
                                                         "fp8_e4m3fn"])),
        use_mla=draw(st.booleans()), save_only_first_rank=draw(st.booleans()),
        save_unfull_chunk=draw(st.booleans()),
        initial_hash=draw(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1))))
    return s, draw(token_lists(chunk_size))


# --- what this install offers ------------------------------------------------------------


def test_hash_algorithms_offered_without_vllm() -> None:
    """MP: blake3 is LMCache's own; every other name ends up as Python's builtin hash
    (silently). Legacy: every name, blake3 included, ends up as the builtin hash."""
    if VLLM_INSTALLED:
        pytest.skip("vLLM is installed: names other than blake3 resolve through vLLM")
    assert lm().TokenHasher(16, "blake3").hash_func is not hash
    for name in ("builtin", *VLLM_HASH_ALGORITHMS, "no-such-hash"):
        assert lm().TokenHasher(16, name).hash_func is hash
    for name in ("builtin", "blake3", *VLLM_HASH_ALGORITHMS):
        config = lm().LMCacheEngineConfig.from_defaults(pre_caching_hash_algorithm=name)
        assert lm().ChunkedTokenDatabase(config).hash_func is hash
    assert MP_ALGORITHMS == ("blake3", "builtin") and LEGACY_ALGORITHMS == ("builtin",)


@pytest.mark.parametrize("algorithm", VLLM_HASH_ALGORITHMS)
def test_vllm_algorithms_fail_loudly_instead_of_falling_back(algorithm: str) -> None:
    s = LMCacheKeySettings("m", hash_algorithm=algorithm, chunk_size=4)
    with pytest.raises(ConfigError, match="hash_algorithm"):
        chunk_hashes(s, range(8), implementation="native")
    if not VLLM_INSTALLED:
        with pytest.raises(KvPrefetchError, match="silently"):
            chunk_hashes(s, range(8), implementation="lmcache")
        with pytest.raises(KvPrefetchError, match="silently"):
            object_keys(replace(s, key_format="legacy"), range(8))


# --- parity ------------------------------------------------------------------------------


@FAST
@given(mp_cases())
def test_mp_keys_match_lmcache(case: tuple[LMCacheKeySettings, list[int]]) -> None:
    assert_mp_parity(*case)


@FAST
@given(legacy_cases())
def test_legacy_keys_match_lmcache(case: tuple[LMCacheKeySettings, list[int]]) -> None:
    assert_legacy_parity(*case)


@pytest.mark.parametrize("algorithm", MP_ALGORITHMS)
@pytest.mark.parametrize("n_tokens", [0, 1, 255, 256, 257, 512, 4096 + 17])
def test_mp_edges_of_a_chunk(algorithm: str, n_tokens: int) -> None:
    rng = random.Random(n_tokens)
    tokens = [rng.randrange(2**32) for _ in range(n_tokens)]
    assert_mp_parity(LMCacheKeySettings("meta-llama/Llama-3.1-8B", hash_algorithm=algorithm,
                                        world_size=2), tokens)


@pytest.mark.parametrize("unfull", [False, True])
@pytest.mark.parametrize("n_tokens", [0, 1, 255, 256, 257, 512, 4096 + 17])
def test_legacy_edges_of_a_chunk(unfull: bool, n_tokens: int) -> None:
    rng = random.Random(n_tokens)
    tokens = [rng.randrange(150_000) for _ in range(n_tokens)]
    assert_legacy_parity(LMCacheKeySettings("meta-llama/Llama-3.1-8B", key_format="legacy",
                                            world_size=2, save_unfull_chunk=unfull), tokens)


@pytest.mark.parametrize("adapter", WIRE_ADAPTERS)
@pytest.mark.parametrize("salt", ["", "tenant-7"])
def test_every_wire_adapter_names_keys_alike(adapter: str, salt: str) -> None:
    s = LMCacheKeySettings("Qwen/Qwen3-32B", chunk_size=16, world_size=4, cache_salt=salt,
                           object_group_ids=(0, 11))
    tokens = list(range(1000, 1100))
    _, want = lmcache_mp(s, tokens, lm().wire_encoders[adapter])
    assert object_keys(s, tokens, implementation="native") == want


@pytest.mark.parametrize("algorithm", MP_ALGORITHMS)
@pytest.mark.parametrize("salt", ["", "tenant-7"])
def test_fs_adapter_file_names(algorithm: str, salt: str) -> None:
    s = LMCacheKeySettings("Qwen/Qwen3-32B", chunk_size=16, hash_algorithm=algorithm,
                           world_size=2, worker_id=1, cache_salt=salt)
    tokens = list(range(50))
    _, want = lmcache_mp(s, tokens, lm().adapters["fs"]._object_key_to_filename)
    assert object_keys(s, tokens, implementation="native", style="fs") == want
    assert object_keys(s, tokens, implementation="lmcache", style="fs") == want
    assert want[0].startswith("Qwen-SEP-Qwen3-32B@0x02010201@0@")


def test_valkey_key_prefix() -> None:
    s = LMCacheKeySettings("m", chunk_size=4)
    tokens = list(range(12))
    _, plain = lmcache_mp(s, tokens)
    adapter = SimpleNamespace(_config=SimpleNamespace(key_prefix="kvp"))
    keys = [
        lm().adapters["valkey"].ValkeyL2Adapter._wire_key(adapter, key)
        for key in lm().ipc_key_to_object_keys(
            lm().IPCCacheServerKey.from_token_ids("m", 1, None, tokens, end=12),
            [bytes.fromhex(h) for h in chunk_hashes(s, tokens)], [0])[0]]
    assert object_keys(s, tokens, implementation="native", key_prefix="kvp") == keys
    assert keys == [f"kvp@{k}" for k in plain]


@pytest.mark.parametrize("key_format", ["mp", "legacy"])
def test_token_containers_agree(key_format: str) -> None:
    s = LMCacheKeySettings("m", key_format=key_format, chunk_size=16)
    tokens = [random.Random(3).randrange(2**32) for _ in range(100)]
    want = object_keys(s, tokens, implementation="lmcache")
    for container in (tokens, tuple(tokens), np.asarray(tokens, dtype=np.int64),
                      np.asarray(tokens, dtype=np.uint32), array.array("L", tokens)):
        assert object_keys(s, container, implementation="native") == want


# --- a mismatch would be seen ------------------------------------------------------------


@pytest.mark.parametrize("key_format", ["mp", "legacy"])
def test_every_setting_changes_the_keys(key_format: str) -> None:
    base = LMCacheKeySettings("m", key_format=key_format, chunk_size=16,
                              world_size=2, worker_id=0)
    tokens = list(range(64))
    keys = set(object_keys(base, tokens, implementation="native"))
    changes: list[dict[str, Any]] = [
        {"chunk_size": 32}, {"chunk_size": 8}, {"model_name": "m2"}, {"world_size": 4},
        {"worker_id": 1}, {"initial_hash": 1},
    ]
    if key_format == "mp":
        changes += [{"hash_algorithm": "builtin"}, {"cache_salt": "t"},
                    {"object_group_ids": (1,)}]
    else:
        changes += [{"tags": (("user", "a"),)}, {"kv_dtype": "half"}]
    for change in changes:
        other = set(object_keys(replace(base, **change), tokens, implementation="native"))
        assert not keys & other, change
    # Every token of every chunk counts, and the chain carries a change forward.
    hashes = chunk_hashes(base, tokens, implementation="native")
    for position in (0, 15, 17, 63):
        bumped = list(tokens)
        bumped[position] += 1
        other = chunk_hashes(base, bumped, implementation="native")
        first = position // 16
        assert other[:first] == hashes[:first]
        assert all(a != b for a, b in zip(other[first:], hashes[first:], strict=True))


def test_builtin_none_hash_changes_mp_builtin_keys() -> None:
    s = LMCacheKeySettings("m", hash_algorithm="builtin", chunk_size=4)
    here = chunk_hashes(s, range(8), implementation="native")
    assert chunk_hashes(replace(s, builtin_none_hash=hash(None)), range(8),
                        implementation="native") == here
    assert not set(here) & set(chunk_hashes(replace(s, builtin_none_hash=hash(None) + 1),
                                            range(8), implementation="native"))


# --- Python's builtin hash across processes ----------------------------------------------


@given(st.lists(st.one_of(st.integers(), st.none(), st.just(())), max_size=6))
@settings(max_examples=200, deadline=None)
def test_py_hash_emulation_matches_this_interpreter(items: list[Any]) -> None:
    lanes = [hash(x) for x in items]
    assert py_tuple_hash(lanes) == hash(tuple(items))
    for x in items:
        if isinstance(x, int):
            assert py_int_hash(x) == hash(x)


def test_py_hash_emulation_of_the_3_12_constant() -> None:
    # On 3.12+ hash(None) is 0xFCA86420, so hash((0, (0,), None)) is a constant too.
    assert py_tuple_hash((0, hash((0,)), PY312_NONE_HASH)) == -2674670255092364915


_CHILD = textwrap.dedent("""
    import json, logging, sys
    logging.disable(logging.CRITICAL)
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.multiprocess.token_hasher import TokenHasher
    from lmcache.v1.token_database import ChunkedTokenDatabase
    tokens = json.loads(sys.argv[1])
    mp = TokenHasher(16, "builtin").compute_chunk_hashes(tokens)
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, save_unfull_chunk=True)
    legacy = [h for _, _, h in ChunkedTokenDatabase(config).process_tokens(
        tokens=tokens, make_key=False)]
    print(json.dumps({"none": hash(None), "mp": [h.hex() for h in mp], "legacy": legacy}))
""")


def test_builtin_hash_across_processes() -> None:
    """LMCache in a child with PYTHONHASHSEED=0 (this process has another seed). Legacy
    builtin keys do not depend on the seed or the process; mp builtin keys depend on the
    child's hash(None) (address-based up to 3.11) and on nothing else."""
    tokens = [random.Random(11).randrange(150_000) for _ in range(100)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    child = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(tokens)], env=env,
                           capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(child.stdout.strip().splitlines()[-1])
    legacy = LMCacheKeySettings("m", key_format="legacy", chunk_size=16, save_unfull_chunk=True)
    assert chunk_hashes(legacy, tokens, implementation="native") == [
        f"{h:x}" for h in got["legacy"]]
    mp = LMCacheKeySettings("m", hash_algorithm="builtin", chunk_size=16,
                            builtin_none_hash=got["none"])
    assert resolve_implementation(mp) == ("lmcache" if got["none"] == hash(None) else "native")
    assert chunk_hashes(mp, tokens, implementation="native") == got["mp"]


# --- implementation choice ---------------------------------------------------------------


def test_auto_prefers_lmcache_and_falls_back_when_it_cannot_serve() -> None:
    s = LMCacheKeySettings("m", hash_algorithm="builtin")
    assert resolve_implementation(s) == "lmcache"
    foreign = replace(s, builtin_none_hash=hash(None) ^ 1)
    assert resolve_implementation(foreign) == "native"
    with pytest.raises(KvPrefetchError, match="builtin_none_hash"):
        resolve_implementation(foreign, "lmcache")
    with pytest.raises(KvPrefetchError, match="implementation"):
        resolve_implementation(s, "fast")


def test_kv_rank_matches_lmcache() -> None:
    from lmcache.v1.distributed.api import ObjectKey

    for world_size, rank in [(1, 0), (2, 1), (8, 5), (255, 254)]:
        assert kv_rank(world_size, rank) == ObjectKey.ComputeKVRank(
            world_size, rank, world_size, rank)


# --- bad settings ------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "kwargs"), [
    ("model_name", {"model_name": ""}),
    ("model_name", {"model_name": "a@b"}),
    ("key_format", {"key_format": "v2"}),
    ("chunk_size", {"chunk_size": 0}),
    ("chunk_size", {"chunk_size": 16.0}),
    ("chunk_size", {"chunk_size": True}),
    ("hash_algorithm", {"hash_algorithm": "md5"}),
    ("hash_algorithm", {"hash_algorithm": "blake3", "key_format": "legacy"}),
    ("world_size", {"world_size": 0}),
    ("world_size", {"world_size": 256}),
    ("worker_id", {"worker_id": 2, "world_size": 2}),
    ("worker_id", {"worker_id": -1}),
    ("cache_salt", {"cache_salt": "a/b"}),
    ("cache_salt", {"cache_salt": "a@b"}),
    ("cache_salt", {"cache_salt": "x" * 129}),
    ("cache_salt", {"cache_salt": "t", "key_format": "legacy"}),
    ("object_group_ids", {"object_group_ids": ()}),
    ("object_group_ids", {"object_group_ids": (-1,)}),
    ("object_group_ids", {"object_group_ids": 3}),
    ("object_group_ids", {"object_group_ids": (1,), "key_format": "legacy"}),
    ("tags", {"tags": (("a@b", "v"),), "key_format": "legacy"}),
    ("tags", {"tags": (("a", "v@w"),), "key_format": "legacy"}),
    ("tags", {"tags": (("a", 1),), "key_format": "legacy"}),
    ("tags", {"tags": (("a", "v"),)}),
    ("tags", {"tags": ("av",), "key_format": "legacy"}),
    ("kv_dtype", {"kv_dtype": "float17"}),
    ("use_mla", {"use_mla": 1}),
    ("save_unfull_chunk", {"save_unfull_chunk": True}),
    ("initial_hash", {"initial_hash": 1.5}),
    ("initial_hash", {"initial_hash": b""}),
    ("initial_hash", {"initial_hash": 2**63}),
    ("initial_hash", {"initial_hash": b"x", "key_format": "legacy"}),
    ("builtin_none_hash", {"builtin_none_hash": 1}),
    ("builtin_none_hash", {"builtin_none_hash": 2**64, "hash_algorithm": "builtin"}),
])
def test_bad_settings_name_the_field(field: str, kwargs: dict[str, Any]) -> None:
    kwargs = {"model_name": "m", **kwargs}
    with pytest.raises(ConfigError, match=rf"LMCacheKeySettings\.{field}\b"):
        LMCacheKeySettings(**kwargs)


def test_settings_accept_a_tag_mapping_and_a_group_list() -> None:
    s = LMCacheKeySettings("m", key_format="legacy", tags={"user": "a"})
    assert s.tags == (("user", "a"),) and s.hash_algorithm == "builtin"
    mp = LMCacheKeySettings("m", object_group_ids=[0, 1])
    assert mp.object_group_ids == (0, 1) and mp.hash_algorithm == "blake3"
    hash(mp)


@pytest.mark.parametrize("tokens", [[-1], [2**32], [1.5], ["7"], b"\x07\0\0\0",
                                    np.asarray([1.0]), np.asarray([-3]),
                                    np.zeros((2, 2), dtype=np.int64)])
@pytest.mark.parametrize("algorithm", MP_ALGORITHMS)
def test_bad_token_ids(tokens: Any, algorithm: str) -> None:
    s = LMCacheKeySettings("m", hash_algorithm=algorithm, chunk_size=1)
    with pytest.raises(KvPrefetchError, match="token ids"):
        chunk_hashes(s, tokens, implementation="native")


def test_bad_key_styles() -> None:
    legacy = LMCacheKeySettings("m", key_format="legacy")
    with pytest.raises(KvPrefetchError, match="style"):
        object_keys(legacy, [], style="fs")
    with pytest.raises(KvPrefetchError, match="key_prefix"):
        object_keys(LMCacheKeySettings("m"), [], key_prefix="a@b")
    with pytest.raises(KvPrefetchError, match="style"):
        object_keys(LMCacheKeySettings("m"), [], style="s3")


# --- tenants ------------------------------------------------------------------------------


def test_tenant_salts_keep_tenants_apart_and_match_lmcache() -> None:
    """Each tenant's KV is keyed under its own cache salt: equal tokens of two
    tenants share no key, the keys are LMCache's own for that salt, and the default
    tenant's keys are exactly the unsalted ones."""
    tokens = list(range(5000, 5000 + 4 * 16 + 5))
    base = LMCacheKeySettings("Qwen/Qwen3-32B", chunk_size=16, world_size=2)
    keys: dict[str, list[str]] = {}
    for tenant in ("default", "acme", "glob@x", "globex"):
        s = replace(base, cache_salt=tenant_cache_salt(tenant))
        assert_mp_parity(s, tokens)  # LMCache accepts the salt and names the same keys
        keys[tenant] = object_keys(s, tokens)
    assert keys["default"] == object_keys(base, tokens)  # byte-identical to before
    for a, b in [("default", "acme"), ("acme", "globex"), ("acme", "glob@x")]:
        assert not set(keys[a]) & set(keys[b]), (a, b)
    # a node's base salt keeps the default tenant's keys as they were with that salt
    salted = replace(base, cache_salt="node-secret")
    assert tenant_cache_salt("default", "node-secret") == "node-secret"
    assert object_keys(replace(base, cache_salt=tenant_cache_salt("acme", "node-secret")),
                       tokens) != keys["acme"] != object_keys(salted, tokens)
