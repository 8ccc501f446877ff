"""The LMCache L2 adapter plugin against real Valkey and S3 on loopback: LMCache's contract
(three distinct event fds signalled on completion, non-blocking submits, per-key bitmaps,
thread safety, usage), loading through LMCache's own plugin factory, ``lmcache bench l2
--no-skip-verify``, and objects listed by a real ``lmcache server``'s ``GET /cache/objects``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import (
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
)

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey, free_port
from kvprefetch.agents.lmcache.l2.adapter import (
    KvPrefetchL2Adapter,
    load_params,
    object_key_name,
    parse_object_key_name,
    plugin_adapter_json,
)
from kvprefetch.agents.lmcache.server import LMCacheServer
from kvprefetch.agents.stores.errors import StoreConfigError, StoreConnectionError

pytestmark = pytest.mark.servers
KIB = 1024
MIB = 1 << 20
WAIT_S = 20.0


# -- helpers --------------------------------------------------------------------------------


def params(valkey: EmbeddedValkey | None, s3: EmbeddedS3 | None, prefix: str,
           **extra: Any) -> dict[str, Any]:
    """adapter_params for the session's servers (``None`` leaves a tier out)."""
    p: dict[str, Any] = {"key_prefix": prefix, **extra}
    if valkey is not None:
        p["valkey"] = {"host": valkey.host, "port": valkey.port, "key_prefix": "kvp:",
                       "part_bytes": 256 * KIB, "connect_timeout_s": 0.5}
    if s3 is not None:
        p["s3"] = {"bucket": s3.bucket, "endpoint_url": s3.endpoint_url, "region": "us-east-1",
                   "access_key_id": s3.access_key_id,
                   "secret_access_key": s3.secret_access_key, "key_prefix": "kvp/",
                   "part_bytes": 256 * KIB, "range_bytes": 512 * KIB}
    return p


@pytest.fixture
def adapter(valkey_server: EmbeddedValkey, s3_server: EmbeddedS3,
            key_prefix: str) -> Iterator[KvPrefetchL2Adapter]:
    a = KvPrefetchL2Adapter(params(valkey_server, s3_server, key_prefix))
    yield a
    a.close()


def keys(n: int, model: str = "test-model", start: int = 0, salt: str = "") -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=(start + i).to_bytes(16, "big"), model_name=model,
                      kv_rank=start + i, cache_salt=salt) for i in range(n)]


def memory_objects(sizes: Sequence[int], fill: bytes | None = None) -> list[TensorMemoryObj]:
    """CPU memory objects as LMCache's L1 hands them out, random bytes unless ``fill``."""
    out = []
    for size in sizes:
        data = bytearray(fill * size if fill is not None else os.urandom(size))
        tensor = torch.frombuffer(data, dtype=torch.uint8)
        meta = MemoryObjMetadata(shape=torch.Size([size]), dtype=torch.uint8, address=0,
                                 phy_size=size, fmt=MemoryFormat.KV_2LTD, ref_count=1)
        out.append(TensorMemoryObj(raw_data=tensor, metadata=meta, parent_allocator=None))
    return out


def content(obj: TensorMemoryObj) -> bytes:
    return bytes(obj.byte_array)


def readable(fd: int, timeout_s: float = 0.0) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        os.eventfd_read(fd)


