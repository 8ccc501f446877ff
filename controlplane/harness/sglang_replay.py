"""Replay of HiCache's L3 page reads on a trace's returning requests, with and without the
agent's warming: how many of the pages HiCache asks for arrive within its prefetch timeout.

What is replayed. A returning request (a turn after the first, after a pause of at least
``min_gap_s``, long enough that the session's KV has left the GPU and host memory) asks L3
for its reused prefix: the page hashes of its token ids (:mod:`kvprefetch.agents.sglang.keys`),
checked with ``batch_exists`` and read with ``batch_get_v1`` into a page-first host pool
in batches of SGLang's ``STORAGE_BATCH_SIZE`` (128 pages), in order, as SGLang 0.5.23's
cache controller does. Its ``timeout`` stop policy waits ``1.0 s + 0.25 s per 1,024``
requested tokens from the request's arrival; a batch that lands after that is not used
(the request recomputes from there). The two sides run every request one after the other,
interleaved, each with its own backend and its own (empty at start) Valkey namespace:

* ``warmed``: before the request, the agent's ``sglang`` backend runs the order the
  scheduler would send for the session (its reused tokens) and fills the node-local tier;
  the backend then reads the tier. The warm's duration is reported against the request's
  pause (``warms_within_gap_share``); the request itself starts after the warm.
* ``unwarmed``: the same backend without the agent: pages come from Valkey (empty unless an
  earlier request of the session promoted them there) and S3, through emulated links.

Scale. The bytes of a model's pages cannot be moved in a minute on a small machine, so each
page holds ``page_bytes`` and stands for ``model_page_bytes`` (default: Llama-3.1-8B, bf16,
128 KiB of K and V per token, 64-token pages: 8 MiB); the links' bandwidths
(:mod:`kvprefetch.agents.linkemu` profiles) are scaled by the same ratio, so a page spends as long
on
the link as the model's page would, and the stores' part and range sizes too, so a page
is cut into as many checksummed parts and S3 ranges as the model's page. The whole replay
then runs ``time_scale`` times faster than the trace's clock: timeouts, pauses and link
latencies divided, link bandwidths multiplied. Pages of both sides that arrive in time are
verified byte for byte against what was stored.
"""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageConfig

from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
from kvprefetch.agents.backends.sglang.warmer import SGLangWarmConfig
from kvprefetch.agents.backends.tokens import put_session_tokens, synthetic_tokens
from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.linkemu import S3_LINK, VALKEY_LINK, LinkEmulator, LinkProfile
from kvprefetch.agents.sglang.backend import KvPrefetchHiCacheStorage, SGLangStorageConfig
from kvprefetch.agents.sglang.host_pool import PageFirstHostPool
from kvprefetch.agents.sglang.keys import PageKeyScheme, page_hashes
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.agents.stores.s3.store import S3Store, S3StoreConfig
from kvprefetch.agents.stores.valkey.store import ValkeyStoreConfig
from kvprefetch.agents.transfer import TransferConfig
from kvprefetch.controlplane.base.keys import position_keys, tenant_cache_salt
from kvprefetch.controlplane.base.types import Trace
from kvprefetch.controlplane.base.wire import TransferOrder
from kvprefetch.controlplane.traces import bundled_trace_path, load_trace

