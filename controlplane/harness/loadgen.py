"""A closed-loop load generator for the control plane (``kvprefetch bench control-plane``).

It replays a trace's session events, sped up, against one *target*:

* ``inproc``: the pure :class:`~kvprefetch.controlplane.core.scheduler.SchedulerCore` in this
process
  (no service, no lock, no client): a fleet view of idle nodes, the planning step (the
  sweep and armed orders that are due) run inline by the same thread every
  ``planner.sweep_interval_s`` of service time, as one actor would;
* ``service``: :class:`~kvprefetch.controlplane.live.service.SchedulerService` in this process
through
  the Python client (validation, the lock, the control loop's own thread);
* ``ray-1``: one scheduler actor on a local Ray runtime through the Python client's
  :class:`~kvprefetch.controlplane.live.client.RayTransport`, fire-and-forget events batched
  (:class:`~kvprefetch.controlplane.live.client.EventBatching`: each ``request_finished`` is queued
  and goes with the next ``route``'s actor call or the flush timer); the measurement ends
  when every queued event is answered, and refused ones count as lost;
* ``ray-1-sync``: the same without batching (one synchronous actor call per event);
* ``ray-2``, ``ray-4``: 2 or 4 scheduler shards (:mod:`kvprefetch.controlplane.live.sharded`), each
  call sent to the shard that owns its session, each shard's events batched; with
  ``kill_shard`` one shard is killed halfway through the measurement;
* ``http``: the HTTP API (``kvprefetch serve``'s FastAPI app on uvicorn, loopback, no
  auth) in front of a :class:`~kvprefetch.controlplane.live.service.SchedulerService`, through the
  Python client's :class:`~kvprefetch.controlplane.live.client.HttpTransport`: JSON, validation and
  one HTTP round trip per event. Server and generator share this process (and its GIL),
  so its figures are the whole path's cost on one interpreter, a floor for a server of
  its own;
* ``http-batch``: ``http`` with the finishes queued by the load process and sent in
  batches (``POST /v1/events``), the routes one call each;
* ``http-actor``: the HTTP API served in the scheduler actor's own process
  (:mod:`~kvprefetch.controlplane.live.scheduler_http`), the load from a separate process
  as for ``http``.

Sessions: ``sessions`` live sessions, session ``i`` playing the trace's session
``i mod len(trace)`` turn after turn (cycling). First every session plays its first turn
(populate: afterwards every session is live and idle, and ``bytes_per_session`` is the
memory traced by :mod:`tracemalloc` over populating, divided by the sessions, where the
scheduler runs in this process). Then ``events`` events are measured: a random live session
(seeded) plays its next turn: ``route`` (the request's arrival and routing, one event)
then ``request_finished`` (one event), back to back with no think time (closed loop: the
next call leaves when the previous one answered), while the service clock runs
``time_compression`` times faster than the wall clock. With ``concurrency`` K, K distinct
sessions play a turn at once: their routes in one ``route_many`` (one actor call per shard
through Ray), then their finishes. With ``lanes`` L, L client threads (a gateway's
workers) each run that loop over their own share of the sessions, so up to L calls are in
flight at once (``inproc`` keeps one: the core is not thread-safe).

Reported per mode: events per second over the measurement, route latency p50/p99 (as the
caller sees it), planning-step p99 (the control loop's step: due orders, sweeps, expiry),
bytes per idle session, and lost events (a call refused, timed out or failed).
"""

from __future__ import annotations

import heapq
import random
import time
import tracemalloc
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvprefetch.controlplane.base.config import FleetConfig, default_fleet
from kvprefetch.controlplane.base.errors import ConfigError, KvPrefetchError
from kvprefetch.controlplane.base.types import EventKind, SessionEvent, Trace

#: Seconds after a killed shard answers again before its routes count as "settled".
SETTLE_S = 2.0
#: Modes this generator knows, in the order a table lists them.
MODES: tuple[str, ...] = ("inproc", "service", "http", "http-batch", "http-actor",
                          "http-threaded", "ray-1", "ray-1-sync", "ray-2", "ray-4")
