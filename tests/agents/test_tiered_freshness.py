"""An acknowledged overwrite is never followed by an older value (Valkey over S3, real
servers): promotions racing puts, Valkey stalled or restarted during puts, write-back
uploads overtaken by evictions, random interleavings of puts, evictions, reads and Valkey
faults. A second store over the same servers stands for a reader in another process: it
shares nothing with the writer but the servers.

``KVP_FRESHNESS_OPS`` sets the length of the random runs (1,500 in the suite) and
``KVP_WRITE_BACK_OPS`` that of the write-back run read from two processes (10,000).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.stores.base import Buffer, OpResult
from kvprefetch.agents.stores.errors import HotTierDownError, StoreError
from kvprefetch.agents.stores.s3.store import S3Store
from kvprefetch.agents.stores.tiered import TieredStore, TieredStoreConfig
from kvprefetch.agents.stores.valkey.store import ValkeyStore

pytestmark = pytest.mark.servers
KIB = 1024
#: An append-only file fsynced on every write: pinned values are confirmed at once.
AOF_ARGS = ("--appendonly", "yes", "--appendfsync", "always",
            "--maxmemory-policy", "volatile-lru")


def make(valkey: EmbeddedValkey, s3: EmbeddedS3, prefix: str, **cfg: Any) -> TieredStore:
    hot = ValkeyStore(valkey.store_config(key_prefix=prefix, part_bytes=16 * KIB,
                                          connect_timeout_s=0.25, socket_timeout_s=0.25))
    cold = S3Store(s3.store_config(key_prefix=prefix, part_bytes=16 * KIB,
                                   range_bytes=64 * KIB, connect_timeout_s=0.5,
                                   read_timeout_s=5.0, max_attempts=1))
    cfg.setdefault("retry_down_after_s", 0.2)
    return TieredStore(hot, cold, TieredStoreConfig(**cfg))


def hot_of(store: TieredStore) -> ValkeyStore:
    assert isinstance(store.hot, ValkeyStore)
    return store.hot


class GatedFills:
    """Holds every fill (promotion or hot repair) until ``release``: the race is forced."""

    def __init__(self, hot: ValkeyStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self._fill = hot.fill
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.answers: list[OpResult] = []
        monkeypatch.setattr(hot, "fill", self)

    def __call__(self, items: Sequence[tuple[str, Buffer, bytes]], *,
                 ttl_s: float | None = None) -> list[OpResult]:
        self.entered.set()
        assert self.gate.wait(30)
        out = self._fill(items, ttl_s=ttl_s)
        self.answers += out
        return out

    def release(self) -> None:
        self.gate.set()


def read(store: TieredStore, key: str) -> bytes | None:
    r = store.get([key])[0]
    return bytes(r.data or b"") if r.ok else None


@pytest.fixture
def private_valkey(dram_dir: Path) -> Iterator[EmbeddedValkey]:
    """A private Valkey that keeps an append-only file (in memory, ``dram_dir``), as
    write-back's pinned values need (see :class:`TieredStoreConfig`)."""
    dram_dir.mkdir(parents=True, exist_ok=True)
    with EmbeddedValkey(extra_args=(*AOF_ARGS, "--dir", str(dram_dir))) as server:
        yield server


def _pid(server: EmbeddedValkey) -> int:
    proc = server._proc  # the test stalls the very process it started
    assert proc is not None
    return proc.pid