def wait_result(fd: int, query: Callable[[], Any]) -> Any:
    """Poll ``fd`` until ``query`` answers (as LMCache's controllers do)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if readable(fd, 1.0):
            drain(fd)
        result = query()
        if result is not None and result != {}:
            return result
    raise AssertionError("the task did not complete")


def store(a: KvPrefetchL2Adapter, ks: list[ObjectKey], objs: list[TensorMemoryObj]) -> Any:
    tid = a.submit_store_task(ks, objs)
    done = wait_result(a.get_store_event_fd(), a.pop_completed_store_tasks)
    assert tid in done
    return done[tid]


def lookup(a: KvPrefetchL2Adapter, ks: list[ObjectKey]) -> list[bool]:
    tid = a.submit_lookup_and_lock_task(ks, {})
    bitmap = wait_result(a.get_lookup_and_lock_event_fd(),
                         lambda: a.query_lookup_and_lock_result(tid))
    return [bitmap.test(i) for i in range(len(ks))]


def load(a: KvPrefetchL2Adapter, ks: list[ObjectKey], objs: list[TensorMemoryObj]) -> list[bool]:
    tid = a.submit_load_task(ks, objs)
    bitmap = wait_result(a.get_load_event_fd(), lambda: a.query_load_result(tid))
    return [bitmap.test(i) for i in range(len(ks))]


class GatedStore:
    """Wraps the adapter's real store; every call waits until the gate opens (to show that
    submits return before the work is done)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.name = inner.name

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in ("put", "get", "exists", "delete"):
            return attr

        def gated(*args: Any, **kwargs: Any) -> Any:
            assert self.gate.wait(WAIT_S)
            return attr(*args, **kwargs)

        return gated


# -- the contract ---------------------------------------------------------------------------


def test_three_distinct_fds_each_signalled_by_its_own_operation(
        adapter: KvPrefetchL2Adapter) -> None:
    fds = [adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(),
           adapter.get_load_event_fd()]
    assert len(set(fds)) == 3
    assert not any(readable(fd) for fd in fds)
    ks, objs = keys(2), memory_objects([300 * KIB, 300 * KIB])
    tid = adapter.submit_store_task(ks, objs)
    assert readable(fds[0], WAIT_S) and not readable(fds[1]) and not readable(fds[2])
    drain(fds[0])
    assert adapter.pop_completed_store_tasks() == {tid: 2 * 300 * KIB}
    assert adapter.pop_completed_store_tasks() == {}
    tid = adapter.submit_lookup_and_lock_task(ks, {})
    assert readable(fds[1], WAIT_S) and not readable(fds[0]) and not readable(fds[2])
    drain(fds[1])
    bitmap = adapter.query_lookup_and_lock_result(tid)
    assert bitmap is not None and bitmap.popcount() == 2
    assert adapter.query_lookup_and_lock_result(tid) is None  # answered once
    adapter.submit_unlock(ks)
    tid = adapter.submit_load_task(ks, memory_objects([300 * KIB, 300 * KIB], b"\0"))
    assert readable(fds[2], WAIT_S) and not readable(fds[0]) and not readable(fds[1])
    drain(fds[2])
    bitmap = adapter.query_load_result(tid)
    assert bitmap is not None and bitmap.popcount() == 2
    assert adapter.query_load_result(tid) is None
    second = KvPrefetchL2Adapter(adapter.params)
    try:  # fds are distinct across adapters too (LMCache maps fd -> adapter)
        assert not {second.get_store_event_fd(), second.get_lookup_and_lock_event_fd(),
                    second.get_load_event_fd()} & set(fds)
    finally:
        second.close()


def test_submits_return_before_the_work_is_done(adapter: KvPrefetchL2Adapter) -> None:
    gated, gated_valkey = GatedStore(adapter.store), GatedStore(adapter._stores.valkey)
    # Lookups ask Valkey directly.
    adapter._stores.store, adapter._stores.valkey = gated, gated_valkey
    ks, objs = keys(3), memory_objects([200 * KIB] * 3)
    started = time.monotonic()
    store_id = adapter.submit_store_task(ks, objs)
    lookup_id = adapter.submit_lookup_and_lock_task(ks, {})
    load_id = adapter.submit_load_task(ks, memory_objects([200 * KIB] * 3, b"\0"))
    assert time.monotonic() - started < 0.5
    assert len({store_id, lookup_id, load_id}) == 3
    time.sleep(0.2)
    assert adapter.pop_completed_store_tasks() == {}
    assert adapter.query_lookup_and_lock_result(lookup_id) is None
    assert adapter.query_load_result(load_id) is None
    assert not readable(adapter.get_store_event_fd())
    gated.gate.set()
    gated_valkey.gate.set()
    assert wait_result(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)
    adapter._stores.store, adapter._stores.valkey = gated.inner, gated_valkey.inner