#: Modes whose load comes from a separate process over HTTP (:mod:`.http_load`).
HTTP_MODES: tuple[str, ...] = ("http", "http-batch", "http-actor", "http-threaded")


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """One benchmark run."""

    #: Live sessions held during the measurement.
    sessions: int = 2_000
    #: Events measured after populating (each turn is two: route, request_finished).
    events: int = 20_000
    nodes: int = 4
    policy: str = "predictive"
    predictor: str = "default"
    #: Service seconds per wall second.
    time_compression: float = 100.0
    seed: int = 0
    #: Each call's timeout through a client (seconds).
    timeout_s: float = 10.0
    #: Turns played at once while measuring: this many distinct sessions' requests are
    #: routed together (``route_many``: one actor call per shard), then finished; 1 = one
    #: route call at a time.
    concurrency: int = 1
    #: Client threads (gateway workers), each playing its own share of the sessions in
    #: its own closed loop (``concurrency`` turns at a time per lane), so that this many
    #: calls can be in flight at once: the scheduler works on one lane's batch while the
    #: others build theirs. ``inproc`` has one (the core is not thread-safe).
    lanes: int = 1
    #: Ray modes with this shard: kill it when half the events are measured (Ray restarts
    #: it; it resumes from its journal segment, so those shards journal in a temporary
    #: folder). Other modes run as without it.
    kill_shard: int | None = None
    #: ``http`` modes: the concurrent callers of the load generator's process, one
    #: measurement of ``events`` events per count, in order.
    callers: tuple[int, ...] = (1, 8, 32, 128)

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.events < 2 or self.nodes < 1:
            raise ConfigError("sessions and nodes must be >= 1 and events >= 2")
        if not 1 <= self.lanes <= 64:
            raise ConfigError("lanes must be 1-64")
        if self.kill_shard is not None and self.lanes > 1:
            # each shard's route times are read after each call, one call at a time
            raise ConfigError("kill_shard is measured with one lane")
        if not 1 <= self.concurrency * self.lanes <= self.sessions:
            raise ConfigError(f"concurrency x lanes must be 1-{self.sessions} (the sessions)")
        if self.kill_shard is not None and self.kill_shard < 0:
            raise ConfigError("kill_shard must be >= 0")
        if self.time_compression <= 0:
            raise ConfigError("time_compression must be > 0")
        if not self.callers or min(self.callers) < 1:
            raise ConfigError("callers must be >= 1")

    def check_http(self) -> None:
        """Raise :class:`ConfigError` unless the ``http`` modes can run this spec: each
        caller needs a session of its own."""
        if max(self.callers) > self.sessions:
            raise ConfigError(f"callers must be 1-{self.sessions} (the sessions)")


@dataclass(slots=True)
class ModeResult:
    """What one mode measured (``None``: not measurable in this mode)."""

    mode: str
    events_per_s: float
    route_p50_ms: float
    route_p99_ms: float
    plan_p99_ms: float | None
    bytes_per_session: float | None
    lost_events: int
    #: Events sent while measuring, and wall seconds to populate the sessions.
    events: int = 0
    populate_s: float = 0.0
    #: Eviction-index work of the core over the run, where it is visible.
    eviction_index: dict[str, int] = field(default_factory=dict)
    #: The client's event batching (ray modes), cumulative over populating and measuring.
    batching: dict[str, int] = field(default_factory=dict)
    shards: int = 1
    #: Ray modes: each shard actor's resident memory (MiB) before populating and after the
    #: measurement (the actors' memory is not traced from here).
    shard_rss_mib: dict[str, list[float]] = field(default_factory=dict)
    #: With ``kill_shard``: seconds until the killed shard answered again, and each shard's
    #: route p99 (ms) before and after the kill.
    kill: dict[str, Any] = field(default_factory=dict)
    #: Ray modes: CPU seconds used while measuring by each shard actor's process (None for
    #: one restarted meanwhile) and by this process (the generator and its Ray driver).
    cpu_s: dict[str, float | None] = field(default_factory=dict)
    #: ``http`` modes: each caller count's figures (see
    #: :class:`~kvprefetch.controlplane.harness.http_load.LevelResult`); the mode's own
    #: figures are the last count's.
    callers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ``http`` modes: the events the server took over the drive (populating included),
    #: over which ``cpu_s`` was measured.
    server_events: int = 0

    @property
    def server_cpu_ms_per_event(self) -> float | None:
        """``http`` modes: CPU milliseconds the server side (the actor's process and the
        serve process together) spent per event it took; None elsewhere."""
        if not self.server_events or not self.cpu_s:
            return None
        if any(v is None for v in self.cpu_s.values()):
            return None
        total = sum(v for v in self.cpu_s.values() if v is not None)
        return round(1e3 * total / self.server_events, 4)

    @property
    def events_per_shard_cpu_s(self) -> float | None:
        """Events per CPU second of the shards together: what they would sustain with a
        core each at the CPU cost per event measured (Ray modes; None without it)."""
        shard_cpu = [v for k, v in self.cpu_s.items() if k != "generator"]
        if self.callers or not shard_cpu or any(v is None for v in shard_cpu):
            return None
        total = sum(v for v in shard_cpu if v is not None)
        return self.events / total if total > 0 else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["events_per_shard_cpu_s"] = self.events_per_shard_cpu_s
        out["server_cpu_ms_per_event"] = self.server_cpu_ms_per_event
        return out


