"""The soak behind ``kvprefetch bench soak``: does the scheduler's memory stay flat under
steady traffic?

A :class:`~kvprefetch.controlplane.live.service.SchedulerService` runs in this process,
driven through the Python client, with its journal on (in a temporary directory) and
compaction every ``journal_compact_records`` records, so that the journal writer, its background
compaction and every per-event path of the service, the core and the predictor are
exercised. The traffic keeps the live set stable: ``live_sessions`` session slots; each
step a random slot plays a turn (``route``, then ``request_finished``, sometimes a
``tool_running`` hint); a session that has played its turns (1 to ``2 * mean_turns - 1``,
uniform) is closed and its slot gets a new session with a new id, so sessions keep
opening and closing while the number live stays the same. A share of the sessions name
their chunks by content (``chunk_hashes``), so the chunk-name journalling runs too. The
agents are stand-ins that report every order complete (the data plane is not what is
measured): the order book opens and closes orders as in production.

Every ``sample_interval_s`` it samples the process's resident set (``/proc/self/statm``),
the objects the garbage collector tracks, and the sizes of the service's collections
(sessions in the registry and in the core, timers, orders in flight, the orders'
de-duplication memory, the journal's bytes on disk). The verdict compares the resident set
at the end with the first sample after ``warmup_s``: flat when it grew by at most
``--max-growth`` (default 10%).

Warm-up has to cover the bounded collections filling up: the largest is the orders'
de-duplication memory (:data:`~kvprefetch.controlplane.live.orders.APPLIED_MEMORY`, 65,536 order
ids, about 7.7 MiB once full), which at ~600 orders/s takes about two minutes.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.base.wire import EngineReport, TransferOrder, TransferReport

_GIB = 1 << 30
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set now (Linux ``/proc/self/statm``; elsewhere the peak
    resident set, which is flat exactly when the resident set is)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) * (1 if sys.platform == "darwin" else 1024)


@dataclass(frozen=True, slots=True)
class SoakSpec:
    """One soak run."""

    #: Wall seconds of traffic, and the first part of it that is warm-up.
    duration_s: float = 360.0
    warmup_s: float = 180.0
    #: Live sessions at all times (slots; a closed session's slot gets a new session).
    live_sessions: int = 500
    #: A session plays 1 .. 2 * mean_turns - 1 turns (uniform), then is closed.
    mean_turns: int = 5
    sample_interval_s: float = 1.0
    nodes: int = 4
    #: Each node's HBM for KV and local DRAM tier: small enough that the live sessions'
    #: KV does not fit, so that evictions, demand loads and prefetch orders run.
    hbm_kv_bytes: int = 8 * _GIB
    dram_tier_bytes: int = 16 * _GIB
    policy: str = "predictive"
    predictor: str = "default"
    #: Service seconds per wall second.
    time_compression: float = 100.0
    #: Share of sessions that name their chunks by content (``chunk_hashes``).
    hashed_share: float = 0.5
    #: Chance that a turn is followed by a ``tool_running`` hint.
    hint_share: float = 0.2
    tenants: int = 2
    #: Journal on (in a temporary directory), compacted every this many records (0: never).
    journal: bool = True
    journal_compact_records: int = 20_000
    #: Events per second at most (0: closed loop, as fast as the service answers).
    max_events_per_s: float = 0.0
    #: Allowed growth of the resident set from warm-up to the end (a fraction).
    max_growth: float = 0.10
    seed: int = 0

    def __post_init__(self) -> None:
        from kvprefetch.controlplane.base.errors import ConfigError

        if not 0 <= self.warmup_s < self.duration_s:
            raise ConfigError("soak: need 0 <= warmup_s < duration_s")
        if self.live_sessions < 1 or self.mean_turns < 1 or self.tenants < 1:
            raise ConfigError("soak: live_sessions, mean_turns and tenants must be >= 1")
        if self.sample_interval_s <= 0 or self.time_compression <= 0:
            raise ConfigError("soak: sample_interval_s and time_compression must be > 0")
        if not (0 <= self.hashed_share <= 1 and 0 <= self.hint_share <= 1):
            raise ConfigError("soak: hashed_share and hint_share are fractions (0..1)")


@dataclass(slots=True)
class SoakSample:
    """One sample: wall seconds since the traffic began, and what was measured then."""

    t_s: float
    events: int
    rss_bytes: int
    gc_objects: int
    sessions_opened: int
    sessions_closed: int
    journal_bytes: int
    journal_compactions: int
    #: The service's collection sizes (``summary()["sizes"]``).
    sizes: dict[str, int] = field(default_factory=dict)


class AckingAgent:
    """An agent port that reports every order complete, all its keys moved (queued here,
    delivered by the traffic loop between calls, as an agent's report arrives between
    gateway calls); a cancelled order's queued report is dropped. Thread-safe: the service
    sends from the caller's thread and from its control loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[int, TransferReport] = {}

    def execute(self, order: TransferOrder) -> None:
        report = TransferReport(
            order_id=order.order_id, session_id=order.session_id, node=order.node,
            prefetch=order.prefetch, complete=True, cancelled=False, bytes_moved=0,
            keys_moved=len(order.keys), keys_present=0, keys_missed=0, keys_failed=0,
            ttlb_wall_s=0.0)
        with self._lock:
            self._reports[order.order_id] = report

    def cancel(self, session_id: str, order_id: int) -> None:
        with self._lock:
            self._reports.pop(order_id, None)

    def evict(self, prefixes: tuple[str, ...], keys: tuple[str, ...]) -> None:
        return None

    def take(self) -> list[TransferReport]:
        with self._lock:
            reports, self._reports = list(self._reports.values()), {}
        return reports