def test_round_trip_is_byte_exact_and_bitmaps_are_per_key(
        adapter: KvPrefetchL2Adapter) -> None:
    # Striped (several 256 KiB parts, received straight into the object), inline (one
    # part) and tiny objects; the middle key is never stored.
    sizes = [1 * MIB + 123, 100 * KIB, 7]
    ks = keys(4)
    present = [ks[0], ks[1], ks[3]]
    objs = memory_objects(sizes)
    result = store(adapter, present, objs)
    assert result.is_successful() and result.bytes_transferred() == sum(sizes)
    assert lookup(adapter, ks) == [True, True, False, True]
    adapter.submit_unlock(ks)
    dest = memory_objects([sizes[0], sizes[1], 50, sizes[2]], b"\xee")
    assert load(adapter, ks, dest) == [True, True, False, True]
    for i, j in ((0, 0), (1, 1), (3, 2)):
        assert content(dest[i]) == content(objs[j])
    assert content(dest[2]) == b"\xee" * 50  # a miss leaves the buffer alone
    # A destination of another size is a miss, not a partial copy.
    wrong = memory_objects([sizes[0] - 1], b"\x01")
    assert load(adapter, [ks[0]], wrong) == [False]
    # The same key twice in one task: both objects get it.
    twice = memory_objects([sizes[1], sizes[1]], b"\0")
    assert load(adapter, [ks[1], ks[1]], twice) == [True, True]
    assert content(twice[0]) == content(twice[1]) == content(objs[1])


def test_concurrent_submits_from_several_threads(adapter: KvPrefetchL2Adapter) -> None:
    errors: list[BaseException] = []
    task_ids: list[int] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        try:
            ks = keys(6, model=f"thread-{n}")
            objs = memory_objects([64 * KIB + n] * 6)
            tid = adapter.submit_store_task(ks, objs)
            # Several threads share one store fd: each keeps popping until it sees its id.
            deadline = time.monotonic() + WAIT_S
            mine = None
            while mine is None and time.monotonic() < deadline:
                time.sleep(0.01)
                with lock:
                    done = adapter.pop_completed_store_tasks()
                    finished.update(done)
                    mine = finished.pop(tid, None)
            assert mine is not None and mine.is_successful()
            dest = memory_objects([64 * KIB + n] * 6, b"\0")
            lid = adapter.submit_load_task(ks, dest)
            bitmap = None
            while bitmap is None and time.monotonic() < deadline:
                time.sleep(0.01)
                bitmap = adapter.query_load_result(lid)
            assert bitmap is not None and bitmap.popcount() == 6
            assert [content(d) for d in dest] == [content(o) for o in objs]
            with lock:
                task_ids.extend([tid, lid])
        except BaseException as exc:
            errors.append(exc)

    finished: dict[int, Any] = {}
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    assert not errors, errors
    assert len(task_ids) == len(set(task_ids)) == 12


def test_usage_locks_and_delete(adapter: KvPrefetchL2Adapter) -> None:
    ks = keys(2, salt="alice") + keys(1, model="other", start=10, salt="bob")
    objs = memory_objects([100 * KIB, 200 * KIB, 50 * KIB])
    store(adapter, ks, objs)
    usage = adapter.get_usage()
    assert usage.total_bytes_used == 350 * KIB
    assert dict(usage.bytes_by_cache_salt) == {"alice": 300 * KIB, "bob": 50 * KIB}
    assert usage.total_capacity_bytes == 0 and usage.usage_fraction == -1.0
    store(adapter, ks[:1], objs[:1])  # the same key again is not counted twice
    assert adapter.get_usage().total_bytes_used == 350 * KIB
    status = adapter.report_status()
    assert status["is_healthy"] and status["tiers"] == {"valkey": True, "s3": True}
    assert status["stored_keys"] == 3 and status["current_size_bytes"] == 350 * KIB
    # A looked-up (locked) key survives delete until it is unlocked.
    assert lookup(adapter, ks[:1]) == [True]
    adapter.delete(ks)
    assert lookup(adapter, ks) == [True, False, False]
    assert adapter.get_usage().total_bytes_used == 100 * KIB
    adapter.submit_unlock(ks[:1])
    adapter.submit_unlock(ks[:1])
    adapter.delete(ks[:1])
    assert lookup(adapter, ks) == [False, False, False]
    assert adapter.get_usage().total_bytes_used == 0