@pytest.mark.parametrize("size", [3 * KIB, 40 * KIB])  # one inline value; three stripes
def test_a_promotion_never_lands_after_a_newer_put(
    valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch, size: int,
) -> None:
    """Put v1, evict it from Valkey, read it (its promotion held), put v2, let the
    promotion run: v2 is read, every time, from either tier."""
    store = make(valkey_server, s3_server, key_prefix, hot_ttl_s=60.0)
    store.start()
    gate = GatedFills(hot_of(store), monkeypatch)
    try:
        v1, v2 = os.urandom(size), os.urandom(size)
        assert store.put([("k", v1)])[0].ok
        store.hot.delete(["k"])  # evicted
        assert read(store, "k") == v1  # from S3; the promotion waits at the gate
        assert gate.entered.wait(10)
        assert store.put([("k", v2)])[0].ok
        gate.release()
        store.flush()
        assert [a.ok for a in gate.answers] == [False]
        assert {read(store, "k") for _ in range(20)} == {v2}
        store.hot.delete(["k"])  # evicted again: S3 serves v2 and promotes it
        assert read(store, "k") == v2
        store.flush()
        assert store.get(["k"])[0].source == "valkey" and read(store, "k") == v2
    finally:
        gate.release()
        store.delete(["k"])
        store.close()


def test_a_promotion_never_lands_after_a_newer_put_that_was_evicted(
    valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The newer version leaves Valkey before the old promotion runs: the key then holds
    nothing, yet the promotion must still not write v1 (its lease went with the put)."""
    store = make(valkey_server, s3_server, key_prefix)
    store.start()
    gate = GatedFills(hot_of(store), monkeypatch)
    try:
        v1, v2 = os.urandom(5 * KIB), os.urandom(5 * KIB)
        assert store.put([("k", v1)])[0].ok
        store.hot.delete(["k"])
        assert read(store, "k") == v1
        assert gate.entered.wait(10)
        assert store.put([("k", v2)])[0].ok
        store.hot.delete(["k"])  # v2 evicted before the old promotion runs
        gate.release()
        store.flush()
        assert [a.ok for a in gate.answers] == [False]
        assert {read(store, "k") for _ in range(20)} == {v2}
    finally:
        gate.release()
        store.delete(["k"])
        store.close()


def test_promotions_fill_valkey_when_nothing_overwrites(
    valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str,
) -> None:
    """The lease is no obstacle to an ordinary promotion, and a pending one reads as a
    miss in Valkey (exists and get), never as a broken object."""
    store = make(valkey_server, s3_server, key_prefix)
    store.start()
    hot = hot_of(store)
    try:
        payload = os.urandom(40 * KIB)
        store.cold.put([("k", payload)])
        marker = hot.lease(["k"], ttl_s=5.0)[0]
        assert marker is not None and hot.lease(["k"], ttl_s=5.0) == [None]
        assert not hot.exists(["k"])[0].ok and hot.get(["k"])[0].miss
        assert hot.stats().corrupt == 0 and not hot.delete(["k"])[0].ok
        assert read(store, "k") == payload
        store.flush()
        assert store.stats().promotions == 1 and store.get(["k"])[0].source == "valkey"
    finally:
        store.delete(["k"])
        store.close()


def test_a_put_during_a_valkey_stall_is_never_followed_by_the_old_value(
    private_valkey: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Valkey holds v1 and stalls (SIGSTOP); put v2 reaches S3 only, and is refused (the
    older copy in Valkey could not be invalidated); a promotion of v1 sent during the
    stall runs when Valkey resumes. Reads never return v1 after v2 reached S3, and once
    Valkey answers again its copy is invalidated and refilled with v2."""
    store = make(private_valkey, s3_server, key_prefix)
    store.start()
    gate = GatedFills(hot_of(store), monkeypatch)
    pid = _pid(private_valkey)
    try:
        v1, v2 = os.urandom(5 * KIB), os.urandom(5 * KIB)
        assert store.put([("k", v1), ("held", v1)])[0].ok
        store.hot.delete(["held"])
        assert read(store, "held") == v1  # its promotion waits at the gate
        assert read(store, "k") == v1 and store.get(["k"])[0].source == "valkey"
        os.kill(pid, signal.SIGSTOP)
        try:
            refused = store.put([("k", v2), ("held", v2)])  # S3 takes them, Valkey cannot
            assert all(isinstance(r.error, HotTierDownError) for r in refused)
            gate.release()  # the old promotion's script waits in Valkey's socket
            time.sleep(0.4)
            assert read(store, "k") == v2 and read(store, "held") == v2
        finally:
            os.kill(pid, signal.SIGCONT)
        seen = set()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            seen |= {read(store, "k"), read(store, "held")}
            time.sleep(0.02)
        assert seen <= {v2, None} and v2 in seen
        store.flush()
        assert store.stale_copies() == {"hot": 0, "cold": 0}
        for key in ("k", "held"):  # what Valkey itself holds now, read directly
            r = store.hot.get([key])[0]
            assert r.miss or bytes(r.data or b"") == v2
    finally:
        gate.release()
        store.delete(["k", "held"])
        store.close()


def test_a_delete_during_a_valkey_stall_is_not_undone(
    private_valkey: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str,
) -> None:
    store = make(private_valkey, s3_server, key_prefix)
    store.start()
    pid = _pid(private_valkey)
    try:
        assert store.put([("k", b"v1")])[0].ok
        os.kill(pid, signal.SIGSTOP)
        try:
            store.delete(["k"])
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.3)
        assert all(read(store, "k") is None for _ in range(10))
        assert store.stale_copies()["hot"] == 0
    finally:
        store.close()