MIB = 1 << 20
TENANT = "replay"
#: The tenant's cache salt: its SGLang requests carry it, so its pages are named under it
#: (as the agent's warmer names them).
SALT = tenant_cache_salt(TENANT) or None
MODEL = "replay/model"
#: The order's chunk size (the scheduler's naming; the warmer only uses the token count).
_ORDER_CHUNK_TOKENS = 256


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """Which requests, at what scale. Units in the names; times on the trace's clock."""

    trace: str = "claude-code"  # a bundled trace
    #: The first sessions (by start time) that have returning requests ...
    sessions: int = 1
    #: ... and the first returning requests of each.
    requests_per_session: int = 2
    #: A returning request follows a pause of at least this long (its KV left GPU and host).
    min_gap_s: float = 30.0
    page_tokens: int = 64  # SGLang's --page-size
    page_bytes: int = 64 * 1024  # what each replayed page holds
    model_page_bytes: int = 64 * 128 * 1024  # what it stands for (Llama-3.1-8B, bf16)
    time_scale: float = 2.0  # the replay runs this many times faster than the trace
    s3_link: LinkProfile = S3_LINK  # per connection, at model page bytes and trace time
    valkey_link: LinkProfile = VALKEY_LINK
    s3_connections: int = 64  # the S3 store fetches connections // 4 objects at once
    #: SGLang 0.5.23's prefetch timeout: base + per 1,024 requested tokens.
    timeout_base_s: float = 1.0
    timeout_per_ki_token_s: float = 0.25
    read_threads: int = 4  # the backend's local_read_threads
    warm_concurrency: int = 16  # the agent's transfer engine
    dram_dir: str = field(default_factory=tempfile.gettempdir)

    def timeout_s(self, pages: int) -> float:
        """SGLang's prefetch timeout for ``pages`` requested pages, on the replay clock."""
        tokens = pages * self.page_tokens
        return (self.timeout_base_s + tokens / 1024 * self.timeout_per_ki_token_s
                ) / self.time_scale

    @property
    def bytes_ratio(self) -> float:
        return self.page_bytes / self.model_page_bytes

    def replay_bytes(self, model_bytes: int) -> int:
        """A store's size setting (part, range) for replay pages: each replayed page is cut
        into as many parts and ranges as a model page would be."""
        return max(4096, int(model_bytes * self.bytes_ratio))

    def replay_link(self, profile: LinkProfile) -> LinkProfile:
        """``profile`` for replay pages on the replay clock."""
        return LinkProfile(latency_s=profile.latency_s / self.time_scale,
                           bandwidth_mib_s=profile.bandwidth_mib_s * self.bytes_ratio
                           * self.time_scale)


@dataclass(frozen=True, slots=True)
class ReturningRequest:
    session_id: str
    turn: int
    reused_tokens: int
    gap_s: float


def returning_requests(trace: Trace, config: ReplayConfig) -> list[ReturningRequest]:
    """The requests the replay runs, in session start order, then turn order."""
    out: list[ReturningRequest] = []
    sessions = 0
    for session in trace.sessions:
        picked = [ReturningRequest(session.session_id, r.turn, r.reused_tokens, r.gap_s)
                  for r in session.requests[1:]
                  if r.gap_s is not None and r.gap_s >= config.min_gap_s
                  and r.reused_tokens >= config.page_tokens]
        if not picked:
            continue
        out += picked[: config.requests_per_session]
        sessions += 1
        if sessions == config.sessions:
            break
    return out


@dataclass(frozen=True, slots=True)
class PrefetchOutcome:
    """One request's L3 prefetch as HiCache runs it (times from the request's arrival)."""

    found: int  # batch_exists: consecutive pages present
    in_time: int  # landed in host memory by the deadline
    local_in_time: int  # of those, read from the node-local tier
    exists_s: float  # when the existence queries were done
    landed_s: tuple[float, ...]  # when each batch read landed (the last may be late)


def hicache_prefetch(backend: KvPrefetchHiCacheStorage, hashes: list[str],
                     pool: PageFirstHostPool, timeout_s: float) -> PrefetchOutcome:
    """HiCache's L3 prefetch of ``hashes`` into ``pool`` from page 0: existence in batches
    until the first gap, then reads batch by batch, stopping at the first short batch or
    once the deadline has passed."""
    start = time.perf_counter()
    deadline = start + timeout_s
    found = 0
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i : i + STORAGE_BATCH_SIZE]
        hit = backend.batch_exists(batch)
        found += hit
        if hit < len(batch):
            break
    exists_s = time.perf_counter() - start
    in_time = local = 0
    landed_s: list[float] = []
    for i in range(0, found, STORAGE_BATCH_SIZE):
        if time.perf_counter() > deadline:  # terminated: later batches are not read
            break
        batch = hashes[i : min(i + STORAGE_BATCH_SIZE, found)]
        indices = torch.arange(i * pool.page_size, (i + len(batch)) * pool.page_size)
        before = backend.counters()["local_hits"]
        results = backend.batch_get_v1(batch, indices)
        landed = time.perf_counter()
        landed_s.append(landed - start)
        hits = next((j for j, ok in enumerate(results) if not ok), len(results))
        if landed <= deadline:
            in_time += hits
            local += min(hits, backend.counters()["local_hits"] - before)
        if hits < len(batch) or landed > deadline:
            break
    return PrefetchOutcome(found, in_time, local, exists_s, tuple(landed_s))


def page_payload(name: str, size: int) -> bytes:
    """The deterministic bytes stored for page object ``name``."""
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).bytes(size)


def _verify(pool: PageFirstHostPool, names: list[str], pages: int) -> bool:
    for i in range(pages):
        got = pool.get_data_page(i * pool.page_size).view(torch.uint8).numpy().tobytes()
        if got != page_payload(names[i], len(got)):
            return False
    return True