def test_capacity_is_reported(valkey_server: EmbeddedValkey, key_prefix: str) -> None:
    a = KvPrefetchL2Adapter(params(valkey_server, None, key_prefix, max_capacity_gb=0.5))
    try:
        store(a, keys(1), memory_objects([1 * MIB]))
        usage = a.get_usage()
        assert a.supports_global_eviction
        assert usage.total_capacity_bytes == 512 * MIB and usage.usage_fraction == 1 / 512
    finally:
        a.close()


def test_load_bandwidth_emulates_the_node_link(valkey_server: EmbeddedValkey,
                                               key_prefix: str) -> None:
    """With ``load_bandwidth_mib_s`` a load completes no sooner than the link would carry
    its bytes (the demo's emulated ingress link); the bytes are still exact."""
    a = KvPrefetchL2Adapter(params(valkey_server, None, key_prefix, load_bandwidth_mib_s=8))
    try:
        ks, objs = keys(4), memory_objects([1 * MIB] * 4)
        store(a, ks, objs)
        dest = memory_objects([1 * MIB] * 4, fill=b"\0")
        started = time.monotonic()
        assert load(a, ks, dest) == [True] * 4
        elapsed = time.monotonic() - started
        assert 0.45 <= elapsed < 5.0, elapsed  # 4 MiB at 8 MiB/s, less a 64 KiB burst
        assert [content(d) for d in dest] == [content(o) for o in objs]
    finally:
        a.close()


# -- listing --------------------------------------------------------------------------------


@pytest.mark.parametrize("tiers", ["valkey+s3", "valkey"])
def test_list_l2_keys_pages_and_filters_by_model(
        tiers: str, valkey_server: EmbeddedValkey, s3_server: EmbeddedS3,
        key_prefix: str) -> None:
    a = KvPrefetchL2Adapter(params(valkey_server, s3_server if "s3" in tiers else None,
                                   key_prefix))
    try:
        ks = keys(3, model="org/model-a") + keys(2, model="model-b", salt="s1")
        sizes = [300 * KIB, 5, 70 * KIB, 1 * MIB, 1]
        store(a, ks, memory_objects(sizes))
        seen: dict[ObjectKey, int] = {}
        cursor, pages = None, 0
        while True:
            page = a.list_l2_keys(page_size=2, cursor=cursor)
            assert len(page.entries) <= 2
            pages += 1
            seen.update((e.key.to_object_key(), e.size_bytes) for e in page.entries)
            cursor = page.next_page_token
            if cursor is None:
                break
        assert seen == dict(zip(ks, sizes, strict=True)) and pages >= 3
        only_a = a.list_l2_keys(model_name="org/model-a")
        assert {e.key.to_object_key() for e in only_a.entries} == set(ks[:3])
        with pytest.raises(ValueError):
            a.list_l2_keys(cursor="bogus")
    finally:
        a.close()


def test_object_names_round_trip() -> None:
    k = ObjectKey(chunk_hash=b"\x01\xff" * 8, model_name="meta-llama/Llama-3.1-8B",
                  kv_rank=0x1234, object_group_id=3, cache_salt="tenant-7")
    name = object_key_name(k)
    assert name == "meta-llama/Llama-3.1-8B@00001234@3@" + "01ff" * 8 + "@tenant-7"
    assert parse_object_key_name(name) == k
    assert parse_object_key_name(object_key_name(keys(1)[0])) == keys(1)[0]
    for bad in ("a@b", "m@zz@0@00", "m@1@0@0g"):
        with pytest.raises(ValueError):
            parse_object_key_name(bad)


# -- parameters and loading -----------------------------------------------------------------