class Target(Protocol):
    """What the generator drives. ``route`` answers the node (None: the call was lost);
    ``finished`` whether the event was accepted. ``poll`` runs between calls (the inline
    planning step of ``inproc``)."""

    def route(self, sid: str, input_tokens: int, reused_tokens: int) -> int | None: ...

    def route_many(self, turns: Sequence[tuple[str, int, int]]) -> list[int | None]:
        """``route`` of each (session, input, reused), at once where the target can."""
        ...

    def finished(self, sid: str, node: int, input_tokens: int, output_tokens: int,
                 stop_reason: str | None) -> bool: ...

    def poll(self) -> None: ...

    def settle(self) -> int:
        """Wait until every event sent is answered; the events refused meanwhile (events
        queued by the client answer at once)."""
        ...

    def plan_steps_s(self) -> list[float]: ...

    def index_stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; 0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered))))]


# ------------------------------------------------------------------------------- targets
class CoreTarget:
    """``inproc``: the pure core, its planning step run inline (see the module doc)."""

    def __init__(self, fleet: FleetConfig, spec: LoadSpec) -> None:
        from kvprefetch.controlplane.core.policies import POLICIES
        from kvprefetch.controlplane.core.scheduler import IdleFleet, SchedulerCore
        from kvprefetch.predictors.registry import load as load_predictor

        policy = POLICIES[spec.policy]
        self.core = SchedulerCore(fleet, policy, load_predictor(policy.predictor
                                                                or spec.predictor),
                                  IdleFleet())
        self._compression = spec.time_compression
        self._start = time.perf_counter()
        self._sweep_s = fleet.planner.sweep_interval_s
        self._next_sweep = self._sweep_s
        self._armed: list[tuple[float, int, Any]] = []
        self._n = 0
        self._plan_s: list[float] = []

    def _now(self) -> float:
        return (time.perf_counter() - self._start) * self._compression

    def _arm(self, orders: Sequence[Any]) -> None:
        for order in orders:
            self._n += 1
            heapq.heappush(self._armed, (order.start_at_s, self._n, order))

    def route(self, sid: str, input_tokens: int, reused_tokens: int) -> int | None:
        now = self._now()
        self.core.request_started(SessionEvent(EventKind.REQUEST_STARTED, sid, now,
                                               input_tokens=input_tokens,
                                               reused_tokens=reused_tokens))
        out = self.core.route_request(sid, input_tokens, reused_tokens, now)
        self._arm(out.orders)
        return out.node

    def route_many(self, turns: Sequence[tuple[str, int, int]]) -> list[int | None]:
        return [self.route(*t) for t in turns]

    def finished(self, sid: str, node: int, input_tokens: int, output_tokens: int,
                 stop_reason: str | None) -> bool:
        now = self._now()
        out = self.core.request_finished(
            SessionEvent(EventKind.REQUEST_FINISHED, sid, now, input_tokens=input_tokens,
                         output_tokens=output_tokens, stop_reason=stop_reason, node=node),
            input_tokens + output_tokens)
        self._arm(out.orders)
        # Transfers complete at once (the data plane is not what is measured).
        for t in out.loads:
            self.core.transfer_done(t.session_id, t.node, now, demand=not t.prefetch)
        return True

    def poll(self) -> None:
        now = self._now()
        if now < self._next_sweep and not (self._armed and self._armed[0][0] <= now):
            return
        began = time.perf_counter()
        while self._armed and self._armed[0][0] <= now:
            order = heapq.heappop(self._armed)[2]
            out = self.core.start_prefetch(order, now)
            self._arm(out.orders)
            for t in out.loads:
                self.core.transfer_done(t.session_id, t.node, now, demand=False)
        if now >= self._next_sweep:
            self._arm(self.core.sweep(now).orders)
            self._next_sweep = now + self._sweep_s
        self._plan_s.append(time.perf_counter() - began)

    def settle(self) -> int:
        return 0

    def plan_steps_s(self) -> list[float]:
        return list(self._plan_s)

    def index_stats(self) -> dict[str, int]:
        return asdict(self.core.eviction_index_stats())

    def close(self) -> None:
        return None