class HbmLru:
    """An engine's HBM prefix cache as the stand-in engines keep it: least recently served
    sessions leave first; ``put`` returns the sessions it dropped (the engine's report
    names them, so that the scheduler's mirror of HBM holds what the engine holds)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.used_tokens = 0
        self._tokens: OrderedDict[str, int] = OrderedDict()

    def put(self, sid: str, tokens: int) -> tuple[str, ...]:
        self.used_tokens += tokens - self._tokens.pop(sid, 0)
        self._tokens[sid] = tokens
        dropped: list[str] = []
        while self.used_tokens > self.capacity_tokens:
            victim, size = self._tokens.popitem(last=False)
            self.used_tokens -= size
            dropped.append(victim)
        return tuple(dropped)


@dataclass(slots=True)
class _Slot:
    """One live session of the traffic."""

    tenant: str
    sid: str
    turns_left: int
    context: int = 0
    hashes: list[str] | None = None


class _Traffic:
    """Opens, turns and closes sessions through the client (see the module docstring)."""

    def __init__(self, spec: SoakSpec, service: Any, clients: list[Any], chunk_tokens: int,
                 window: int, bytes_per_token: int, deliver: Callable[[], None]) -> None:
        self.spec, self.service, self.clients = spec, service, clients
        self.chunk = chunk_tokens
        self.window = window
        self.deliver = deliver
        self.rng = random.Random(spec.seed)
        self.hbm = [HbmLru(spec.hbm_kv_bytes // bytes_per_token) for _ in range(spec.nodes)]
        self.opened = self.closed = self.events = self.lost = 0
        self.slots = [self._new() for _ in range(spec.live_sessions)]

    def _new(self) -> _Slot:
        self.opened += 1
        rng = self.rng
        hashed = rng.random() < self.spec.hashed_share
        return _Slot(f"t{rng.randrange(self.spec.tenants)}", f"soak-{self.opened}",
                     rng.randint(1, 2 * self.spec.mean_turns - 1), 0, [] if hashed else None)

    def engine(self, node: int, tenant: str, sid: str, reused: int, context: int) -> None:
        """What the node's engine tells the scheduler about the request: the GPU picks it
        up (a demand load may be dispatched; the stand-in agents complete it at once),
        the engine reads its local tier, and reports what it served."""
        svc = self.service
        svc.gpu_start(node, tenant, sid, reused)
        self.deliver()
        local = svc.use_local(node, tenant, sid, reused)
        wire = SessionKey(tenant, sid).wire
        svc.engine_report(EngineReport(wire, node, context, local, reused,
                                       self.hbm[node].put(wire, context)))

    def step(self) -> None:
        """One turn of a random live session; closes it after its last turn."""
        rng = self.rng
        i = rng.randrange(len(self.slots))
        s = self.slots[i]
        client = self.clients[int(s.tenant[1:])]
        new = rng.randint(200, 4000)
        out = rng.randint(50, 1000)
        inp = s.context + new
        if inp + out > self.window:  # the context is full: the session ends here
            s.turns_left = 0
        else:
            hashes = None
            if s.hashes is not None:  # a chained hash per whole chunk, the prefix kept
                s.hashes.extend(f"{s.sid}-{k}" for k in range(len(s.hashes),
                                                               inp // self.chunk))
                hashes = s.hashes[: inp // self.chunk]
            try:
                ans = client.route(s.sid, input_tokens=inp, reused_tokens=s.context,
                                   chunk_hashes=hashes)
                self.events += 1
                self.deliver()
                if ans.node is None:
                    self.lost += 1
                else:
                    self.engine(ans.node, s.tenant, s.sid, s.context, inp + out)
                    client.request_finished(s.sid, node=ans.node, input_tokens=inp,
                                            output_tokens=out)
                    self.events += 1
                    s.context = inp + out
                    if rng.random() < self.spec.hint_share:
                        client.hint(s.sid, "tool_running", eta_s=rng.uniform(1.0, 60.0))
                        self.events += 1
            except Exception:  # counted: a soak measures memory, it does not stop
                self.lost += 1
            self.deliver()
            s.turns_left -= 1
        if s.turns_left <= 0:
            if s.context:
                try:
                    client.session_closed(s.sid)
                    self.events += 1
                except Exception:
                    self.lost += 1
            self.closed += 1
            self.slots[i] = self._new()


def run_soak(spec: SoakSpec, *, on_sample: Callable[[SoakSample], None] | None = None,
             journal_dir: str | Path | None = None) -> dict[str, Any]:
    """Run the soak; returns its result (the JSON of ``--json``)."""
    from kvprefetch.controlplane.base.config import FleetConfig, default_fleet
    from kvprefetch.controlplane.live.config import ServiceConfig
    from kvprefetch.controlplane.live.connect import connect
    from kvprefetch.controlplane.live.service import SchedulerService

    preset = default_fleet("8b", spec.nodes)
    node = preset.node.model_dump() | {"hbm_kv_bytes": spec.hbm_kv_bytes,
                                       "dram_tier_bytes": spec.dram_tier_bytes}
    fleet = FleetConfig.model_validate(preset.model_dump() | {"node": node})
    with tempfile.TemporaryDirectory(prefix="kvprefetch-soak-", dir=journal_dir) as tmp:
        journal = Path(tmp) / "journal.jsonl"
        cfg = ServiceConfig(
            fleet=fleet, policy=spec.policy, predictor=spec.predictor,
            time_compression=spec.time_compression,
            journal_path=str(journal) if spec.journal else None,
            journal_compact_records=spec.journal_compact_records,
            max_live_sessions_per_tenant=max(1_000, 2 * spec.live_sessions))
        agents = {node: AckingAgent() for node in range(spec.nodes)}
        svc = SchedulerService(cfg, agents=agents).start()
        clients = [connect(service=svc, tenant=f"t{k}", timeout_s=30.0)
                   for k in range(spec.tenants)]

        def deliver() -> None:
            for agent in agents.values():
                for report in agent.take():
                    svc.report_transfer(report)

        try:
            traffic = _Traffic(spec, svc, clients, cfg.chunk_tokens,
                               fleet.model.max_context_tokens,
                               fleet.model.kv_bytes_per_token, deliver)
            samples = _drive(spec, svc, traffic, journal, on_sample)
            summary = svc.summary()
        finally:
            for c in clients:
                c.close()
            svc.close()
    return _result(spec, samples, traffic, summary)


def _drive(spec: SoakSpec, svc: Any, traffic: _Traffic, journal: Path,
           on_sample: Callable[[SoakSample], None] | None) -> list[SoakSample]:
    samples: list[SoakSample] = []
    began = time.perf_counter()
    next_sample = 0.0
    while True:
        now = time.perf_counter() - began
        if now >= next_sample:
            samples.append(_sample(now, svc, traffic, journal))
            if on_sample is not None:
                on_sample(samples[-1])
            next_sample += spec.sample_interval_s
            if now >= spec.duration_s:
                return samples
        traffic.step()
        if spec.max_events_per_s > 0:
            ahead = traffic.events / spec.max_events_per_s - (time.perf_counter() - began)
            if ahead > 0:
                time.sleep(min(ahead, spec.sample_interval_s))


def _sample(t_s: float, svc: Any, traffic: _Traffic, journal: Path) -> SoakSample:
    summary = svc.summary()
    try:
        journal_bytes = journal.stat().st_size
    except OSError:
        journal_bytes = 0
    return SoakSample(
        round(t_s, 3), traffic.events, rss_bytes(), len(gc.get_objects()), traffic.opened,
        traffic.closed, journal_bytes, int(summary["journal_compactions"]),
        dict(summary["sizes"]))


def _slope_per_k(samples: list[SoakSample], value: Callable[[SoakSample], float]) -> float:
    """Least-squares growth of ``value`` per 1,000 events over ``samples``."""
    if len(samples) < 2:
        return 0.0
    xs = [s.events / 1000 for s in samples]
    ys = [value(s) for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def _result(spec: SoakSpec, samples: list[SoakSample], traffic: _Traffic,
            summary: dict[str, Any]) -> dict[str, Any]:
    after = [s for s in samples if s.t_s >= spec.warmup_s] or samples[-1:]
    warm, end = after[0], samples[-1]
    elapsed = end.t_s
    growth = (end.rss_bytes - warm.rss_bytes) / warm.rss_bytes
    return {
        "spec": asdict(spec),
        "run_s": elapsed, "events": traffic.events,
        "events_per_s": traffic.events / elapsed if elapsed > 0 else 0.0,
        "events_after_warmup": end.events - warm.events,
        "sessions_opened": traffic.opened, "sessions_closed": traffic.closed,
        "sessions_closed_after_warmup": end.sessions_closed - warm.sessions_closed,
        "lost_events": traffic.lost, "loop_errors": summary["loop_errors"],
        "journal_compactions": summary["journal_compactions"],
        "orders_sent": summary["orders_sent"], "orders_done": summary["orders_done"],
        "warm": asdict(warm), "end": asdict(end),
        "rss_growth": growth,
        "rss_peak_after_warmup_bytes": max(s.rss_bytes for s in after),
        "rss_bytes_per_k_events": _slope_per_k(after, lambda s: s.rss_bytes),
        "gc_objects_per_k_events": _slope_per_k(after, lambda s: s.gc_objects),
        "flat": growth <= spec.max_growth,
        "samples": [asdict(s) for s in samples],
    }


def format_table(result: dict[str, Any]) -> str:
    """The terminal report of a run's JSON."""
    mib = 1 << 20
    warm, end, spec = result["warm"], result["end"], result["spec"]
    lines = [
        f"soak: {result['run_s']:.0f} s ({spec['warmup_s']:.0f} s warm-up), "
        f"{result['events']:,} events ({result['events_per_s']:,.0f}/s), "
        f"{result['sessions_opened']:,} sessions opened, {result['sessions_closed']:,} "
        f"closed, {spec['live_sessions']:,} live; {result['journal_compactions']} journal "
        f"compactions; {result['lost_events']} lost events",
        f"{'':<22} {'after warm-up':>14} {'end':>14} {'growth':>9}",
        "-" * 62,
    ]

    def row(name: str, a: float, b: float, unit: str = "") -> None:
        pct = f"{(b - a) / a * 100:+.1f}%" if a else "n/a"
        lines.append(f"{name:<22} {a:>12,.1f}{unit:>2} {b:>12,.1f}{unit:>2} {pct:>9}")

    row("RSS", warm["rss_bytes"] / mib, end["rss_bytes"] / mib, "Mi")
    row("gc objects", warm["gc_objects"], end["gc_objects"])
    row("journal", warm["journal_bytes"] / mib, end["journal_bytes"] / mib, "Mi")
    for name in sorted(end["sizes"]):
        row(name, warm["sizes"].get(name, 0), end["sizes"][name])
    lines.append(f"RSS peak after warm-up {result['rss_peak_after_warmup_bytes'] / mib:,.1f} "
                 f"MiB; slope {result['rss_bytes_per_k_events'] / 1024:+,.1f} KiB and "
                 f"{result['gc_objects_per_k_events']:+,.1f} gc objects per 1,000 events")
    verdict = "flat" if result["flat"] else "NOT flat"
    lines.append(f"verdict: RSS {verdict} (grew {result['rss_growth'] * 100:+.1f}% from "
                 f"warm-up to the end; bound {spec['max_growth'] * 100:.0f}%)")
    return "\n".join(lines)