@pytest.mark.parametrize(("bad", "names"), [
    ({}, "give a 'valkey' section"),
    ({"valkey": {"port": 70000}}, "adapter_params.valkey.port"),
    ({"valkey": {"passwrd": "x"}}, "adapter_params.valkey.passwrd"),
    ({"s3": {"endpoint_url": "http://x"}}, "adapter_params.s3.bucket"),
    ({"valkey": {}, "workers": 0}, "adapter_params.workers"),
    ({"valkey": {}, "key_prefix": "a*b"}, "adapter_params.key_prefix"),
    ({"valkey": {}, "tiered": {"write_mode": "sometimes"}}, "adapter_params.tiered.write_mode"),
    ({"valkey": {}, "bucket": "kv"}, "adapter_params.bucket"),
])
def test_bad_params_name_the_field(bad: dict[str, Any], names: str) -> None:
    with pytest.raises(StoreConfigError, match=names.replace(".", r"\.")):
        KvPrefetchL2Adapter(bad)
    with pytest.raises(StoreConfigError, match=names.replace(".", r"\.")):
        plugin_adapter_json(**bad)


def test_unreachable_single_tier_fails_at_construction() -> None:
    with pytest.raises(StoreConnectionError):
        KvPrefetchL2Adapter({"valkey": {"port": free_port(), "connect_timeout_s": 0.3}})


def test_the_l2_package_builds_the_plugin_json_without_importing_lmcache() -> None:
    """The harness and the deployment tools build the plugin JSON from the package; only
    the adapter that LMCache loads by its ``module_path`` imports LMCache."""
    code = ("import sys\n"
            "from kvprefetch.agents.lmcache.l2 import MODULE_PATH, plugin_adapter_json\n"
            "spec = plugin_adapter_json(valkey={'host': '127.0.0.1', 'port': 6379})\n"
            "assert spec['module_path'] == MODULE_PATH == 'kvprefetch.agents.lmcache.l2.adapter'\n"
            "assert 'lmcache' not in sys.modules, 'lmcache imported'\n"
            "import kvprefetch.agents.lmcache.l2.adapter as adapter\n"
            "assert adapter.KvPrefetchL2Adapter.__name__ == spec['class_name']\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_plugin_json_loads_through_lmcaches_own_factory(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str) -> None:
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    spec = plugin_adapter_json(valkey=valkey_server.store_config(key_prefix="kvp:"),
                               s3=s3_server.store_config(key_prefix="kvp/"),
                               key_prefix=key_prefix, workers=2)
    assert spec["module_path"] == "kvprefetch.agents.lmcache.l2.adapter"
    assert spec["adapter_params"]["s3"]["secret_access_key"] == s3_server.secret_access_key
    assert spec["adapter_params"]["valkey"]["part_bytes"] == 1 * MIB  # the adapter's default
    text = json.dumps(spec)  # what users paste after --l2-adapter
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[text]))
    a = create_l2_adapter(config.adapters[0])
    try:
        assert isinstance(a, KvPrefetchL2Adapter)
        assert a.params == load_params(spec["adapter_params"])
        ks, objs = keys(1), memory_objects([2 * MIB + 1])
        assert store(a, ks, objs).is_successful()
        dest = memory_objects([2 * MIB + 1], b"\0")
        assert load(a, ks, dest) == [True] and content(dest[0]) == content(objs[0])
    finally:
        a.close()


def test_write_back_store_copies_and_reaches_s3_on_close(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str) -> None:
    p = params(valkey_server, s3_server, key_prefix, tiered={"write_mode": "write-back"})
    a = KvPrefetchL2Adapter(p)
    ks, objs = keys(2), memory_objects([600 * KIB, 3 * KIB])
    expected = [content(o) for o in objs]
    try:
        assert store(a, ks, objs).is_successful()
        for o in objs:  # LMCache may reuse the memory once the task completed
            o.raw_data.fill_(0)
    finally:
        a.close()  # flushes the background S3 writes
    s3_only = KvPrefetchL2Adapter(params(None, s3_server, key_prefix))
    try:
        dest = memory_objects([600 * KIB, 3 * KIB], b"\0")
        assert load(s3_only, ks, dest) == [True, True]
        assert [content(d) for d in dest] == expected
    finally:
        s3_only.close()


