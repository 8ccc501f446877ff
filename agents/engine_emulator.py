"""An engine emulator for CPU-only clusters: stands in for vLLM + LMCache on one node.

It serves requests with the cost model's timing
(:class:`~kvprefetch.controlplane.base.config.FleetConfig`),
every duration divided by ``time_compression``, and it moves real bytes: before prefill it
reads the reusable KV chunks from the node's local tier (files the agent published, verified
by their checksums), after the response it writes the KV it computed back to the remote
store and the local tier, as LMCache does. Object sizes are the modelled sizes times
``kv_scale`` so that a laptop can carry them. With ``backend: lmcache-mp`` it is instead a
real client of the node's LMCache MP server (:mod:`kvprefetch.agents.lmcache.engine_kv`): it
retrieves the reusable prefix from LMCache and stores new KV through it.

A request's life (as in the simulator): FIFO queue for the GPU -> ``gpu_start`` (the
scheduler dispatches a demand load, or points at a prefetch still arriving) -> wait for that
transfer (the GPU stalls) -> read the local chunks -> host-to-GPU copy and prefill of the
rest -> first token -> the GPU is free; decode -> write the new KV -> report.

Timing: the GPU keeps its own timeline (see :meth:`EngineEmulator.serve`): waits for bytes
are the transfers' real times, compute is the cost model's; the control-plane round trips
around them are measured and returned as overhead, never scaled by the compression.

Who calls what: the gateway (or the demo's replayer) calls :meth:`serve` once per request,
from many threads at once; it blocks until the response ends.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvprefetch.agents.backends.registry import (
    EngineBackendName,
    backend_spec,
    require_settings,
)
from kvprefetch.agents.lmcache.engine_kv import LMCacheEngineConfig, LMCacheEngineKV
from kvprefetch.agents.stores.base import ObjectStore
from kvprefetch.agents.stores.errors import StoreError
from kvprefetch.agents.stores.format import decode_object
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig
from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.keys import chunk_sizes, payload, session_keys
from kvprefetch.controlplane.base.tiers import LruEviction, Tier, TierEntry
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.base.wire import EngineReport, GpuStartPlan, TransferReport

log = logging.getLogger(__name__)


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    node: int = Field(ge=0)
    fleet: FleetConfig
    #: Where reusable KV is read from and new KV written: ``local`` = the agent's tier
    #: files and the remote store; ``lmcache-mp`` = the node's LMCache MP server, as a real
    #: engine-driven client (see :mod:`kvprefetch.agents.lmcache.engine_kv`).
    backend: EngineBackendName = "local"
    #: The agent's tier on this node (read-only here: the engine maps published files).
    dram: LocalTierConfig | None = None
    lmcache: LMCacheEngineConfig | None = None
    time_compression: float = Field(1.0, gt=0)
    #: Real bytes per modelled byte of KV.
    kv_scale: float = Field(1.0 / 1024, gt=0, le=1)
    chunk_tokens: int = Field(256, gt=0)
    #: Longest the GPU waits for a transfer before it recomputes instead (wall seconds).
    load_timeout_s: float = Field(30.0, gt=0)
    #: Whether to write computed KV to the remote store (LMCache's store path).
    write_remote: bool = True

    @model_validator(mode="after")
    def _backend_settings(self) -> EngineConfig:
        require_settings(self.backend, {"dram": self.dram, "lmcache": self.lmcache},
                         {"dram": "the agent's tier on this node"})
        return self


@dataclass(frozen=True, slots=True)
class ServeRequest:
    tenant: str
    session_id: str
    turn: int
    input_tokens: int
    reused_tokens: int
    output_tokens: int
    #: When the request arrived at the gateway (``time.time()``, for TTFT).
    arrival_wall_s: float
    hashes: tuple[str, ...] | None = None
    #: Tokens of the session's stored context (the previous turn's input + output), whose
    #: chunks hold the reusable prefix; None = ``reused_tokens``.
    stored_context_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ServeResult:
    """One served request. The ``*_wall_s`` instants are on the emulated GPU's timeline
    (see :class:`EngineEmulator`), in ``time.time()`` seconds; the ``*_overhead_s`` fields
    are control-plane time (wall seconds, *not* on that timeline)."""

    session_id: str
    turn: int
    node: int
    arrival_wall_s: float
    start_wall_s: float
    kv_ready_wall_s: float
    first_token_wall_s: float
    finish_wall_s: float
    reused_tokens: int
    local_tokens: int
    hbm_tokens: int
    read_bytes: int
    written_bytes: int
    #: Wall seconds the GPU waited for KV (transfer wait + host-to-GPU copy).
    stall_wall_s: float
    error: str = ""
    #: From the gateway's arrival to the engine taking the request (the route call and the
    #: call to the engine).
    route_overhead_s: float = 0.0
    #: Round trips while the GPU held the request (gpu_start, the wait's answer, use_local,
    #: local file reads), beyond the time the bytes themselves took to land.
    gpu_overhead_s: float = 0.0
    #: How far the real process ran behind the GPU timeline at the first token (>0 when
    #: round trips are longer than the emulated work they surround).
    lag_s: float = 0.0
    #: Wall seconds the GPU waited for its transfer (0 = none), and the real bytes the agent
    #: moved for it when this request's own demand load was dispatched at ``gpu_start``
    #: (0 for a wait on a transfer already under way): what a twin calibrates the link from.
    transfer_wall_s: float = 0.0
    demand_bytes_moved: int = 0
    #: Wall seconds of the node-local tier's lookup that the GPU waited for (LMCache's
    #: retrieve; 0 = no lookup), and the tokens it found.
    lookup_wall_s: float = 0.0
    lookup_tokens: int = 0
    looked_up: bool = False

    def ttft_s(self, compression: float) -> float:
        """TTFT on the service clock."""
        return (self.first_token_wall_s - self.arrival_wall_s) * compression


GpuStart = Callable[[int, str, str, int], GpuStartPlan]
UseLocal = Callable[[int, str, str, int, TransferReport | None], int]
Report = Callable[[EngineReport], None]
WaitOrder = Callable[[int, float], TransferReport | None]
#: (new chunks, superseded chunks to delete) -> chunks stored.
WriteLocal = Callable[[Sequence[tuple[str, bytes]], Sequence[str]], int]


class EngineEmulator:
    """See the module docstring. ``gpu_start``/``use_local``/``report`` reach the scheduler,
    ``wait_order``/``write_local`` the node's agent (plain calls, or Ray calls wrapped in
    :mod:`kvprefetch.agents.ray_entry`)."""

    def __init__(self, config: EngineConfig, *, gpu_start: GpuStart, use_local: UseLocal,
                 report: Report, wait_order: WaitOrder, write_local: WriteLocal,
                 store: ObjectStore | None = None) -> None:
        self.config = config
        self.node = config.node
        self._gpu_start = gpu_start
        self._use_local = use_local
        self._report = report
        self._wait_order = wait_order
        self._write_local = write_local
        self._store = store
        # Only for path_of(): never started here.
        self._tier_paths = LocalTier(config.dram) if config.dram is not None else None
        through_server = backend_spec(config.backend).engine_stores_through_server
        self._lmcache = (LMCacheEngineKV(config.lmcache, store)
                         if through_server and config.lmcache else None)
        fleet = config.fleet
        self._bpt = fleet.model.kv_bytes_per_token
        self._hbm = Tier(f"hbm{self.node}", fleet.node.hbm_kv_bytes, LruEviction())
        self._hbm_lock = threading.Lock()
        self._cv = threading.Condition()
        self._next_ticket = 0
        self._serving = 0
        #: When the emulated GPU is free again, on its timeline (``time.time()`` seconds).
        self._gpu_free_at = 0.0
        self.served = 0
        self.failed = 0

    def start(self) -> EngineEmulator:
        if self._store is not None:
            self._store.start()
        if self._lmcache is not None:
            self._lmcache.start()
        return self

    def close(self) -> None:
        if self._lmcache is not None:
            self._lmcache.close()
        if self._store is not None:
            self._store.close()

    @staticmethod
    def _sleep_until(wall_s: float) -> None:
        delay = wall_s - time.time()
        if delay > 0:
            time.sleep(delay)

    # ------------------------------------------------------------------ the GPU queue
    def _enter_gpu(self) -> float:
        """Take the next ticket, wait for this request's turn; returns when the previous
        request released the emulated GPU (on its timeline)."""
        with self._cv:
            ticket = self._next_ticket
            self._next_ticket += 1
            while self._serving != ticket:
                self._cv.wait()
            return self._gpu_free_at

    def _leave_gpu(self, free_at: float | None = None) -> None:
        with self._cv:
            if free_at is not None:
                self._gpu_free_at = max(self._gpu_free_at, free_at)
            self._serving += 1
            self._cv.notify_all()

    # ------------------------------------------------------------------ serving
    def serve(self, req: ServeRequest) -> ServeResult:
        """Serve one request (blocks until the response has ended and its KV is written).

        The emulated GPU keeps its own timeline: a request starts when it arrived and the
        GPU is free; it then waits for its KV transfer as long as the bytes really took to
        land (the agent's time to last byte for a load dispatched now, the real completion
        time for a transfer already under way), and computes for the cost model's times
        divided by ``time_compression``. The control-plane round trips around those steps
        (asking the scheduler, the agent's answer, reading files) are real work but not GPU
        time: they are measured and returned as overhead, not scaled into the TTFT."""
        cfg = self.config
        fleet = cfg.fleet
        c = cfg.time_compression
        received = time.time()
        sid = SessionKey(req.tenant, req.session_id).wire
        reuse = min(req.reused_tokens, req.input_tokens)
        free_at = self._enter_gpu()
        gpu_held = True
        start = max(req.arrival_wall_s, free_at)
        try:
            t0 = time.time()
            plan = GpuStartPlan()
            try:
                plan = self._gpu_start(self.node, req.tenant, req.session_id, reuse)
            except Exception as exc:  # no scheduler: serve from what is local, or recompute
                log.warning("engine %d: gpu_start failed: %s", self.node, exc)
            done: TransferReport | None = None
            kv_ready = start
            transfer_s = 0.0
            if plan.wait_order_id is not None:
                t_wait = time.time()
                done = self._wait_order(plan.wait_order_id, cfg.load_timeout_s)
                if done is None:  # timed out: the GPU really waited that long
                    transfer_s = time.time() - t_wait
                    kv_ready = start + transfer_s
                elif plan.dispatched:  # the load started when the GPU picked the request up
                    transfer_s = done.ttlb_wall_s
                    kv_ready = start + transfer_s
                else:  # a transfer already under way: the GPU waits until it landed
                    landed = done.done_wall_s or time.time()
                    transfer_s = max(0.0, landed - t0)
                    kv_ready = max(start, landed)
            try:
                self._use_local(self.node, req.tenant, req.session_id, reuse, done)
            except Exception as exc:
                log.warning("engine %d: use_local failed: %s", self.node, exc)
            with self._hbm_lock:
                hbm = min(reuse, self._hbm.usable_tokens(sid, float("inf")))
            stored = max(reuse, req.stored_context_tokens or reuse)
            dram = read_bytes = 0
            read_s = 0.0  # LMCache loading from L2 on lookup: KV the GPU waits for
            looked_up = hbm < reuse and self._lmcache is not None
            if looked_up and self._lmcache is not None:
                dram, read_bytes, read_s = self._lmcache.read(req.tenant, req.session_id,
                                                              stored, reuse)
                kv_ready += read_s
            elif hbm < reuse:
                keys = session_keys(req.tenant, req.session_id, stored, cfg.chunk_tokens,
                                    req.hashes)
                dram, read_bytes = self._read_local(keys, stored, reuse)
            local = max(hbm, dram)
            gpu_overhead = max(0.0, time.time() - t0 - transfer_s - read_s)
            copy_s = max(0, dram - hbm) * self._bpt / (fleet.node.h2d_gbyte_s * 1e9)
            stall_wall = (kv_ready - start) + copy_s / c
            prefill_s = fleet.prefill_s(req.input_tokens - local, local)
            first_token = kv_ready + (copy_s + prefill_s + fleet.model.decode_s_per_token
                                      + fleet.node.request_overhead_s) / c
            self._sleep_until(first_token)
            lag = max(0.0, time.time() - first_token)
            self._leave_gpu(first_token)
            gpu_held = False
            self._sleep_until(first_token + max(0, req.output_tokens - 1)
                              * fleet.model.decode_s_per_token / c)
            ctx = req.input_tokens + req.output_tokens
            written = self._write_kv(req, local, ctx)
            evicted = self._hbm_put(sid, ctx)
            finish = time.time()
            self.served += 1
            try:
                self._report(EngineReport(sid, self.node, ctx, local, reuse, evicted,
                                          written, read_bytes))
            except Exception as exc:
                log.warning("engine %d: report failed: %s", self.node, exc)
            return ServeResult(req.session_id, req.turn, self.node, req.arrival_wall_s, start,
                               kv_ready, first_token, finish, reuse, local, hbm, read_bytes,
                               written, stall_wall,
                               route_overhead_s=max(0.0, received - req.arrival_wall_s),
                               gpu_overhead_s=gpu_overhead, lag_s=lag,
                               transfer_wall_s=transfer_s,
                               demand_bytes_moved=done.bytes_moved
                               if plan.dispatched and done is not None else 0,
                               lookup_wall_s=read_s, lookup_tokens=dram if looked_up else 0,
                               looked_up=looked_up)
        except Exception as exc:
            self.failed += 1
            log.exception("engine %d: request %s/%d failed", self.node, sid, req.turn)
            now = time.time()
            return ServeResult(req.session_id, req.turn, self.node, req.arrival_wall_s, now,
                               now, now, now, reuse, 0, 0, 0, 0, 0.0,
                               error=f"{type(exc).__name__}: {exc}")
        finally:
            if gpu_held:
                self._leave_gpu(time.time())

    def _read_local(self, keys: Sequence[str], stored: int, reuse: int) -> tuple[int, int]:
        """Read and verify the leading chunks of the stored context present in the local
        tier, as far as they cover the reused prefix: (tokens, bytes)."""
        assert self._tier_paths is not None
        tokens = read = 0
        sizes = chunk_sizes(stored, self.config.chunk_tokens)
        for key, n in zip(keys, sizes, strict=False):
            if tokens >= reuse:
                break
            path = self._tier_paths.path_of(key)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                _, body = decode_object(data, expected_key=key)
            except (OSError, StoreError):
                break  # not there (or evicted under us): the rest is recomputed
            read += len(body)
            tokens += n
        return min(tokens, reuse), read

    def _write_kv(self, req: ServeRequest, local: int, ctx: int) -> int:
        """Write the chunks this request computed (from the first one not read locally)."""
        cfg = self.config
        if self._lmcache is not None:
            return self._lmcache.write(req.tenant, req.session_id, ctx)
        keys = session_keys(req.tenant, req.session_id, ctx, cfg.chunk_tokens, req.hashes)
        sizes = chunk_sizes(ctx, cfg.chunk_tokens)
        first = local // cfg.chunk_tokens
        items = [(k, payload(k, max(1, int(n * self._bpt * cfg.kv_scale))))
                 for k, n in zip(keys[first:], sizes[first:], strict=False)]
        if not items:
            return 0
        if cfg.write_remote and self._store is not None:
            try:
                res = self._store.put(items)
                bad = [r for r in res if not r.ok]
                if bad:
                    log.warning("engine %d: %d chunks not stored remotely: %s", self.node,
                                len(bad), bad[0].error)
            except StoreError as exc:
                log.warning("engine %d: remote write failed: %s", self.node, exc)
        # The previous context's last chunk, when partial, is superseded by the new
        # context's (a different key): drop it, as the scheduler's books only count the
        # current context of a session.
        stored = max(0, req.stored_context_tokens or 0)
        drop = sorted(set(session_keys(req.tenant, req.session_id, stored, cfg.chunk_tokens,
                                       req.hashes)) - set(keys)) if stored else []
        try:
            self._write_local(items, drop)
        except Exception as exc:
            log.warning("engine %d: local write-through failed: %s", self.node, exc)
        return sum(len(p) for _, p in items)

    def _hbm_put(self, sid: str, ctx: int) -> tuple[str, ...]:
        nbytes = ctx * self._bpt
        with self._hbm_lock:
            self._hbm.remove(sid)
            victims = self._hbm.victims_for(nbytes, 0.0, exclude=sid)
            if victims is None:
                return (sid,)
            for v in victims:
                self._hbm.remove(v.key)
            self._hbm.put(TierEntry(sid, ctx, nbytes, time.monotonic()))
            return tuple(v.key for v in victims)

    def pid(self) -> int:
        return os.getpid()