class ClientTarget:
    """``service`` and ``ray-1``: the Python client over a scheduler (see the module doc).
    ``summary`` reads the scheduler's summary (its planning steps)."""

    def __init__(self, client: Any, summary: Callable[[], dict[str, Any]],
                 close: Callable[[], None]) -> None:
        self.client = client
        self._summary = summary
        self._close = close
        self._plan_from: list[int] = []

    def route(self, sid: str, input_tokens: int, reused_tokens: int) -> int | None:
        try:
            ans = self.client.route(sid, input_tokens=input_tokens,
                                    reused_tokens=reused_tokens)
        except KvPrefetchError:
            return None
        return _node_of(ans)

    def route_many(self, turns: Sequence[tuple[str, int, int]]) -> list[int | None]:
        answers = self.client.route_many([{"session_id": sid, "input_tokens": inp,
                                           "reused_tokens": reused}
                                          for sid, inp, reused in turns])
        return [_node_of(a) for a in answers]

    def finished(self, sid: str, node: int, input_tokens: int, output_tokens: int,
                 stop_reason: str | None) -> bool:
        try:
            ack = self.client.request_finished(sid, node=node, input_tokens=input_tokens,
                                               output_tokens=output_tokens,
                                               stop_reason=stop_reason)
        except KvPrefetchError:
            return False
        return bool(ack.accepted)

    def poll(self) -> None:
        return None

    def _batchers(self) -> list[Any]:
        transport = self.client.scheduler
        batchers = getattr(transport, "batchers", None)
        if batchers is not None:
            return list(batchers)
        batcher = getattr(transport, "batcher", None)
        return [] if batcher is None else [batcher]

    def settle(self) -> int:
        refused = 0
        for batcher in self._batchers():
            before = batcher.stats.refused
            batcher.flush(wait=True)
            refused += int(batcher.stats.refused - before)
        return refused

    def batch_stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for batcher in self._batchers():
            for k, v in asdict(batcher.stats).items():
                total[k] = total.get(k, 0) + v
        return total

    def _plan_windows(self) -> list[tuple[int, list[float]]]:
        """(planning steps so far, the latest ones' seconds) of each shard."""
        summary = self._summary()
        return [(int(p.get("plan_steps", 0)), list(p.get("plan_step_s", ())))
                for p in summary.get("per_shard", [summary])]

    def mark(self) -> None:
        """Planning steps from now on are the measurement's."""
        self._plan_from = [n for n, _ in self._plan_windows()]

    def plan_steps_s(self) -> list[float]:
        """Each shard's planning steps since :meth:`mark` (as many as its rolling window
        still holds)."""
        out: list[float] = []
        for (n, window), before in zip(self._plan_windows(), self._plan_from, strict=True):
            new = n - before
            out.extend(window[-new:] if new > 0 else [])
        return out

    def index_stats(self) -> dict[str, int]:
        return dict(self._summary().get("eviction_index", {}))

    def close(self) -> None:
        self._close()


def _node_of(answer: Any) -> int | None:
    return None if answer.timed_out or answer.node is None else int(answer.node)


# ------------------------------------------------------------------------------- the loop
@dataclass(slots=True)
class _Player:
    """Turn by turn replay of trace sessions by many live sessions."""

    trace: Trace
    window: int
    turns: list[int]

    def turn(self, i: int) -> tuple[int, int, int, str | None]:
        """(input, reused, output tokens, stop reason) of session ``i``'s next turn."""
        requests = self.trace.sessions[i % len(self.trace.sessions)].requests
        k = self.turns[i]
        self.turns[i] = k + 1
        r = requests[k % len(requests)]
        inp = min(r.input_tokens, self.window)
        reused = min(r.reused_tokens, inp) if k % len(requests) else 0
        return inp, reused, max(0, min(r.output_tokens, self.window - inp)), r.stop_reason