# -- LMCache itself -------------------------------------------------------------------------


def test_kvprefetch_bench_lmcache_runs_lmcache_bench_l2_verified(tmp_path: Path) -> None:
    """``kvprefetch bench lmcache`` (small sizes): ``lmcache bench l2 --no-skip-verify`` for
    our plugin, LMCache's valkey and LMCache's s3 adapters, all verified."""
    from kvprefetch.controlplane.cli import bench_lmcache

    parser = argparse.ArgumentParser()
    bench_lmcache.add_arguments(parser)
    out = tmp_path / "lmcache.json"
    args = parser.parse_args(["--data-size-kb", "512", "--num-keys", "4", "--rounds", "1",
                              "--repeats", "1", "--warmup-runs", "1", "--json", str(out),
                              "--no-progress"])
    assert bench_lmcache.run(args) == 0
    result = json.loads(out.read_text())
    assert set(result["adapters"]) == {"kvprefetch", "lmcache-valkey", "lmcache-s3"}
    for row in result["adapters"].values():
        assert row["verified"] is True
        # The warm-up run is reported apart and not in the figures.
        assert [r["repeat"] for r in row["warmup_runs"]] == [-1]
        assert [r["repeat"] for r in row["runs"]] == [0]
        assert row["store_mib_s"] > 0 and row["load_mib_s"] > 0
        assert row["runs"][0]["load_keys_ok"] == row["runs"][0]["keys"] == 4
    assert result["speedup_vs_lmcache_valkey"] > 0 and result["raw_get_loop_mib_s"] > 0
    assert all(row["lookup_p99_ms"] > 0 for row in result["adapters"].values())
    assert result["lookup_ratio_vs_lmcache_valkey"] > 0
    # Write-back (the default): the backlog drained by a restart, every key then read back
    # from S3 alone, after each run and, at the end, with our Valkey keys flushed.
    wb = result["adapters"]["kvprefetch"]["write_back"]
    assert wb["s3_alone_verified"] is True and wb["lost_keys"] == 0
    assert wb["s3_alone_keys_ok"] == wb["s3_alone_keys"] == 2 * 4  # warm-up + 1 round
    final = wb["after_valkey_flush"]
    assert final["valkey_flushed"] and final["valkey_keys_flushed"] > 0
    assert final["s3_alone_keys_ok"] == final["s3_alone_keys"] == 8
    assert final["backlog_at_exit_keys"] == 0 and final["drained"]


def test_lmcache_server_lists_our_objects(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str) -> None:
    """A real ``lmcache server`` with our adapter as its L2: objects stored under LMCache's
    keys (here through the adapter in this process, into the same stores and namespace) are
    listed by ``GET /cache/objects`` and deleted by ``DELETE /cache/objects``."""
    import httpx

    p = params(valkey_server, s3_server, key_prefix)
    here = KvPrefetchL2Adapter(p)
    try:
        ks = keys(3, model="served-model")
        store(here, ks, memory_objects([256 * KIB, 256 * KIB, 10]))
        with LMCacheServer(l2_adapter=plugin_adapter_json(**p)) as server:
            listed = server.get_json("/cache/objects?model_name=served-model")
            assert listed["adapter"] == "plugin"
            got = {(e["key"]["chunk_hash_hex"], e["key"]["kv_rank"]): e["size_bytes"]
                   for e in listed["entries"]}
            assert got == {(k.chunk_hash.hex(), k.kv_rank): s
                           for k, s in zip(ks, [256 * KIB, 256 * KIB, 10], strict=True)}
            gone = httpx.request("DELETE", f"{server.http_url}/cache/objects", json={
                "tier": "l2", "keys": [listed["entries"][0]["key"]]}, timeout=10.0)
            assert gone.status_code == 200 and gone.json()["ok"] is True
            again = server.get_json("/cache/objects?model_name=served-model")
            assert len(again["entries"]) == 2
    finally:
        here.close()
