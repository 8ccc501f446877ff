"""``kvprefetch bench store``: move one session-sized object into the DRAM tier from Valkey,
S3 and the tiered store, and compare the transfer engine with a naive connector and with
the machine's raw limit, on loopback and through the link emulator.

* engine: :class:`~agents.transfer.TransferEngine`, several chunks in flight, striped /
  ranged parallel reads, Valkey stripes received straight into the tier's memory.
* naive: chunk after chunk on one connection, one plain GET per value (what a simple
  connector does), written to the same tier.
* raw limit: one valkey-py client on loopback reading the same bytes with a plain GET loop
  and throwing them away.

Every run is verified byte for byte against the source. On loopback each figure is the best
of ``repeats`` runs (this machine's timings are noisy; the best run is the one least
disturbed); through the link emulator, where pacing dominates, one run each.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agents.embedded import EmbeddedS3, EmbeddedValkey
from agents.linkemu import S3_LINK, VALKEY_LINK, LinkEmulator, LinkProfile
from agents.stores.base import ObjectStore
from agents.stores.errors import StoreError
from agents.stores.format import decode_header
from agents.stores.local import LocalTier, LocalTierConfig
from agents.stores.s3_store import S3Store
from agents.stores.tiered import TieredStore, TieredStoreConfig
from agents.stores.valkey_store import ValkeyStore
from agents.transfer import TransferConfig, TransferEngine

log = logging.getLogger(__name__)
MIB = 1 << 20
Condition = Literal["loopback", "link"]
StoreKind = Literal["valkey", "s3", "tiered"]


class StoreBenchConfig(BaseModel):
    """What ``kvprefetch bench store`` measures."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: One session's KV: 512 MiB is ~4k tokens of Llama-3.1-8B (128 KiB per token).
    object_bytes: int = Field(512 * MIB, gt=0)
    #: One LMCache chunk of 256 tokens of Llama-3.1-8B = 32 MiB.
    chunk_bytes: int = Field(32 * MIB, gt=0)
    part_bytes: int = Field(4 * MIB, gt=0)
    conditions: tuple[Condition, ...] = ("loopback", "link")
    stores: tuple[StoreKind, ...] = ("valkey", "s3", "tiered")
    repeats: int = Field(5, ge=1)
    valkey_link: LinkProfile = VALKEY_LINK
    s3_link: LinkProfile = S3_LINK
    #: Share of chunks the tiered store finds in Valkey; the rest come from S3.
    tiered_hot_fraction: float = Field(0.5, ge=0, le=1)
    #: Where the DRAM tier lives.
    dram_dir: str = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    s3_backend: Literal["auto", "seaweedfs", "moto"] = "auto"


@dataclass(frozen=True, slots=True)
class RunFigures:
    ttlb_s: float
    throughput_mib_s: float


@dataclass(frozen=True, slots=True)
class _Plan:
    """How the engine is tuned for one store and condition."""

    valkey_connections: int
    s3_connections: int
    concurrency: int


# Loopback: CPU-bound, few threads (more only contend for two cores with the servers:
# measured on 2 cores, 2 stripe connections and one chunk at a time move Valkey data fastest).
# Link: latency- and per-connection-bandwidth-bound, so many requests in flight.
_PLANS: dict[tuple[Condition, StoreKind], _Plan] = {
    ("loopback", "valkey"): _Plan(2, 4, 1),
    ("loopback", "s3"): _Plan(2, 8, 3),
    ("loopback", "tiered"): _Plan(2, 8, 3),
    ("link", "valkey"): _Plan(8, 4, 4),
    ("link", "s3"): _Plan(4, 24, 6),
    ("link", "tiered"): _Plan(8, 24, 6),
}