def run_mode(mode: str, trace: Trace, spec: LoadSpec,
             progress: Callable[[int], None] | None = None) -> ModeResult:
    """Populate ``spec.sessions`` sessions, measure ``spec.events`` events; one mode."""
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if not trace.sessions:
        raise ConfigError(f"trace {trace.name!r} has no sessions")
    fleet = default_fleet("8b", spec.nodes)
    if mode in HTTP_MODES:
        return _run_http(mode, trace, fleet, spec)
    player = _Player(trace, fleet.model.max_context_tokens, [0] * spec.sessions)
    sids = [f"bench-{i}" for i in range(spec.sessions)]
    lost = 0
    traced = not mode.startswith("ray-")
    if traced:
        tracemalloc.start()
    target = _target(mode, fleet, spec)
    try:
        base = tracemalloc.get_traced_memory()[0] if traced else 0
        rss_before = target.rss_mib() if isinstance(target, RayTarget) else []
        began = time.perf_counter()
        # Populate: every session plays its first turn, ``concurrency`` at a time.
        for start in range(0, spec.sessions, spec.concurrency):
            idx = range(start, min(spec.sessions, start + spec.concurrency))
            if len(idx) == 1:
                lost += _turn(target, player, idx[0], sids[idx[0]], None)
            else:
                lost += _turns(target, player, idx, sids, None)
            target.poll()
            if progress is not None and (idx[-1] + 1) // 1000 > start // 1000:
                progress(2000 * ((idx[-1] + 1) // 1000 - start // 1000))
        lost += target.settle()
        populate_s = time.perf_counter() - began
        bytes_per = None
        if traced:
            bytes_per = (tracemalloc.get_traced_memory()[0] - base) / spec.sessions
            tracemalloc.stop()
            traced = False
        if isinstance(target, ClientTarget):
            target.mark()
        plan_before = len(target.plan_steps_s()) if isinstance(target, CoreTarget) else 0
        cpu_before = target.cpu_s() if isinstance(target, RayTarget) else []
        generator_cpu = time.process_time()
        routes: list[float] = []
        turns = spec.events // 2
        began = time.perf_counter()
        lost += _measure(target, player, sids, spec, turns, routes, progress)
        lost += target.settle()  # queued events count once answered
        elapsed = time.perf_counter() - began
        cpu: dict[str, float | None] = {}
        if isinstance(target, RayTarget):
            for i, (b, a) in enumerate(zip(cpu_before, target.cpu_s(), strict=True)):
                # A killed shard's new process counts from its restart: not comparable.
                cpu[f"shard-{i}"] = None if i == target.killed_shard else round(a - b, 3)
            cpu["generator"] = round(time.process_time() - generator_cpu, 3)
        plans = target.plan_steps_s()[plan_before:]
        index = target.index_stats()
        batching = target.batch_stats() if isinstance(target, ClientTarget) else {}
        kill = target.kill_report() if isinstance(target, RayTarget) else {}
        shards = target.shards if isinstance(target, RayTarget) else 1
        rss = ({str(i): [b, a] for i, (b, a) in enumerate(zip(rss_before, target.rss_mib(),
                                                              strict=True))}
               if isinstance(target, RayTarget) else {})
    finally:
        if traced:
            tracemalloc.stop()
        target.close()
    return ModeResult(
        mode, 2 * turns / elapsed if elapsed > 0 else 0.0, quantile(routes, 0.5) * 1e3,
        quantile(routes, 0.99) * 1e3, quantile(plans, 0.99) * 1e3 if plans else None,
        bytes_per, lost, 2 * turns, round(populate_s, 3), index, batching, shards, rss, kill,
        cpu)


def _measure(target: Target, player: _Player, sids: Sequence[str], spec: LoadSpec,
             turns: int, routes: list[float], progress: Callable[[int], None] | None
             ) -> int:
    """Play ``turns`` turns over ``spec.lanes`` client threads; the events lost. Lane
    ``j`` plays sessions ``j, j + lanes, ...`` (no session is in two lanes) with its own
    random stream; lane 0 kills the shard (``kill_shard``) when it is halfway."""
    lanes = 1 if isinstance(target, CoreTarget) else spec.lanes
    share = [turns // lanes + (j < turns % lanes) for j in range(lanes)]
    done_lost = [0] * lanes
    lane_routes: list[list[float]] = [[] for _ in range(lanes)]

    def lane(j: int) -> None:
        mine = list(range(j, spec.sessions, lanes))
        rng = random.Random(spec.seed + 7919 * j)
        kill_at = share[j] // 2 if j == 0 and spec.kill_shard is not None else None
        k = 0
        while k < share[j]:
            if kill_at is not None and k >= kill_at:
                if isinstance(target, RayTarget):
                    target.kill()
                kill_at = None
            if spec.concurrency == 1:
                i = mine[rng.randrange(len(mine))]
                done_lost[j] += _turn(target, player, i, sids[i], lane_routes[j])
                n = 1
            else:
                n = min(spec.concurrency, share[j] - k)
                done_lost[j] += _turns(target, player, rng.sample(mine, n), sids,
                                       lane_routes[j])
            target.poll()
            if progress is not None and (k + n) // 500 > k // 500:
                progress(1000 * ((k + n) // 500 - k // 500))
            k += n

    if lanes == 1:
        lane(0)
    else:
        with ThreadPoolExecutor(lanes, thread_name_prefix="loadgen-lane") as pool:
            for f in [pool.submit(lane, j) for j in range(lanes)]:
                f.result()
    for r in lane_routes:
        routes.extend(r)
    return sum(done_lost)


def _turn(target: Target, player: _Player, i: int, sid: str,
          routes: list[float] | None) -> int:
    """One turn of session ``i``: route, then finish. Returns the events lost."""
    inp, reused, out, stop = player.turn(i)
    began = time.perf_counter()
    node = target.route(sid, inp, reused)
    if routes is not None:
        routes.append(time.perf_counter() - began)
    if node is None:
        return 2  # nothing to finish on
    return 0 if target.finished(sid, node, inp, out, stop) else 1


def _turns(target: Target, player: _Player, idx: Sequence[int], sids: Sequence[str],
           routes: list[float] | None) -> int:
    """One turn each of sessions ``idx``, played at once: their routes together, then
    their finishes. Every route waited as long as the call that carried it."""
    plays = [player.turn(i) for i in idx]
    began = time.perf_counter()
    nodes = target.route_many([(sids[i], inp, reused)
                               for i, (inp, reused, _, _) in zip(idx, plays, strict=True)])
    if routes is not None:
        routes.extend([time.perf_counter() - began] * len(idx))
    lost = 0
    for i, (inp, _, out, stop), node in zip(idx, plays, nodes, strict=True):
        if node is None:
            lost += 2
        elif not target.finished(sids[i], node, inp, out, stop):
            lost += 1
    return lost


def _service_config(fleet: FleetConfig, spec: LoadSpec) -> Any:
    from kvprefetch.controlplane.live.config import ServiceConfig

    return ServiceConfig(fleet=fleet, policy=spec.policy, predictor=spec.predictor,
                         time_compression=spec.time_compression,
                         max_live_sessions_per_tenant=max(100_000, 2 * spec.sessions))


def _run_http(mode: str, trace: Trace, fleet: FleetConfig, spec: LoadSpec) -> ModeResult:
    """An ``http`` mode: the server as ``kvprefetch serve`` runs it (:class:`HttpTarget`),
    the load from a child process at each of ``spec.callers`` (:mod:`.http_load`)."""
    from kvprefetch.controlplane.harness.http_load import BATCH_EVENTS, drive

    spec.check_http()

    window = fleet.model.max_context_tokens
    plays = []
    for session in trace.sessions:
        turns = []
        for r in session.requests:
            inp = min(r.input_tokens, window)
            turns.append((inp, min(r.reused_tokens, inp),
                          max(0, min(r.output_tokens, window - inp)), r.stop_reason))
        if turns:
            plays.append(turns)
    target = HttpTarget(_service_config(fleet, spec), spec, threaded=mode == "http-threaded",
                        in_actor=mode == "http-actor")
    try:
        began = time.perf_counter()
        target.mark()
        actor_cpu, own_cpu = target.cpu_s()[0], time.process_time()
        levels = drive(target.url, callers=spec.callers, events=spec.events,
                       sessions=spec.sessions, plays=plays, seed=spec.seed,
                       timeout_s=spec.timeout_s,
                       batch_events=BATCH_EVENTS if mode == "http-batch" else 0)
        lost = sum(level.lost_events for level in levels) + target.settle()
        # The server side's CPU over the whole drive (populating included): the actor's
        # process, and this one (the HTTP API's in http and http-threaded; idle in
        # http-actor, whose API is in the actor's process).
        cpu: dict[str, float | None] = {
            "shard-0": round(target.cpu_s()[0] - actor_cpu, 3),
            "serve-process": round(time.process_time() - own_cpu, 3)}
        wall_s = time.perf_counter() - began
        plans = target.plan_steps_s()
        batching = target.batch_stats()
    finally:
        target.close()
    last = levels[-1]
    return ModeResult(
        mode, last.events_per_s, last.route_p50_ms, last.route_p99_ms,
        quantile(plans, 0.99) * 1e3 if plans else None, None, lost,
        events=sum(level.events for level in levels),
        populate_s=round(wall_s - sum(level.seconds for level in levels), 3),
        batching=batching, callers={str(level.callers): asdict(level) for level in levels},
        cpu_s=cpu, server_events=2 * spec.sessions + sum(level.events for level in levels))


def _target(mode: str, fleet: FleetConfig, spec: LoadSpec) -> Target:
    if mode == "inproc":
        return CoreTarget(fleet, spec)
    from kvprefetch.controlplane.live.connect import connect

    cfg = _service_config(fleet, spec)
    if mode == "service":
        from kvprefetch.controlplane.live.service import SchedulerService

        svc = SchedulerService(cfg).start()
        client = connect(service=svc, timeout_s=spec.timeout_s)

        def close_service() -> None:
            client.close()
            svc.close()

        return ClientTarget(client, svc.summary, close_service)
    return RayTarget(cfg, spec, shards=1 if mode.startswith("ray-1") else int(mode[4:]),
                     batched=mode != "ray-1-sync")


class RayTarget(ClientTarget):
    """``ray-N``: ``N`` scheduler shards (no agents) on a local Ray runtime started here,
    through the Python client (sharded when ``N`` > 1). :meth:`kill` kills one shard the
    way a crash would; Ray restarts it and it resumes from its journal segment."""

    def __init__(self, cfg: Any, spec: LoadSpec, *, shards: int, batched: bool,
                 http: Any = None) -> None:
        import tempfile
        import uuid

        import ray

        from kvprefetch.controlplane.live.client import EventBatching
        from kvprefetch.controlplane.live.connect import connect
        from kvprefetch.controlplane.live.ray_app import start_shards

        self._tmp = tempfile.TemporaryDirectory(prefix="kvprefetch-bench-")
        #: The shard to kill (None: none, or this mode has no such shard).
        self._to_kill = (spec.kill_shard if spec.kill_shard is not None
                         and spec.kill_shard < shards else None)
        if self._to_kill is not None:
            cfg = cfg.model_copy(update={"journal_path": f"{self._tmp.name}/journal.jsonl"})
        self.shards = shards
        namespace = f"kvprefetch-bench-{uuid.uuid4().hex[:8]}"
        self._started = not ray.is_initialized()
        if self._started:
            ray.init(namespace=namespace, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        self._handles = start_shards(cfg, shards, namespace=namespace, with_agents=False,
                                     http=http)
        client = connect("auto", namespace=namespace, timeout_s=spec.timeout_s,
                         batching=EventBatching() if batched else None)
        transport: Any = client.scheduler
        super().__init__(client, transport.summary, self._close_ray)
        #: (seconds since the kill, -1 before it; shard; seconds it took) of each shard's
        #: answer to every batch of routes.
        self._shard_routes: list[tuple[float, int, float]] = []
        self._killed_at: float | None = None
        self._restart_s: float | None = None
        self._killed: int | None = None

    def route_many(self, turns: Sequence[tuple[str, int, int]]) -> list[int | None]:
        nodes = super().route_many(turns)
        per_shard = getattr(self.client.scheduler, "last_route_s", None)
        if per_shard is not None:
            since = (time.perf_counter() - self._killed_at
                     if self._killed_at is not None else -1.0)
            self._shard_routes.extend((since, s, t) for s, t in enumerate(per_shard)
                                      if t is not None)
        return nodes

    @property
    def killed_shard(self) -> int | None:
        """The shard :meth:`kill` killed, if it did."""
        return self._killed

    def cpu_s(self) -> list[float]:
        """Each shard actor process's CPU seconds so far (a restarted one counts anew)."""
        import ray

        return list(ray.get([h.cpu_seconds.remote() for h in self._handles], timeout=30))

    def rss_mib(self) -> list[float]:
        """Each shard actor's resident memory now, MiB."""
        import ray

        return [round(b / (1 << 20), 1)
                for b in ray.get([h.rss_bytes.remote() for h in self._handles], timeout=30)]

    def kill(self) -> None:
        """Kill the shard ``kill_shard`` names, if this mode has it (Ray restarts it); a
        thread times its first answer."""
        import threading

        import ray

        shard = self._to_kill
        if shard is None:
            return
        handle = self._handles[shard]
        old_epoch = ray.get(handle.epoch.remote(), timeout=30)
        self._killed, self._killed_at = shard, time.perf_counter()
        ray.kill(handle, no_restart=False)

        def wait_up() -> None:
            while True:
                try:
                    if ray.get(handle.epoch.remote(), timeout=30) == old_epoch:
                        raise RuntimeError("the old incarnation still answers")
                except Exception:  # dead, restarting or not yet dead: ask again
                    time.sleep(0.05)
                    continue
                assert self._killed_at is not None
                self._restart_s = time.perf_counter() - self._killed_at
                return

        threading.Thread(target=wait_up, name="kvprefetch-bench-restart", daemon=True).start()

    def kill_report(self) -> dict[str, Any]:
        if self._killed is None:
            return {}
        settled = (self._restart_s or 0.0) + SETTLE_S
        windows: dict[str, Callable[[float], bool]] = {
            "before": lambda since: since < 0, "after": lambda since: since >= 0,
            # from SETTLE_S after the killed shard answered again (its replay is over)
            "settled": lambda since: since >= settled}
        p99: dict[str, dict[str, float | None]] = {}
        for shard in range(self.shards):
            for side, within in windows.items():
                picked = [t for since, s, t in self._shard_routes if s == shard and within(since)]
                p99.setdefault(str(shard), {})[side] = (
                    round(quantile(picked, 0.99) * 1e3, 3) if picked else None)
        return {"shard": self._killed, "restart_s": self._restart_s,
                "route_p99_ms_by_shard": p99}

    def _close_ray(self) -> None:
        import ray

        self.client.close()
        try:
            ray.get([h.close.remote() for h in self._handles], timeout=10)
            for h in self._handles:
                ray.kill(h, no_restart=True)
        finally:
            if self._started:
                ray.shutdown()
            self._tmp.cleanup()


class _Blocking:
    """A transport's blocking calls only (no ``acall``): the HTTP API then calls it on
    its thread pool (``http-threaded``)."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    def with_timeout(self, timeout_s: float) -> _Blocking:
        return _Blocking(self._transport.with_timeout(timeout_s))

    def __getattr__(self, name: str) -> Any:
        if name == "acall":
            raise AttributeError(name)
        return getattr(self._transport, name)


class HttpTarget(RayTarget):
    """``http``: one scheduler actor on a local Ray runtime started here and the HTTP API
    in front of it in this process, as ``kvprefetch serve`` runs them (the app on uvicorn
    on a thread, its client of the actor, no auth); ``http-actor``: the API served in the
    actor's own process instead (``http.front_end: scheduler``); the load comes from
    another process (:func:`_run_http`)."""

    def __init__(self, cfg: Any, spec: LoadSpec, *, threaded: bool = False,
                 in_actor: bool = False) -> None:
        from kvprefetch.controlplane.live.http_api import HttpServer, create_app
        from kvprefetch.controlplane.live.scheduler_http import HttpFrontEnd

        super().__init__(cfg, spec, shards=1, batched=not threaded,
                         http=HttpFrontEnd() if in_actor else None)
        self._server: HttpServer | None = None
        if in_actor:
            import ray

            self.url = str(ray.get(self._handles[0].http_url.remote(), timeout=30))
            return
        scheduler: Any = self.client
        if threaded:
            scheduler = _Blocking(self.client.scheduler)
        self._server = HttpServer(create_app(scheduler, chunk_tokens=cfg.chunk_tokens))
        self._server.start()
        self.url = self._server.url

    def _close_ray(self) -> None:
        if self._server is not None:
            self._server.close()
        super()._close_ray()


def format_table(result: dict[str, Any]) -> str:
    """The terminal table of a run's JSON."""

    def num(v: float | None, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    def ms(v: float | None, width: int, places: int) -> str:
        """Milliseconds right-aligned in ``width`` columns, unit included; a value not
        measured is ``n/a``, without the unit."""
        return f"{'n/a' if v is None else f'{v:.{places}f}ms':>{width}}"

    lines = [f"{result['sessions']:,} live sessions, {result['events']:,} events measured "
             f"per mode; trace {result['trace']}; {result['nodes']} nodes; policy "
             f"{result['policy']}",
             f"{'mode':<9} {'events/s':>10} {'route p50':>10} {'route p99':>10} "
             f"{'plan p99':>9} {'B/session':>10} {'lost':>6}",
             "-" * 70]
    for mode, m in result["modes"].items():
        # An http mode: a row per caller count (its own figures are the last count's).
        rows = [(f"{mode} x{n}", level) for n, level in (m.get("callers") or {}).items()]
        for name, r in rows or [(mode, m)]:
            lines.append(f"{name:<9} {r['events_per_s']:>10,.0f} "
                         f"{ms(r['route_p50_ms'], 10, 3)} {ms(r['route_p99_ms'], 10, 3)} "
                         f"{ms(m['plan_p99_ms'], 9, 2)} "
                         f"{num(m.get('bytes_per_session'), '>10,.0f'):>10} "
                         f"{r['lost_events']:>6}")
        if rows:
            lines.append(f"{mode}: load from a separate process; its CPU per wall second "
                         "by callers: " + ", ".join(
                             f"x{n} {level['generator_cores']:.2f}"
                             for n, level in m["callers"].items()))
            if m.get("server_cpu_ms_per_event") is not None:
                cpu = m["cpu_s"]
                lines.append(f"{mode}: server CPU per event {m['server_cpu_ms_per_event']:.3f} "
                             f"ms over {m['server_events']:,} events (actor "
                             f"{cpu['shard-0']:.1f} s, serve process "
                             f"{cpu['serve-process']:.1f} s)")
    ray1 = result["modes"].get("ray-1", {})
    base, base_cpu = ray1.get("events_per_s"), ray1.get("events_per_shard_cpu_s")
    for mode, m in result["modes"].items():
        if m.get("callers"):
            continue  # an http mode: its CPU is per event, above
        if m.get("shards", 1) > 1 and base:
            lines.append(f"{mode}: {m['events_per_s'] / base:.2f}x ray-1's events/s")
        cpu, per_cpu = m.get("cpu_s") or {}, m.get("events_per_shard_cpu_s")
        if cpu and m.get("events"):
            wall = m["events"] / m["events_per_s"] if m["events_per_s"] else 0.0
            cores = ", ".join(f"{k} {num(v / wall if v is not None and wall else None, '.2f')}"
                              for k, v in cpu.items())
            line = f"{mode}: cores busy while measuring: {cores}"
            if per_cpu:
                line += f"; {per_cpu:,.0f} events per shard-CPU-second"
                if base_cpu and m.get("shards", 1) > 1:
                    line += (f" (with a core per shard: {m['shards'] * per_cpu / base_cpu:.2f}x "
                             "ray-1's)")
            lines.append(line)
        kill = m.get("kill") or {}
        if kill:
            restart = kill["restart_s"]
            lines.append(f"{mode}: shard {kill['shard']} killed halfway, answering again "
                         f"after {num(restart, '.2f')}{'' if restart is None else ' s'}; "
                         "route p99 ms by shard before -> "
                         f"after (-> from {SETTLE_S:g} s after its restart): " + ", ".join(
                             f"{s} {num(v['before'], '.3f')} -> {num(v['after'], '.3f')} "
                             f"({num(v['settled'], '.3f')})"
                             for s, v in kill["route_p99_ms_by_shard"].items()))
    return "\n".join(lines)
