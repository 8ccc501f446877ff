"""The tiered store's consistency contract (:mod:`kvprefetch.agents.stores.tiered`, and the
operations page), checked with real servers: SeaweedFS killed under a put, Valkey killed
and restarted on its append-only file, writers and readers cut off from either server by a
proxy that drops their connections. A second store over the same servers stands for a
process that shares nothing with the writer but the servers.

``KVP_CONTRACT_OPS`` sets the length of each random run (3,400 per configuration, three
configurations: 10,200 operations in the suite).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import valkey
from kvptest.sockets import reset

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.stores.errors import (
    ColdTierDownError,
    HotTierDownError,
    NotDurableError,
)
from kvprefetch.agents.stores.s3.store import S3Store
from kvprefetch.agents.stores.tiered import TieredStore, TieredStoreConfig
from kvprefetch.agents.stores.valkey.store import ValkeyStore, ValkeyStoreConfig

pytestmark = pytest.mark.servers
KIB = 1024
#: Valkey as the contract wants it for pinned values: an append-only file, fsynced on
#: every write (so that ``WAITAOF`` answers at once), nothing evicted but expiring keys.
AOF_ARGS = ("--appendonly", "yes", "--appendfsync", "always",
            "--maxmemory-policy", "volatile-lru")


class DropProxy:
    """A TCP proxy on loopback to ``port`` that can cut every connection through it and
    refuse new ones (a partition as the client sees it: its calls fail at once)."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.up = True
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self.up:
                reset(conn)
                continue
            try:
                back = socket.create_connection(("127.0.0.1", self.upstream), timeout=1.0)
                back.settimeout(None)
            except OSError:
                reset(conn)
                continue
            with self._lock:
                self._socks |= {conn, back}
            for a, b in ((conn, back), (back, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            reset(s)
        with self._lock:
            self._socks -= {src, dst}

    def cut(self) -> None:
        self.up = False
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            reset(s)

    def heal(self) -> None:
        self.up = True

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()



def make(valkey_port: int, s3: EmbeddedS3, prefix: str, *, s3_port: int | None = None,
         **cfg: Any) -> TieredStore:
    hot = ValkeyStore(valkey_config(valkey_port, prefix))
    s3_cfg = s3.store_config(key_prefix=prefix, part_bytes=16 * KIB, range_bytes=64 * KIB,
                             connect_timeout_s=0.5, read_timeout_s=5.0, max_attempts=1)
    if s3_port is not None:
        s3_cfg = s3_cfg.model_copy(update={"endpoint_url": f"http://127.0.0.1:{s3_port}"})
    cfg.setdefault("retry_down_after_s", 0.1)
    store = TieredStore(hot, S3Store(s3_cfg), TieredStoreConfig(**cfg))
    store.start()
    return store


def valkey_config(port: int, prefix: str) -> ValkeyStoreConfig:
    return ValkeyStoreConfig(host="127.0.0.1", port=port, key_prefix=prefix,
                             part_bytes=16 * KIB, connect_timeout_s=0.25,
                             socket_timeout_s=0.5)


def read(store: TieredStore, key: str) -> bytes | None:
    r = store.get([key])[0]
    return bytes(r.data or b"") if r.ok else None


def read_back(store: TieredStore, key: str, timeout_s: float = 3.0) -> bytes | None:
    """A read once the store answers again: a server restarted under it costs its pooled
    connections and a ``retry_down_after_s`` (misses, which the contract allows)."""
    deadline = time.monotonic() + timeout_s
    while (got := read(store, key)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def pttl(store: TieredStore, key: str) -> int:
    hot = store.hot
    assert isinstance(hot, ValkeyStore)
    return int(hot.client.pttl(hot.head_key(key)))


@pytest.fixture
def aof_valkey(dram_dir: Path) -> Iterator[EmbeddedValkey]:
    """A private Valkey with an append-only file, kept in memory (``dram_dir``) so that
    its fsync per write costs little; a restart (``restart``) finds it there."""
    dram_dir.mkdir(parents=True, exist_ok=True)
    with EmbeddedValkey(extra_args=(*AOF_ARGS, "--dir", str(dram_dir))) as server:
        yield server


def restart(server: EmbeddedValkey) -> None:
    """kill -9, then start on the same append-only file, and wait until it is loaded."""
    server.kill()
    server.start()
    client = valkey.Valkey(host=server.host, port=server.port)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(valkey.exceptions.BusyLoadingError):
                if client.ping():
                    return
            time.sleep(0.02)
    finally:
        client.close()
    raise AssertionError("valkey did not load its append-only file")


@pytest.fixture
def private_s3() -> Iterator[EmbeddedS3]:
    with EmbeddedS3() as server:
        yield server


def settle(*stores: TieredStore, timeout_s: float = 20.0) -> None:
    """Wait until every store's pending uploads have landed and no copy lags."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for s in stores:
            s.settle()
            s.flush()
        if all(s.stale_copies() == {"hot": 0, "cold": 0} for s in stores):
            return
        time.sleep(0.05)
    raise AssertionError(f"stores did not settle: {[s.stale_copies() for s in stores]}")


# -- S3 killed under a put ------------------------------------------------------------------


def test_s3_down_write_through_put_is_refused(
    aof_valkey: EmbeddedValkey, private_s3: EmbeddedS3, key_prefix: str,
) -> None:
    """``cold_down="refuse"``: with SeaweedFS killed, put v2 is refused
    (:class:`ColdTierDownError`); once Valkey's copy goes (restart), every reader reads
    v1, the last acknowledged value, or misses."""
    writer = make(aof_valkey.port, private_s3, key_prefix)
    other = make(aof_valkey.port, private_s3, key_prefix)
    try:
        assert writer.put([("k", b"v1" * 900)])[0].ok
        private_s3.kill()
        r = writer.put([("k", b"v2" * 900)])[0]
        assert not r.ok and isinstance(r.error, ColdTierDownError) and not r.pinned
        assert read(writer, "k") == b"v1" * 900  # Valkey's copy, untouched
        restart(aof_valkey)
        private_s3.stop()
        private_s3.start()  # an empty S3: the reads below can only miss or read v1
        time.sleep(0.2)
        assert {read(writer, "k"), read(other, "k")} <= {b"v1" * 900, None}
    finally:
        writer.close()
        other.close()


def test_s3_down_write_through_put_is_pinned_until_s3_has_it(
    aof_valkey: EmbeddedValkey, private_s3: EmbeddedS3, key_prefix: str,
) -> None:
    """``cold_down="pin"``: with SeaweedFS killed, put v2 is acknowledged ``pinned``: in
    Valkey without expiry, through a kill -9 and restart of Valkey, for the writer and for
    another process; once S3 is back the upload lands, the value gets its TTL, and with
    Valkey's copy evicted S3 serves v2."""
    cfg: dict[str, Any] = {"cold_down": "pin", "hot_ttl_s": 60.0}
    writer = make(aof_valkey.port, private_s3, key_prefix, **cfg)
    other = make(aof_valkey.port, private_s3, key_prefix, **cfg)
    v1, v2 = os.urandom(3 * KIB), os.urandom(40 * KIB)  # v2: three stripes
    try:
        assert writer.put([("k", v1)])[0].ok
        assert 0 < pttl(writer, "k") <= 60_000
        private_s3.kill()
        r = writer.put([("k", v2)])[0]
        assert r.ok and r.pinned and pttl(writer, "k") == -1
        assert writer.stats().degraded_writes == 1
        restart(aof_valkey)
        time.sleep(0.2)
        assert read_back(other, "k") == v2 and read_back(writer, "k") == v2
        assert pttl(writer, "k") == -1
        private_s3.stop()
        private_s3.start()
        time.sleep(0.2)
        settle(writer)
        assert 0 < pttl(writer, "k") <= 60_000
        assert bytes(writer.cold.get(["k"])[0].data or b"") == v2
        writer.hot.delete(["k"])  # evicted
        assert read_back(other, "k") == v2 and read_back(writer, "k") == v2
    finally:
        writer.close()
        other.close()


def test_write_back_put_survives_a_valkey_restart_with_s3_down(
    aof_valkey: EmbeddedValkey, private_s3: EmbeddedS3, key_prefix: str,
) -> None:
    """Write-back: SeaweedFS killed, put v2 acknowledged ``pinned``; Valkey killed and
    restarted on its append-only file: its value and pending upload record are back,
    another process reads v2 (never S3's v1), and S3 gets v2 once it is back."""
    writer = make(aof_valkey.port, private_s3, key_prefix, write_mode="write-back")
    other = make(aof_valkey.port, private_s3, key_prefix, write_mode="write-back")
    try:
        assert writer.put([("k", b"v1")])[0].pinned
        settle(writer)
        private_s3.kill()
        assert writer.put([("k", b"v2")])[0].pinned
        restart(aof_valkey)
        assert read_back(other, "k") == b"v2"
        hot = other.hot
        assert isinstance(hot, ValkeyStore) and hot.pending_uploads(["k"]) == {"k"}
        private_s3.stop()
        private_s3.start()
        time.sleep(0.2)
        settle(writer)
        assert hot.pending_uploads(["k"]) == set()
        writer.hot.delete(["k"])
        assert read_back(other, "k") == b"v2"
    finally:
        writer.close()
        other.close()


def test_a_pin_is_refused_where_valkey_cannot_confirm_it_durable(
    valkey_server: EmbeddedValkey, aof_valkey: EmbeddedValkey, s3_server: EmbeddedS3,
    key_prefix: str,
) -> None:
    """No append-only file: a write-back put is refused (:class:`NotDurableError`); with
    ``pin_replicas`` 1 and no replica, after ``pin_timeout_s``."""
    no_aof = make(valkey_server.port, s3_server, key_prefix, write_mode="write-back")
    wants_replica = make(aof_valkey.port, s3_server, key_prefix, write_mode="write-back",
                         pin_replicas=1, pin_timeout_s=0.3)
    try:
        r = no_aof.put([("k", b"v")])[0]
        assert not r.ok and isinstance(r.error, NotDurableError)
        t0 = time.monotonic()
        r = wants_replica.put([("k", b"v")])[0]
        assert not r.ok and isinstance(r.error, NotDurableError)
        assert 0.25 < time.monotonic() - t0 < 3.0
    finally:
        settle(no_aof, wants_replica)
        no_aof.delete(["k"])
        no_aof.close()
        wants_replica.close()


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_writer_cut_off_from_valkey_is_not_acknowledged(
    aof_valkey: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str, mode: str,
) -> None:
    """The writer's Valkey connections drop (a partition) during put v2: the put is
    refused (:class:`HotTierDownError`); the writer then dies, and another process never
    reads a value older than v1 (the last acknowledged), before or after the partition."""
    proxy = DropProxy(aof_valkey.port)
    writer = make(proxy.port, s3_server, key_prefix, write_mode=mode)
    other = make(aof_valkey.port, s3_server, key_prefix, write_mode=mode)
    try:
        assert writer.put([("k", b"v1")])[0].ok
        settle(writer)
        proxy.cut()
        r = writer.put([("k", b"v2")])[0]
        assert not r.ok and isinstance(r.error, HotTierDownError)
        writer.close()  # dies, or stays idle: its memory of the stale copy is gone
        assert {read(other, "k") for _ in range(5)} <= {b"v1", b"v2"}
        other.hot.delete(["k"])
        assert read(other, "k") in (b"v1", b"v2")
        proxy.heal()
    finally:
        proxy.close()
        other.delete(["k"])
        other.close()


# -- random outages, restarts and partitions ------------------------------------------------


@dataclass
class Tally:
    ops: int = 0
    puts: int = 0
    acked: int = 0
    pinned: int = 0
    refused: int = 0
    reads: int = 0
    hits: int = 0
    misses: int = 0
    stale: int = 0
    lost: int = 0
    checks: int = 0
    evictions: int = 0
    s3_outages: int = 0
    valkey_restarts: int = 0
    partitions: int = 0
    examples: list[str] = field(default_factory=list)


class Oracle:
    """What the contract lets a read return: the newest acknowledged value of the key, or
    the value of a later refused put (it may have reached a tier)."""

    def __init__(self) -> None:
        self.allowed: dict[str, set[bytes]] = {}
        self.acked: dict[str, bytes] = {}

    def ack(self, key: str, value: bytes) -> None:
        self.allowed[key] = {value}
        self.acked[key] = value

    def refuse(self, key: str, value: bytes) -> None:
        self.allowed.setdefault(key, set()).add(value)

    def fresh(self, key: str, value: bytes) -> bool:
        return value in self.allowed.get(key, set())


def run_contract(valkey: EmbeddedValkey, s3: EmbeddedS3, prefix: str, ops: int, seed: int,
                 **cfg: Any) -> Tally:
    """``ops`` random steps over six keys from one writer: puts (inline to four stripes),
    reads from the writer or another process, evictions of what Valkey may evict (values
    with a TTL), S3 outages (every connection to S3 dropped for a few steps), Valkey
    killed and restarted on its append-only file, and partitions of the writer or the
    reader from Valkey. Every read is checked against the contract's freshness clause;
    every 500 steps and at the end the faults are healed, the stores settle, and every
    key's newest acknowledged value must be read back by both (the durability clause)."""
    rng = random.Random(seed)
    s3_proxy = DropProxy(s3.port)
    w_proxy, r_proxy = DropProxy(valkey.port), DropProxy(valkey.port)
    cfg.setdefault("hot_ttl_s", 120.0)
    cfg.setdefault("retry_down_after_s", 0.0)
    writer = make(w_proxy.port, s3, prefix, s3_port=s3_proxy.port, **cfg)
    reader = make(r_proxy.port, s3, prefix, s3_port=s3_proxy.port, **cfg)
    direct = ValkeyStore(valkey_config(valkey.port, prefix))
    direct.start()
    keys = [f"k{i}" for i in range(6)]
    oracle, tally = Oracle(), Tally()
    healing: dict[str, int] = {}
    proxies = {"s3": s3_proxy, "writer": w_proxy, "reader": r_proxy}

    def check(step: int, who: TieredStore, key: str, need: bool) -> None:
        got = read(who, key)
        tally.reads += 1
        if got is None:
            tally.misses += 1
            if need and key in oracle.acked:
                tally.lost += 1
                if len(tally.examples) < 5:
                    tally.examples.append(f"step {step}: {key!r} lost")
        elif oracle.fresh(key, got):
            tally.hits += 1
        else:
            tally.stale += 1
            if len(tally.examples) < 5:
                tally.examples.append(f"step {step}: {key!r} stale")

    def checkpoint(step: int) -> None:
        for p in proxies.values():
            p.heal()
        healing.clear()
        time.sleep(0.12)  # past retry_down_after_s: both stores try both tiers again
        settle(writer, reader)
        tally.checks += 1
        for key in keys:
            for who in (writer, reader):
                for _ in range(20):  # a restarted server costs a pooled connection
                    got = read(who, key)
                    if got is not None or key not in oracle.acked:
                        break
                    time.sleep(0.05)
                check(step, who, key, need=True)

    try:
        for step in range(ops):
            tally.ops += 1
            for name, until in list(healing.items()):
                if until <= step:
                    proxies[name].heal()
                    del healing[name]
            key = rng.choice(keys)
            roll = rng.random()
            if roll < 0.33:
                value = rng.randbytes(rng.choice((100, 3 * KIB, 20 * KIB, 60 * KIB)))
                tally.puts += 1
                r = writer.put([(key, value)])[0]
                if r.ok:
                    tally.acked += 1
                    tally.pinned += r.pinned
                    oracle.ack(key, value)
                else:
                    tally.refused += 1
                    oracle.refuse(key, value)
            elif roll < 0.45:
                if valkey.running and direct.client.pttl(direct.head_key(key)) > 0:
                    tally.evictions += 1  # only what Valkey may evict: values with a TTL
                    direct.delete([key])
            elif roll < 0.972:
                check(step, rng.choice((writer, reader)), key, need=False)
            elif roll < 0.986:
                name = rng.choice(("s3", "s3", "writer", "reader"))
                if name not in healing:
                    tally.s3_outages += name == "s3"
                    tally.partitions += name != "s3"
                    proxies[name].cut()
                    healing[name] = step + rng.randint(3, 25)
            elif roll < 0.99:
                tally.valkey_restarts += 1
                for p in (w_proxy, r_proxy):
                    p.cut()  # the server's connections go with it
                restart(valkey)
                for name in ("writer", "reader"):
                    if name not in healing:  # a partition in force outlasts the restart
                        proxies[name].heal()
            if step and step % 500 == 0:
                checkpoint(step)
        checkpoint(ops)
    finally:
        for p in proxies.values():
            p.heal()
        with contextlib.suppress(Exception):
            settle(writer, reader, timeout_s=5.0)
        writer.delete(keys)
        for s in (writer, reader):
            s.close()
        direct.close()
        for p in proxies.values():
            p.close()
    return tally


CONFIGS = {
    "write-through-refuse": {},
    "write-through-pin": {"cold_down": "pin"},
    "write-back": {"write_mode": "write-back"},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_no_acknowledged_write_is_lost_or_read_stale(
    aof_valkey: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str, config: str,
) -> None:
    ops = int(os.environ.get("KVP_CONTRACT_OPS", "3400"))
    t0 = time.monotonic()
    tally = run_contract(aof_valkey, s3_server, key_prefix, ops, seed=46, **CONFIGS[config])
    print(config, f"{time.monotonic() - t0:.1f} s", tally)
    assert tally.stale == 0 and tally.lost == 0, tally.examples
    assert tally.ops == ops and tally.reads > ops // 3 and tally.hits > tally.reads // 2
    assert tally.acked > tally.puts // 2 and tally.refused > 0
    assert tally.s3_outages > 0 and tally.partitions > 0 and tally.valkey_restarts > 0
    assert tally.evictions > ops // 50 and tally.checks > ops // 600
    if config != "write-through-refuse":
        assert tally.pinned > 0