class _Bench:
    def __init__(self, cfg: StoreBenchConfig, on_step: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.on_step = on_step
        self.run_id = uuid.uuid4().hex[:8]
        n = -(-cfg.object_bytes // cfg.chunk_bytes)
        self.keys = [f"bench/{self.run_id}/chunk-{i:05d}" for i in range(n)]
        self.data: dict[str, memoryview] = {}
        self.valkey: EmbeddedValkey | None = None
        self.s3: EmbeddedS3 | None = None
        self.tier: LocalTier | None = None

    # -- setup -------------------------------------------------------------------------------

    def make_data(self) -> None:
        blob = memoryview(bytearray(os.urandom(self.cfg.object_bytes)))
        size = self.cfg.chunk_bytes
        self.data = {k: blob[i * size : (i + 1) * size] for i, k in enumerate(self.keys)}

    def valkey_store(self, host: str, port: int, *, connections: int, direct: bool = True,
                     prefix: str = "kvpb:") -> ValkeyStore:
        assert self.valkey is not None
        cfg = self.valkey.store_config(
            host=host, port=port, connections=connections, direct_reads=direct,
            part_bytes=self.cfg.part_bytes, key_prefix=prefix, socket_timeout_s=30.0,
        )
        return ValkeyStore(cfg)

    def s3_store(self, endpoint: str, *, connections: int, single_get: bool = False) -> S3Store:
        assert self.s3 is not None
        range_bytes = 2 * self.cfg.chunk_bytes + MIB if single_get else 8 * MIB
        return S3Store(self.s3.store_config(
            endpoint_url=endpoint, connections=connections, range_bytes=range_bytes,
            part_bytes=self.cfg.part_bytes, key_prefix="kvpb/", read_timeout_s=60.0,
        ))

    def load(self) -> None:
        assert self.valkey is not None and self.s3 is not None
        items = [(k, self.data[k]) for k in self.keys]
        hot_n = round(len(self.keys) * self.cfg.tiered_hot_fraction)
        with self.valkey_store(self.valkey.host, self.valkey.port, connections=4) as v:
            self._check(v.put(items), "load valkey")
        with self.valkey_store(self.valkey.host, self.valkey.port, connections=4,
                               prefix="kvpt:") as v:
            self._check(v.put(items[:hot_n]), "load valkey (tiered hot part)")
        with self.s3_store(self.s3.endpoint_url, connections=8) as s:
            self._check(s.put(items), "load s3")

    @staticmethod
    def _check(results: list[Any], what: str) -> None:
        bad = [r for r in results if not r.ok]
        if bad:
            raise StoreError(f"{what}: {len(bad)} keys failed, first: {bad[0].error}")

    # -- measurements --------------------------------------------------------------------------

    def raw_limit_mib_s(self) -> float:
        """One valkey-py client, one connection, a plain GET loop over the same bytes."""
        assert self.valkey is not None
        best = 0.0
        with self.valkey_store(self.valkey.host, self.valkey.port, connections=1) as v:
            names: list[str] = []
            for k in self.keys:
                head = v.client.get(v.head_key(k))
                names += v.physical_keys(decode_header(head))
            import valkey

            client = valkey.Valkey(host=self.valkey.host, port=self.valkey.port,
                                   password=self.valkey.password)
            try:
                for _ in range(self.cfg.repeats):
                    t0 = time.perf_counter()
                    nbytes = 0
                    for name in names:
                        value: Any = client.get(name)
                        nbytes += len(value or b"")
                    best = max(best, nbytes / MIB / (time.perf_counter() - t0))
                    self.on_step("raw limit")
            finally:
                client.close()
        return best

    def _verify(self) -> None:
        assert self.tier is not None
        for result in self.tier.get(self.keys):
            if not result.ok or result.data is None:
                raise StoreError(f"verification: {result.key!r} missing from the tier")
            if result.data != self.data[result.key]:
                raise StoreError(f"verification: {result.key!r} differs from the source")

    def _move(self, source: ObjectStore, concurrency: int) -> RunFigures:
        assert self.tier is not None
        self.tier.delete(self.keys)
        with TransferEngine(source, self.tier, TransferConfig(concurrency=concurrency)) as eng:
            result = eng.transfer(self.keys)
        if not result.complete:
            raise StoreError(
                f"transfer incomplete: {result.keys_missed} missed, {result.failed[:1]}"
            )
        self._verify()
        return RunFigures(result.ttlb_s, result.throughput_mib_s)

    @contextmanager
    def _endpoints(self, condition: Condition) -> Iterator[tuple[str, int, str]]:
        assert self.valkey is not None and self.s3 is not None
        if condition == "loopback":
            yield self.valkey.host, self.valkey.port, self.s3.endpoint_url
            return
        with ExitStack() as stack:
            vlink = stack.enter_context(LinkEmulator(
                self.valkey.host, self.valkey.port, self.cfg.valkey_link, name="valkey"))
            slink = stack.enter_context(LinkEmulator(
                self.s3.host, self.s3.port, self.cfg.s3_link, name="s3"))
            yield vlink.host, vlink.port, f"http://{slink.host}:{slink.port}"

    def _sources(self, kind: StoreKind, condition: Condition, naive: bool,
                 vhost: str, vport: int, s3_url: str) -> ObjectStore:
        plan = _PLANS[(condition, kind)]
        if kind == "valkey":
            if naive:
                return self.valkey_store(vhost, vport, connections=1, direct=False)
            return self.valkey_store(vhost, vport, connections=plan.valkey_connections)
        if kind == "s3":
            if naive:
                return self.s3_store(s3_url, connections=1, single_get=True)
            return self.s3_store(s3_url, connections=plan.s3_connections)
        hot = (self.valkey_store(vhost, vport, connections=1, direct=False, prefix="kvpt:")
               if naive else
               self.valkey_store(vhost, vport, connections=plan.valkey_connections,
                                 prefix="kvpt:"))
        cold = (self.s3_store(s3_url, connections=1, single_get=True) if naive
                else self.s3_store(s3_url, connections=plan.s3_connections))
        # No promotion while measuring: every run must see the same split of hot and cold.
        return TieredStore(hot, cold, TieredStoreConfig(promote=False))

    def measure(self, condition: Condition, kind: StoreKind) -> dict[str, float]:
        repeats = self.cfg.repeats if condition == "loopback" else 1
        plan = _PLANS[(condition, kind)]
        best_engine: RunFigures | None = None
        best_naive: RunFigures | None = None
        with self._endpoints(condition) as (vhost, vport, s3_url):
            for _ in range(repeats):
                for naive in (True, False):
                    source = self._sources(kind, condition, naive, vhost, vport, s3_url)
                    source.start()
                    try:
                        figures = self._move(source, 1 if naive else plan.concurrency)
                    finally:
                        source.close()
                    if naive and (best_naive is None or figures.ttlb_s < best_naive.ttlb_s):
                        best_naive = figures
                    if not naive and (best_engine is None or figures.ttlb_s < best_engine.ttlb_s):
                        best_engine = figures
                    self.on_step(f"{condition}/{kind}/{'naive' if naive else 'engine'}")
        assert best_engine is not None and best_naive is not None
        return {
            "ttlb_s": round(best_engine.ttlb_s, 4),
            "throughput_mib_s": round(best_engine.throughput_mib_s, 1),
            "naive_ttlb_s": round(best_naive.ttlb_s, 4),
            "naive_throughput_mib_s": round(best_naive.throughput_mib_s, 1),
            "speedup_vs_naive": round(best_naive.ttlb_s / best_engine.ttlb_s, 3),
            "concurrency": plan.concurrency,
        }

    def steps(self) -> int:
        per = sum(
            (self.cfg.repeats if c == "loopback" else 1) * 2
            for c in self.cfg.conditions for _ in self.cfg.stores
        )
        return per + self.cfg.repeats + 1

    # -- driver ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        tier_dir = os.path.join(cfg.dram_dir, f"kvp-bench-{self.run_id}")
        capacity = 2 * cfg.object_bytes + 64 * MIB
        with ExitStack() as stack:
            self.valkey = stack.enter_context(EmbeddedValkey())
            self.s3 = stack.enter_context(EmbeddedS3(backend=cfg.s3_backend))
            stack.callback(shutil.rmtree, tier_dir, True)
            self.make_data()
            self.load()
            self.on_step("loaded")
            self.tier = stack.enter_context(LocalTier(LocalTierConfig(
                path=tier_dir, capacity_bytes=capacity, kind="dram",
                prewarm_bytes=cfg.object_bytes + 16 * MIB,
                prewarm_file_bytes=cfg.chunk_bytes + 64 * 1024,
            )))
            raw = self.raw_limit_mib_s()
            conditions: dict[str, dict[str, dict[str, float]]] = {}
            for condition in cfg.conditions:
                conditions[condition] = {}
                for kind in cfg.stores:
                    row = self.measure(condition, kind)
                    row["fraction_of_raw"] = round(row["throughput_mib_s"] / raw, 3)
                    conditions[condition][kind] = row
            return {
                "object_bytes": cfg.object_bytes,
                "chunk_bytes": cfg.chunk_bytes,
                "part_bytes": cfg.part_bytes,
                "chunks": len(self.keys),
                "raw_limit_mib_s": round(raw, 1),
                "conditions": conditions,
                "links": {
                    "valkey": cfg.valkey_link.model_dump(),
                    "s3": cfg.s3_link.model_dump(),
                },
                "repeats_loopback": cfg.repeats,
                "tiered_hot_fraction": cfg.tiered_hot_fraction,
                "s3_backend": self.s3.backend,
                "verified": True,
            }


def run_store_bench(
    config: StoreBenchConfig, on_step: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run the benchmark and return the JSON-ready result (see the module docstring)."""
    bench = _Bench(config, on_step or (lambda _label: None))
    return bench.run()


def bench_steps(config: StoreBenchConfig) -> int:
    """How many times ``on_step`` will be called (for a progress bar)."""
    return _Bench(config, lambda _l: None).steps()


def format_table(result: dict[str, Any]) -> str:
    """The result as a plain-text table."""
    lines = [
        f"object {result['object_bytes'] / MIB:.0f} MiB in chunks of "
        f"{result['chunk_bytes'] / MIB:.0f} MiB; raw limit (plain Valkey GET loop): "
        f"{result['raw_limit_mib_s']:.0f} MiB/s",
        f"{'condition':<10}{'store':<8}{'TTLB s':>9}{'MiB/s':>9}{'naive s':>9}"
        f"{'speedup':>9}{'of raw':>8}",
    ]
    for condition, rows in result["conditions"].items():
        for kind, r in rows.items():
            lines.append(
                f"{condition:<10}{kind:<8}{r['ttlb_s']:>9.3f}{r['throughput_mib_s']:>9.0f}"
                f"{r['naive_ttlb_s']:>9.3f}{r['speedup_vs_naive']:>9.2f}"
                f"{r['fraction_of_raw']:>8.2f}"
            )
    return "\n".join(lines)
