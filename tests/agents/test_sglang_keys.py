"""Page-hash parity with the installed SGLang (0.5.23): our page hashes and object names
equal SGLang's own, byte for byte, on random token sequences. A key that differs by one
byte misses silently, so parity is tested, not assumed.

The reference is SGLang's ``get_hash_str`` (its C++ extension, compiled on first use with
g++ and libcrypto), ``get_storage_hash_str`` with a request namespace, and the object-name
suffix of its file backend ``HiCacheFile``. SGLang is imported by a module fixture (a run
that selects none of these tests does not import it); the project's test install has it
(``make setup-sglang``), so a missing SGLang fails these tests. Set
``KVPREFETCH_SGLANG_OPTIONAL=1`` to turn that into a visible skip on a machine set up
without it.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang_guard import sglang_missing

from kvprefetch.agents.sglang.keys import PageKeyScheme, namespace_seed, page_hashes
from kvprefetch.controlplane.base.keys import tenant_cache_salt

CASES = 120


@pytest.fixture(scope="module")
def sgl() -> SimpleNamespace:
    """SGLang's own functions, imported by the first test that compares with them rather
    than at collection, so that a run which selects none of them does not import SGLang."""
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
        from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed
    except ImportError as exc:  # pragma: no cover - the environment decides
        sglang_missing(exc)
    return SimpleNamespace(HiCacheFile=HiCacheFile, HiCacheStorageConfig=HiCacheStorageConfig,
                           get_hash_str=get_hash_str,
                           storage_namespace_seed=storage_namespace_seed)


def _sequence(rng: random.Random) -> tuple[list[int], int]:
    page_size = rng.choice([1, 2, 16, 32, 64, 128])
    n = rng.randrange(0, 6 * page_size + 3)
    top = rng.choice([2**17, 2**32 - 1, 2**40])  # 2**40: the wide (uint64) page encoding
    return [rng.randrange(0, top) for _ in range(n)], page_size


def test_page_hashes_equal_sglangs_on_random_sequences(sgl: SimpleNamespace) -> None:
    rng = random.Random(13)
    wide = partial = 0
    for _ in range(CASES):
        tokens, page_size = _sequence(rng)
        ours = page_hashes(tokens, page_size)
        theirs = sgl.get_hash_str(tokens, None, page_size=page_size)
        assert ours == theirs, (tokens[:8], page_size)
        assert all(len(h) == 64 for h in ours)
        wide += any(t > 2**32 - 1 for t in tokens)
        partial += len(tokens) % page_size != 0
    assert wide >= 10 and partial >= 10  # both encodings and partial pages were covered


def test_chains_continue_from_a_prior_hash(sgl: SimpleNamespace) -> None:
    rng = random.Random(7)
    for _ in range(CASES):
        tokens, page_size = _sequence(rng)
        prior = rng.getrandbits(256).to_bytes(32, "little").hex()
        assert page_hashes(tokens, page_size, prior_hash=prior) == sgl.get_hash_str(
            tokens, prior, page_size=page_size)
        # Hashing in two steps (a batch boundary) equals hashing at once.
        cut = (len(tokens) // page_size // 2) * page_size
        head = page_hashes(tokens[:cut], page_size)
        tail = page_hashes(tokens[cut:], page_size, prior_hash=head[-1] if head else None)
        assert head + tail == page_hashes(tokens, page_size)


@pytest.mark.parametrize("extra_key,cache_salt", [
    ("lora-a", None), (None, "tenant-7"), ("", ""), ("ключ", "salt"),
])
def test_namespaced_chains_equal_sglangs(extra_key: str | None, cache_salt: str | None,
                                         sgl: SimpleNamespace) -> None:
    assert namespace_seed(extra_key, cache_salt) == sgl.storage_namespace_seed(extra_key,
                                                                           cache_salt)
    tokens = list(range(1000, 1300))
    seed = sgl.storage_namespace_seed(extra_key, cache_salt)
    assert page_hashes(tokens, 64, extra_key=extra_key, cache_salt=cache_salt) == \
        sgl.get_hash_str(tokens, seed, page_size=64)
    assert page_hashes(tokens, 64, cache_salt=cache_salt, extra_key=extra_key) != \
        page_hashes(tokens, 64)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        page_hashes([1, -2], 4)
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        page_hashes([1, 2], 2, prior_hash="abcd")


@pytest.mark.parametrize("mla,pp,cp", [(False, 1, 1), (True, 1, 1), (False, 2, 1),
                                       (False, 1, 2), (True, 2, 2)])
def test_object_names_follow_sglangs_file_backend(tmp_path: Path, mla: bool, pp: int,
                                                  cp: int, sgl: SimpleNamespace) -> None:
    config = sgl.HiCacheStorageConfig(
        tp_rank=1, tp_size=4, pp_rank=pp - 1, pp_size=pp, attn_cp_rank=cp - 1,
        attn_cp_size=cp, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=True, model_name="meta-llama/Llama-3.1-8B-Instruct",
        extra_config={"file_storage_path": str(tmp_path)})
    reference = sgl.HiCacheFile(config)
    scheme = PageKeyScheme.from_storage_config(config)
    h = page_hashes([5, 6, 7, 8], 4)[0]
    assert scheme.object_name(h) == "sglang/" + reference._get_suffixed_key(h)
    names = scheme.object_names(list(range(10)), 4)
    assert len(names) == 2 and len(set(names)) == 2  # full pages only, distinct
    assert PageKeyScheme.from_storage_config(SimpleNamespace(
        model_name=None, tp_rank=0, tp_size=1, is_mla_model=False, pp_rank=0,
        pp_size=1)).suffix == "__0_1"


def test_tenant_salts_are_sglang_namespaces_and_keep_tenants_apart(
        sgl: SimpleNamespace) -> None:
    """A tenant's pages are named under its cache salt as SGLang names a request that
    carries it; the default tenant's, with no salt, exactly as before."""
    tokens = list(range(1000, 1300))
    names = {}
    for tenant in ("default", "acme", "globex"):
        salt = tenant_cache_salt(tenant) or None
        seed = sgl.storage_namespace_seed(None, salt)
        names[tenant] = page_hashes(tokens, 64, cache_salt=salt)
        assert names[tenant] == sgl.get_hash_str(tokens, seed, page_size=64)
    assert names["default"] == page_hashes(tokens, 64) == sgl.get_hash_str(tokens, None,
                                                                        page_size=64)
    assert not set(names["acme"]) & set(names["globex"])
    assert not set(names["acme"]) & set(names["default"])