def test_write_back_uploads_end_on_the_newest_version(
    private_valkey: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str,
) -> None:
    """Write-back: many overwrites of one key in a row, uploads on four threads: S3 ends
    on the last one, and a read that misses Valkey before the upload lands is a miss."""
    store = make(private_valkey, s3_server, key_prefix, write_mode="write-back",
                 background_threads=4)
    store.start()
    try:
        versions = [os.urandom(30 * KIB) for _ in range(12)]
        for v in versions:
            assert store.put([("k", v)])[0].ok
        store.hot.delete(["k"])  # evicted before the uploads are done
        assert read(store, "k") in (versions[-1], None)
        store.flush()
        assert bytes(store.cold.get(["k"])[0].data or b"") == versions[-1]
        assert read(store, "k") == versions[-1]
        assert store.stale_copies() == {"hot": 0, "cold": 0}
    finally:
        store.delete(["k"])
        store.close()


def test_a_put_straight_to_s3_is_not_overwritten_by_an_older_upload(
    private_valkey: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Write-through, ``cold_down="pin"``: S3 refuses v1, which is pinned in Valkey and
    its upload held; v2 then goes to S3 and Valkey; v1's upload lands after it. S3 ends
    on v2, no read returns v1, and v2 gets its TTL."""
    store = make(private_valkey, s3_server, key_prefix, cold_down="pin", hot_ttl_s=60.0)
    store.start()
    gate = threading.Event()
    cold_put = store.cold.put
    refuse = [True]

    def held_upload(items: Sequence[tuple[str, Buffer]], **kw: Any) -> list[OpResult]:
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(30)
        elif refuse.pop() if refuse else False:
            return [OpResult(k, False, StoreError("S3 refused it")) for k, _ in items]
        return cold_put(items, **kw)

    monkeypatch.setattr(store.cold, "put", held_upload)
    try:
        v1, v2 = os.urandom(5 * KIB), os.urandom(40 * KIB)
        assert store.put([("k", v1)])[0].pinned  # its upload waits at the gate
        r = store.put([("k", v2)])[0]
        assert r.ok and not r.pinned
        assert read(store, "k") == v2
        gate.set()
        store.flush()
        assert bytes(store.cold.get(["k"])[0].data or b"") == v2
        assert {read(store, "k") for _ in range(10)} == {v2}
        assert store.stale_copies() == {"hot": 0, "cold": 0}
        hot = hot_of(store)
        assert hot.pending_uploads(["k"]) == set() and hot.client.pttl(hot.head_key("k")) > 0
    finally:
        gate.set()
        store.delete(["k"])
        store.close()


def test_a_write_back_is_not_undone_by_an_eviction_for_a_reader_in_another_process(
    private_valkey: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Write-back: S3 holds v1; v2 is put, and Valkey evicts it before its upload lands. A
    reader in another process misses (it must not read v1 from S3, nor promote it), and
    reads v2 once the upload has landed."""
    writer = make(private_valkey, s3_server, key_prefix, write_mode="write-back")
    other = make(private_valkey, s3_server, key_prefix, write_mode="write-back")
    writer.start()
    other.start()
    gate = threading.Event()
    cold_put = writer.cold.put

    def held_put(items: Sequence[tuple[str, Buffer]], **kw: Any) -> list[OpResult]:
        assert gate.wait(30)
        return cold_put(items, **kw)

    try:
        v1, v2 = os.urandom(5 * KIB), os.urandom(40 * KIB)
        assert writer.put([("k", v1)])[0].ok
        writer.flush()
        monkeypatch.setattr(writer.cold, "put", held_put)
        assert writer.put([("k", v2)])[0].ok  # acknowledged; its upload waits at the gate
        writer.hot.delete(["k"])  # evicted
        assert read(other, "k") is None
        other.flush()
        assert read(writer, "k") is None and read(other, "k") is None
        gate.set()
        writer.flush()
        assert read(other, "k") == v2
        other.flush()
        assert {read(other, "k") for _ in range(5)} | {read(writer, "k")} == {v2}
        writer.hot.delete(["k"])  # evicted after the upload: S3 serves v2
        assert read(other, "k") == v2
    finally:
        gate.set()
        writer.delete(["k"])
        writer.close()
        other.close()


# -- random interleavings ------------------------------------------------------------------


@dataclass
class Tally:
    ops: int = 0
    reads: int = 0
    hits: int = 0
    misses: int = 0
    stale: int = 0
    puts: int = 0
    failed_puts: int = 0
    evictions: int = 0
    stalls: int = 0
    restarts: int = 0
    examples: list[str] = field(default_factory=list)


class Oracle:
    """What a read may return: the last acknowledged value of the key, or a value put
    after it whose put failed (it may have landed)."""

    def __init__(self) -> None:
        self.allowed: dict[str, set[bytes]] = {}

    def acked(self, key: str, value: bytes) -> None:
        self.allowed[key] = {value}

    def unacked(self, key: str, value: bytes) -> None:
        self.allowed.setdefault(key, set()).add(value)

    def fresh(self, key: str, value: bytes) -> bool:
        return value in self.allowed.get(key, set())


def run_interleavings(valkey: EmbeddedValkey, s3: EmbeddedS3, prefix: str, ops: int,
                      seed: int, mode: str = "write-through",
                      log: Callable[[str], None] | None = None, *,
                      other_reader: bool = False) -> Tally:
    """``ops`` random steps over four keys: put (sizes from inline to four stripes),
    evict from Valkey, read, and now and then a Valkey stall (SIGSTOP for a few steps) or
    a restart (SIGKILL, then a fresh empty server on the same port). Fills (and
    write-back uploads) are slowed at random so that they overlap the steps after them.
    ``other_reader``: half the reads go to a second store, as from another process, which
    has only what reaches Valkey to go by (see :mod:`kvprefetch.agents.stores.tiered`):
    that run has no stalls or restarts, which keep a put's invalidation or pending upload
    record from Valkey."""
    rng = random.Random(seed)
    store = make(valkey, s3, prefix, write_mode=mode, hot_ttl_s=120.0,
                 retry_down_after_s=0.0)
    other = make(valkey, s3, prefix, write_mode=mode, hot_ttl_s=120.0,
                 retry_down_after_s=0.0) if other_reader else None
    readers = [store] if other is None else [store, other]
    for reader in readers:
        reader.start()
        slow_down(reader, random.Random(rng.random()))
    hot = hot_of(store)
    keys = ("a", "b", "c", "d")
    oracle = Oracle()
    tally = Tally()
    stalled_until = -1
    try:
        for step in range(ops):
            tally.ops += 1
            if stalled_until == step:
                os.kill(_pid(valkey), signal.SIGCONT)
                stalled_until = -1
            key = rng.choice(keys)
            roll = rng.random()
            if roll < 0.35:
                value = rng.randbytes(rng.choice((100, 3 * KIB, 20 * KIB, 60 * KIB)))
                tally.puts += 1
                if store.put([(key, value)])[0].ok:
                    oracle.acked(key, value)
                else:
                    tally.failed_puts += 1
                    oracle.unacked(key, value)
            elif roll < 0.5:
                if stalled_until < 0 and valkey.running:
                    tally.evictions += 1
                    hot.delete([key])
            elif roll < 0.985:
                tally.reads += 1
                got = read(rng.choice(readers), key)
                if got is None:
                    tally.misses += 1
                elif oracle.fresh(key, got):
                    tally.hits += 1
                else:
                    tally.stale += 1
                    if len(tally.examples) < 5:
                        tally.examples.append(f"step {step}: {key!r} stale")
            elif roll < 0.995:
                if stalled_until < 0 and other is None:
                    tally.stalls += 1
                    os.kill(_pid(valkey), signal.SIGSTOP)
                    stalled_until = step + rng.randint(2, 12)
            elif stalled_until < 0 and other is None:
                tally.restarts += 1
                valkey.kill()
                valkey.start()
            if log is not None and step and step % 1000 == 0:
                log(f"{step} ops: {tally}")
        if stalled_until >= 0:
            os.kill(_pid(valkey), signal.SIGCONT)
        store.flush()
    finally:
        if stalled_until >= 0 and valkey.running:
            os.kill(_pid(valkey), signal.SIGCONT)
        store.delete(list(keys))
        store.close()
        if other is not None:
            other.close()
    return tally


def slow_down(store: TieredStore, rng: random.Random) -> None:
    """Delay the store's fills and its uploads to S3 at random (up to 10 ms each)."""
    hot, cold = hot_of(store), store.cold
    fill, put = hot.fill, cold.put

    def slow_fill(items: Sequence[tuple[str, Buffer, bytes]], *,
                  ttl_s: float | None = None) -> list[OpResult]:
        time.sleep(rng.choice((0.0, 0.0, 0.002, 0.01)))
        return fill(items, ttl_s=ttl_s)

    def slow_put(items: Sequence[tuple[str, Buffer]], **kw: Any) -> list[OpResult]:
        if threading.current_thread() is not threading.main_thread():  # uploads only
            time.sleep(rng.choice((0.0, 0.0, 0.002, 0.01)))
        return put(items, **kw)

    hot.fill = slow_fill  # type: ignore[method-assign]
    cold.put = slow_put  # type: ignore[method-assign]


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_random_interleavings_never_read_an_overwritten_value(
    private_valkey: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str, mode: str,
) -> None:
    ops = int(os.environ.get("KVP_FRESHNESS_OPS", "1500"))
    if mode == "write-back":
        ops = max(300, ops // 3)
    tally = run_interleavings(private_valkey, s3_server, key_prefix, ops, seed=7, mode=mode)
    print(tally)
    assert tally.stale == 0, tally.examples
    assert tally.reads > ops // 3 and tally.hits > tally.reads // 3


def test_write_back_with_evictions_never_reads_an_overwritten_value_in_another_process(
    private_valkey: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str,
) -> None:
    """Write-back, Valkey evicting keys whose uploads may still be pending (uploads and
    fills slowed at random), half the reads from a second store as from another process:
    no read returns an overwritten value."""
    ops = int(os.environ.get("KVP_WRITE_BACK_OPS", "10000"))
    tally = run_interleavings(private_valkey, s3_server, key_prefix, ops, seed=11,
                              mode="write-back", other_reader=True)
    print(tally)
    assert tally.stale == 0, tally.examples
    assert tally.evictions > ops // 10
    assert tally.reads > ops // 3 and tally.hits > tally.reads // 3