def _storage_config(local: LocalTierConfig | None, remote: RemoteStoreConfig,
                    read_threads: int) -> HiCacheStorageConfig:
    section = SGLangStorageConfig(local=local, remote=remote, local_read_threads=read_threads)
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=MODEL, extra_config={"kvprefetch": section.model_dump()})


@contextmanager
def _links(config: ReplayConfig, valkey: EmbeddedValkey, s3: EmbeddedS3
           ) -> Iterator[tuple[str, int, str]]:
    with ExitStack() as stack:
        vlink = stack.enter_context(LinkEmulator(
            valkey.host, valkey.port, config.replay_link(config.valkey_link), name="valkey"))
        slink = stack.enter_context(LinkEmulator(
            s3.host, s3.port, config.replay_link(config.s3_link), name="s3"))
        yield vlink.host, vlink.port, f"http://{slink.host}:{slink.port}"


@dataclass(frozen=True, slots=True)
class _Sessions:
    """The replayed sessions' token ids and page object names, and the S3 store they are in."""

    tokens: dict[str, list[int]]
    names: dict[str, list[str]]
    s3: S3StoreConfig
    valkey_part_bytes: int
    run: str


def _seed(config: ReplayConfig, requests: list[ReturningRequest], s3: EmbeddedS3
          ) -> _Sessions:
    """Store every replayed session's pages and token ids in S3 alone (what SGLang's
    write-backs left in L3; Valkey has long dropped them)."""
    run = f"r{time.monotonic_ns() % 10**9}"
    scheme = PageKeyScheme(MODEL, tp_rank=0, tp_size=1)
    tokens: dict[str, list[int]] = {}
    for r in requests:
        if r.reused_tokens > len(tokens.get(r.session_id, ())):
            tokens[r.session_id] = synthetic_tokens(TENANT, r.session_id,
                                                    r.reused_tokens).tolist()
    names = {sid: [scheme.object_name(h)
                   for h in page_hashes(t, config.page_tokens, cache_salt=SALT)]
             for sid, t in tokens.items()}
    s3_defaults = S3StoreConfig.model_fields
    s3_cfg = s3.store_config(
        key_prefix=f"kvp/{run}/", connections=config.s3_connections,
        part_bytes=config.replay_bytes(s3_defaults["part_bytes"].default),
        range_bytes=config.replay_bytes(s3_defaults["range_bytes"].default))
    with S3Store(s3_cfg) as seed:
        for sid, t in tokens.items():
            for i in range(0, len(names[sid]), 256):
                part = names[sid][i : i + 256]
                if not all(r.ok for r in seed.put(
                        [(n, page_payload(n, config.page_bytes)) for n in part])):
                    raise RuntimeError("could not seed the pages in S3")
            if not put_session_tokens(seed, TENANT, sid, t):
                raise RuntimeError("could not store the session's token ids")
    valkey_part_bytes = config.replay_bytes(
        ValkeyStoreConfig.model_fields["part_bytes"].default)
    return _Sessions(tokens, names, s3_cfg, valkey_part_bytes, run)


def _replay_one(n: int, r: ReturningRequest, config: ReplayConfig, sessions: _Sessions,
                agent: PrefetchAgent, sides: dict[str, KvPrefetchHiCacheStorage],
                pool: PageFirstHostPool) -> dict[str, Any]:
    """Warm the session as the scheduler's order would, then run the request's prefetch
    on each side. Times in the row are on the replay clock."""
    pages = r.reused_tokens // config.page_tokens
    hashes = page_hashes(sessions.tokens[r.session_id][: pages * config.page_tokens],
                         config.page_tokens, cache_salt=SALT)
    timeout = config.timeout_s(pages)
    started = time.perf_counter()
    agent.execute(TransferOrder(
        n, f"{TENANT}/{r.session_id}", 0,
        tuple(position_keys(TENANT, r.session_id, r.reused_tokens, _ORDER_CHUNK_TOKENS)),
        r.reused_tokens, 0, True, time.time() + 600))
    report = agent.wait(n, timeout_s=600)
    row: dict[str, Any] = {
        "session": r.session_id, "turn": r.turn, "pages": pages, "timeout_s": timeout,
        "gap_s": r.gap_s / config.time_scale, "warm_s": time.perf_counter() - started,
        "warm_complete": bool(report and report.complete)}
    for side, backend in sides.items():
        pool.kv_buffer.zero_()
        out = hicache_prefetch(backend, hashes, pool, timeout)
        row[side] = {"found": out.found, "in_time": out.in_time,
                     "local_in_time": out.local_in_time, "exists_s": out.exists_s,
                     "landed_s": list(out.landed_s),
                     "verified": _verify(pool, sessions.names[r.session_id], out.in_time)}
    return row


