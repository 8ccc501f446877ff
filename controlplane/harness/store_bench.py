"""``kvprefetch bench store``: move one session-sized object into the DRAM tier from Valkey,
S3 and the tiered store, and compare the transfer engine with a naive connector and with
the machine's raw limit, on loopback and through the link emulator.

* engine: :class:`~kvprefetch.agents.transfer.TransferEngine` with the store tuned for the condition
  (see ``_PLANS``): on loopback few threads and connections, Valkey stripes received
  straight into the tier's memory (no copy but the kernel's); through the link, several
  chunks in flight, striped / ranged parallel reads.
* naive: chunk after chunk on one connection, one plain GET per value (what a simple
  connector does), written to the same tier.
* raw limit: one valkey-py client (its default parser) reading the same bytes with a single
  plain GET loop and throwing them away; checked once, untimed, to return exactly the
  object's bytes.

Every engine and naive run is verified byte for byte against the source. This machine's
timings are noisy (two cores shared with the servers and with whatever else runs), so on
loopback each repeat runs naive, engine and raw back to back, in an order that alternates
between repeats, and every figure is the median over the repeats (the best runs are
reported too); ``fraction_of_raw`` is the engine's median over the median of every raw run
of the benchmark, and ``fraction_of_raw_paired`` the median of engine/raw over runs taken
next to each other. Through the link emulator, where pacing dominates, one run each.
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
from statistics import median
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.linkemu import S3_LINK, VALKEY_LINK, LinkEmulator, LinkProfile
from kvprefetch.agents.stores.base import ObjectStore
from kvprefetch.agents.stores.errors import StoreError
from kvprefetch.agents.stores.format import decode_header
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig
from kvprefetch.agents.stores.s3.store import S3Store
from kvprefetch.agents.stores.tiered import TieredStore, TieredStoreConfig
from kvprefetch.agents.stores.valkey.store import ValkeyStore
from kvprefetch.agents.transfer import TransferConfig, TransferEngine

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
    #: One GET per S3 object (its body received straight into the tier) instead of ranged
    #: GETs in parallel: on loopback the S3 server's CPU, not the link, is the limit, and
    #: every extra request costs it more than parallelism gains.
    s3_single_get: bool = False


# Loopback: CPU-bound, few threads (more only contend for two cores with the servers and
# other load: measured on 2 cores, one connection and one chunk at a time, each stripe
# received by the engine's own thread straight into the tier, move Valkey data fastest).
# Link: latency- and per-connection-bandwidth-bound, so many requests in flight.
_PLANS: dict[tuple[Condition, StoreKind], _Plan] = {
    ("loopback", "valkey"): _Plan(1, 4, 1),
    ("loopback", "s3"): _Plan(1, 2, 1, s3_single_get=True),
    ("loopback", "tiered"): _Plan(1, 2, 2, s3_single_get=True),
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
        self.raw_samples: list[float] = []
        self._names: list[str] | None = None
        self._raw: Any = None

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

    def s3_store(self, endpoint: str, *, connections: int, single_get: bool = False,
                 direct: bool = True) -> S3Store:
        assert self.s3 is not None
        range_bytes = 2 * self.cfg.chunk_bytes + MIB if single_get else 8 * MIB
        return S3Store(self.s3.store_config(
            endpoint_url=endpoint, connections=connections, range_bytes=range_bytes,
            direct_reads=direct,
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

    def _raw_names(self) -> list[str]:
        """Every Valkey key the engine reads for the object (heads and stripes), in order."""
        assert self.valkey is not None
        if self._names is None:
            names: list[str] = []
            with self.valkey_store(self.valkey.host, self.valkey.port, connections=1) as v:
                for k in self.keys:
                    names += v.physical_keys(decode_header(v.client.get(v.head_key(k))))
            self._names = names
        return self._names

    def _raw_client(self) -> Any:
        """The raw loop's client, checked once (untimed) to read exactly the object's bytes:
        every stripe equals its slice of the source, every head decodes to its key."""
        import valkey

        assert self.valkey is not None
        if self._raw is None:
            client: Any = valkey.Valkey(host=self.valkey.host, port=self.valkey.port,
                                        password=self.valkey.password)
            with self.valkey_store(self.valkey.host, self.valkey.port, connections=1) as v:
                for k in self.keys:
                    head = client.get(v.head_key(k))
                    header = decode_header(head, expected_key=k)
                    payload = self.data[k]
                    if header.parts <= 1:
                        same = memoryview(head)[header.header_bytes :] == payload
                    else:
                        same = all(
                            client.get(v.part_key(k, i))
                            == payload[slice(*header.part_range(i))]
                            for i in range(header.parts)
                        )
                    if not same:
                        client.close()
                        raise StoreError(f"raw limit: {k!r} read back differs from the source")
            self._raw = client
        return self._raw

    def raw_run(self) -> float:
        """One run of the raw limit: one valkey-py client (one connection, the default
        parser), a plain GET loop over the same keys the engine reads; values are dropped.
        Returns MiB/s of values received."""
        names = self._raw_names()
        client = self._raw_client()
        t0 = time.perf_counter()
        nbytes = 0
        for name in names:
            value: Any = client.get(name)
            nbytes += len(value or b"")
        return nbytes / MIB / (time.perf_counter() - t0)

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
                return self.s3_store(s3_url, connections=1, single_get=True, direct=False)
            return self.s3_store(s3_url, connections=plan.s3_connections,
                                 single_get=plan.s3_single_get)
        hot = (self.valkey_store(vhost, vport, connections=1, direct=False, prefix="kvpt:")
               if naive else
               self.valkey_store(vhost, vport, connections=plan.valkey_connections,
                                 prefix="kvpt:"))
        cold = (self.s3_store(s3_url, connections=1, single_get=True, direct=False) if naive
                else self.s3_store(s3_url, connections=plan.s3_connections,
                                   single_get=plan.s3_single_get))
        # No promotion while measuring: every run must see the same split of hot and cold.
        return TieredStore(hot, cold, TieredStoreConfig(promote=False))

    def _run_side(self, side: str, kind: StoreKind, condition: Condition,
                  endpoints: tuple[str, int, str]) -> RunFigures:
        plan = _PLANS[(condition, kind)]
        naive = side == "naive"
        source = self._sources(kind, condition, naive, *endpoints)
        source.start()
        try:
            return self._move(source, 1 if naive else plan.concurrency)
        finally:
            source.close()

    def measure(self, condition: Condition, kind: StoreKind) -> dict[str, Any]:
        """Engine and naive (and, on loopback, the raw limit) measured interleaved: each
        repeat runs every side once, in an order that alternates between repeats, so that
        load from other processes falls on all sides alike. Figures are medians over the
        repeats (best runs reported too)."""
        repeats = self.cfg.repeats if condition == "loopback" else 1
        plan = _PLANS[(condition, kind)]
        # The raw limit is measured next to the Valkey loopback runs (the same bytes, the same
        # server; other rows' servers may still be busy in the background).
        with_raw = condition == "loopback" and kind == "valkey"
        sides = ["naive", "engine", "raw"] if with_raw else ["naive", "engine"]
        runs: dict[str, list[float]] = {side: [] for side in sides}  # MiB/s per run
        ttlbs: dict[str, list[float]] = {side: [] for side in sides}
        with self._endpoints(condition) as endpoints:
            for r in range(repeats):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    if side == "raw":
                        runs["raw"].append(self.raw_run())
                    else:
                        figures = self._run_side(side, kind, condition, endpoints)
                        runs[side].append(figures.throughput_mib_s)
                        ttlbs[side].append(figures.ttlb_s)
                    self.on_step(f"{condition}/{kind}/{side}")
        self.raw_samples += runs.get("raw", [])
        engine_ttlb, naive_ttlb = median(ttlbs["engine"]), median(ttlbs["naive"])
        row: dict[str, Any] = {
            "ttlb_s": round(engine_ttlb, 4),
            "throughput_mib_s": round(median(runs["engine"]), 1),
            "naive_ttlb_s": round(naive_ttlb, 4),
            "naive_throughput_mib_s": round(median(runs["naive"]), 1),
            "speedup_vs_naive": round(naive_ttlb / engine_ttlb, 3),
            "best_throughput_mib_s": round(max(runs["engine"]), 1),
            "best_naive_throughput_mib_s": round(max(runs["naive"]), 1),
            "engine_runs_mib_s": [round(x, 1) for x in runs["engine"]],
            "naive_runs_mib_s": [round(x, 1) for x in runs["naive"]],
            "concurrency": plan.concurrency,
            "connections": (plan.valkey_connections if kind == "valkey"
                            else plan.s3_connections if kind == "s3"
                            else [plan.valkey_connections, plan.s3_connections]),
        }
        if runs.get("raw"):
            row["raw_runs_mib_s"] = [round(x, 1) for x in runs["raw"]]
            # Engine / raw of the runs taken next to each other (one ratio per repeat).
            row["fraction_of_raw_paired"] = round(
                median([e / w for e, w in zip(runs["engine"], runs["raw"], strict=True)]), 3)
        return row

    def steps(self) -> int:
        per = sum(
            (self.cfg.repeats * 2 if c == "loopback" else 2)
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
            load_before = os.getloadavg()
            conditions: dict[str, dict[str, dict[str, Any]]] = {}
            for condition in cfg.conditions:
                conditions[condition] = {}
                for kind in cfg.stores:
                    conditions[condition][kind] = self.measure(condition, kind)
            if not self.raw_samples:  # no Valkey loopback row: measure the raw limit alone
                for _ in range(cfg.repeats):
                    self.raw_samples.append(self.raw_run())
                    self.on_step("raw limit")
            raw = median(self.raw_samples)
            raw_best = max(self.raw_samples)
            for rows in conditions.values():
                for row in rows.values():
                    row["fraction_of_raw"] = round(row["throughput_mib_s"] / raw, 3)
                    row["fraction_of_raw_best"] = round(row["best_throughput_mib_s"] / raw_best, 3)
            if self._raw is not None:
                self._raw.close()
            return {
                "object_bytes": cfg.object_bytes,
                "chunk_bytes": cfg.chunk_bytes,
                "part_bytes": cfg.part_bytes,
                "chunks": len(self.keys),
                "raw_limit_mib_s": round(raw, 1),
                "raw_limit_best_mib_s": round(raw_best, 1),
                "raw_runs": len(self.raw_samples),
                "statistic": "median of interleaved repeats (best run also reported)",
                "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
                "cpus": os.cpu_count(),
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
    """The result as a plain-text table (medians over repeats; best engine run too)."""
    load = result.get("load_avg_1m", [])
    lines = [
        f"object {result['object_bytes'] / MIB:.0f} MiB in chunks of "
        f"{result['chunk_bytes'] / MIB:.0f} MiB; raw limit (plain Valkey GET loop): "
        f"{result['raw_limit_mib_s']:.0f} MiB/s median of {result.get('raw_runs', 1)} runs, "
        f"best {result.get('raw_limit_best_mib_s', result['raw_limit_mib_s']):.0f}; "
        f"load {'/'.join(f'{x:.2f}' for x in load)} on {result.get('cpus', '?')} CPUs",
        f"{'condition':<10}{'store':<8}{'TTLB s':>9}{'MiB/s':>9}{'best':>7}{'naive s':>9}"
        f"{'naive':>7}{'speedup':>9}{'of raw':>8}{'paired':>8}",
    ]
    for condition, rows in result["conditions"].items():
        for kind, r in rows.items():
            paired = r.get("fraction_of_raw_paired")
            lines.append(
                f"{condition:<10}{kind:<8}{r['ttlb_s']:>9.3f}{r['throughput_mib_s']:>9.0f}"
                f"{r.get('best_throughput_mib_s', 0):>7.0f}{r['naive_ttlb_s']:>9.3f}"
                f"{r.get('naive_throughput_mib_s', 0):>7.0f}{r['speedup_vs_naive']:>9.2f}"
                f"{r['fraction_of_raw']:>8.2f}"
                + (f"{paired:>8.2f}" if paired is not None else f"{'-':>8}")
            )
    return "\n".join(lines)