def _summary(config: ReplayConfig, rows: list[dict[str, Any]], sessions: _Sessions
             ) -> dict[str, Any]:
    pages = sum(row["pages"] for row in rows)

    def share(side: str, what: str) -> float:
        return sum(row[side][what] for row in rows) / pages

    return {
        "pages": pages,
        "warmed_in_time_share": share("warmed", "in_time"),
        "unwarmed_in_time_share": share("unwarmed", "in_time"),
        "warmed_local_share": share("warmed", "local_in_time"),
        "verified": all(row[s]["verified"] for row in rows for s in ("warmed", "unwarmed")),
        "warms_within_gap_share": sum(row["warm_s"] <= row["gap_s"] for row in rows)
        / len(rows),
        "warm_s_median": statistics.median(row["warm_s"] for row in rows),
        "requests": rows,
        "config": {
            "trace": config.trace, "sessions": sorted(sessions.tokens),
            "requests_per_session": config.requests_per_session,
            "min_gap_s": config.min_gap_s, "page_tokens": config.page_tokens,
            "page_bytes": config.page_bytes, "model_page_bytes": config.model_page_bytes,
            "time_scale": config.time_scale,
            "s3_link": config.s3_link.model_dump(),
            "valkey_link": config.valkey_link.model_dump(),
            "s3_connections": config.s3_connections,
            "timeout": f"{config.timeout_base_s} s + {config.timeout_per_ki_token_s} s "
                       "per 1,024 tokens",
        },
    }


def run_replay(config: ReplayConfig, valkey: EmbeddedValkey, s3: EmbeddedS3) -> dict[str, Any]:
    """Seed S3 with the sessions' pages and token ids, then replay every request on both
    sides (see the module docstring). JSON-able result."""
    if config.page_bytes % (2 * config.page_tokens):
        raise ValueError("page_bytes must split into K and V rows of page_tokens tokens")
    requests = returning_requests(load_trace(bundled_trace_path(config.trace)), config)
    if not requests:
        raise ValueError(f"no returning requests in {config.trace!r} with these settings")
    sessions = _seed(config, requests, s3)
    max_pages = max(r.reused_tokens // config.page_tokens for r in requests)
    pool = PageFirstHostPool(max_pages, config.page_tokens,
                             config.page_bytes // (2 * config.page_tokens), dtype=torch.uint8)
    with ExitStack() as stack:
        vhost, vport, s3_url = stack.enter_context(_links(config, valkey, s3))
        dram = stack.enter_context(tempfile.TemporaryDirectory(dir=config.dram_dir))
        pages = sum(len(n) for n in sessions.names.values())
        tier = LocalTierConfig(
            path=dram, capacity_bytes=2 * pages * (config.page_bytes + 4096) + 64 * MIB,
            part_bytes=config.replay_bytes(LocalTierConfig.model_fields["part_bytes"].default))

        def remote(side: str) -> RemoteStoreConfig:  # each side its own Valkey namespace
            return RemoteStoreConfig(
                valkey=valkey.store_config(host=vhost, port=vport,
                                           key_prefix=f"{sessions.run}:{side}:",
                                           part_bytes=sessions.valkey_part_bytes),
                s3=sessions.s3.model_copy(update={"endpoint_url": s3_url}))

        agent = stack.enter_context(PrefetchAgent(AgentConfig(
            node=0, backend="sglang", dram=tier, remote=remote("w"),
            transfer=TransferConfig(concurrency=config.warm_concurrency),
            sglang=SGLangWarmConfig(model_name=MODEL, page_size=config.page_tokens))))
        sides = {"warmed": KvPrefetchHiCacheStorage(_storage_config(
                     tier, remote("w"), config.read_threads)),
                 "unwarmed": KvPrefetchHiCacheStorage(_storage_config(
                     None, remote("u"), config.read_threads))}
        for backend in sides.values():
            stack.callback(backend.close)
            backend.register_mem_pool_host(pool)
        rows = [_replay_one(n, r, config, sessions, agent, sides, pool)
                for n, r in enumerate(requests, start=1)]
    return _summary(config, rows, sessions)
