"""Prefetch planning for idle sessions: :class:`Prefetcher`.

An idle session whose KV is not (wholly) on its home node gets at most one armed
:class:`~kvprefetch.controlplane.core.planner.PrefetchOrder`, timed by
:func:`~kvprefetch.controlplane.core.planner.plan_prefetch` from its forecast. Who calls
what: :meth:`Prefetcher.plan` after each finish, hint, eviction or loss of the session's
KV (by the core and the tier books); :meth:`Prefetcher.start` when an order's
``start_at_s`` comes (re-checked: started, re-armed later, or dropped); :meth:`Prefetcher.sweep`
every ``planner.sweep_interval_s`` for the idle sessions whose forecasts change with their
silence; :meth:`Prefetcher.sync_due` once at the end of every core call.

Invariants: at most :data:`MAX_PREFETCHES_PER_IDLE` prefetches of one session per idle
period (so that eviction ping-pong cannot loop) and :data:`MAX_REPLANS` re-arms of one
order; ``evicted`` holds the idle sessions whose KV is not on their home node (what the
sweep looks at), ``due_dirty`` the sessions whose due state the call under way may have
changed (the sweep's index is brought up to date from it). Times are seconds on the
driver's clock.
"""

from __future__ import annotations

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.tiers import INF
from kvprefetch.controlplane.base.types import ArrivalForecast
from kvprefetch.controlplane.core.bets import Bucket, DisplacementBets
from kvprefetch.controlplane.core.books import TierBooks
from kvprefetch.controlplane.core.draft import StepDraft
from kvprefetch.controlplane.core.forecasts import ForecastCache
from kvprefetch.controlplane.core.planner import PrefetchOrder, TransferEstimate, plan_prefetch
from kvprefetch.controlplane.core.policies import LoadStart, PolicySpec
from kvprefetch.controlplane.core.sessions import Sessions, SessionState
from kvprefetch.controlplane.core.stats import CoreStats
from kvprefetch.controlplane.core.step import LoadTicket
from kvprefetch.controlplane.core.sweep import GatedPredictor, IdleIndex
from kvprefetch.controlplane.core.view import FleetView

__all__ = ["MAX_PREFETCHES_PER_IDLE", "MAX_REPLANS", "REPLAN_SLACK_S", "Prefetcher"]

#: Prefetches of one session per idle period, so that eviction ping-pong cannot loop.
MAX_PREFETCHES_PER_IDLE = 2
#: A prefetch whose forecast from history moved later by more than this (seconds) is
#: re-armed, not started; at most ``MAX_REPLANS`` times in a row.
REPLAN_SLACK_S = 1.0
MAX_REPLANS = 4


class Prefetcher:
    """Plans, starts and sweeps the prefetches of one core (module docstring)."""

    def __init__(self, fleet: FleetConfig, policy: PolicySpec, view: FleetView,
                 forecasts: ForecastCache, books: TierBooks, sessions: Sessions,
                 stats: CoreStats, draft: StepDraft, *, indexed_sweep: bool) -> None:
        self._planner = fleet.planner
        self._policy = policy
        self._view = view
        self._forecasts = forecasts
        self._books = books
        self._sessions = sessions
        self._stats = stats
        self._draft = draft
        self._bpt = fleet.model.kv_bytes_per_token
        #: Idle sessions whose KV is not on their home node: what :meth:`sweep` re-plans.
        self.evicted: set[str] = set()
        predictor = forecasts.predictor
        #: The due ones (:mod:`kvprefetch.controlplane.core.sweep`), when the predictor says
        #: where its forecasts may pass the gate (``indexed_sweep=False``: every sweep
        #: forecasts all, for tests that compare the two).
        self.idle: IdleIndex | None = (
            IdleIndex(fleet.planner.sweep_interval_s)
            if indexed_sweep and policy.prefetch and isinstance(predictor, GatedPredictor)
            else None)
        #: The forecasts' record against recency: where a prefetch may start.
        self.bets = DisplacementBets(fleet.planner.prefetch_min_win_share,
                                     fleet.planner.max_lead_s, stats)
        #: Sessions whose due state may have changed in the call under way.
        self.due_dirty: set[str] = set()
        #: Due sessions whose local copy may have grown since a sweep last looked (a DRAM
        #: reservation while idle); kept by the books.
        self.recheck = books.grown

    def plan(self, sid: str, now_s: float, forecast: ArrivalForecast | None = None) -> None:
        """Plan (or re-plan) a prefetch of an idle session to its home node."""
        s = self._sessions.of(sid)
        self.due_dirty.add(sid)
        tokens = s.remote_tokens
        if s.home is None or tokens <= 0 or s.in_flight:
            return
        if s.prefetches >= MAX_PREFETCHES_PER_IDLE:
            return
        self.recheck.discard(sid)
        if self._books.local_tokens(s.home, sid) >= tokens:
            s.pending = None
            self.evicted.discard(sid)
            return
        self.evicted.add(sid)
        if forecast is None:
            forecast = self._forecasts.forecast(sid, now_s)
        s_per_byte, latency = self._view.remote_source(sid)
        transfer = TransferEstimate(latency, s_per_byte,
                                    self._view.link_backlog_s(s.home, now_s))
        order = plan_prefetch(
            forecast, session_id=sid, node=s.home, tokens=tokens, nbytes=tokens * self._bpt,
            now_s=now_s, transfer=transfer, cfg=self._planner,
            safety_margin_s=self._policy.safety_margin_s,
        )
        s.pending = order
        if order is not None:
            self._draft.orders.append(order)

    def plan_again(self, sid: str, now_s: float) -> None:
        """The session's KV left a node other than by a plan (a transfer failed, an agent
        reported it gone): if it is idle, any order planned against the old books is void;
        plan it afresh."""
        s = self._sessions.get(sid)
        if self._policy.prefetch and s is not None and not s.in_flight:
            s.pending = None
            self.plan(sid, now_s)

    def start(self, order: PrefetchOrder, now_s: float) -> None:
        """An armed prefetch's start time came: re-check it and start the load, re-arm it
        (its forecast moved later), or drop it (superseded, the session is back, or no
        room). A forecast from history moves later as the session's silence grows, and the
        order waits for it; a hint's does too (its law conditioned on that silence), but
        the hint says the session is coming, which the plan already knew: an order on a
        hint starts when planned (a newer hint plans a new order)."""
        sid = order.session_id
        s = self._sessions.get(sid)
        if s is None or s.pending is not order or s.in_flight:
            return
        self.due_dirty.add(sid)
        forecast = self._forecasts.forecast(sid, now_s)
        cfg = self._planner
        if forecast is not None and not forecast.hinted and s.replans < MAX_REPLANS:
            later = forecast.arrival_at(cfg.arrival_quantile)
            if later - order.deadline_s > REPLAN_SLACK_S:
                s.replans += 1
                self.plan(sid, now_s, forecast)  # what plan would ask again
                return
        s.replans = 0
        s.pending = None
        if self._books.local_tokens(order.node, sid) >= order.tokens:
            return
        if self._queue_hides(sid, order, now_s):
            self._stats.prefetches_hidden_by_queue += 1
            return
        use = max(now_s, forecast.arrival_at(0.5) if forecast else order.predicted_use_s)
        admission = self._admission(sid, order, forecast, use, now_s)
        if admission is None:
            self._stats.prefetches_dropped += 1
            return
        free_only, min_key, bucket = admission
        ticket = self._books.reserve(sid, order.node, order.tokens, prefetch=True,
                                     deadline_s=order.deadline_s, now_s=now_s,
                                     min_key=min_key, free_only=free_only,
                                     priority=order.priority)
        if ticket is None:
            self._stats.prefetches_dropped += 1
            return
        if bucket is not None:
            self.bets.took(sid, bucket)
        self.start_load(s, ticket, use)

    def _queue_hides(self, sid: str, order: PrefetchOrder, now_s: float) -> bool:
        """Whether the node's queue would hide the load the prefetch saves: where a
        request's load starts while it waits (``LoadStart.ADAPTIVE``) and the node's
        queue wait now is at least the load's time to last byte, the request would find
        its KV loaded when the GPU picks it up without a prefetch, and a prefetch would
        only take room from the residents."""
        if self._policy.load_start is not LoadStart.ADAPTIVE:
            return False
        s_per_byte, latency = self._view.remote_source(sid)
        ttlb_s = latency + order.nbytes * s_per_byte
        return self._view.queue_wait_s(order.node, now_s) >= ttlb_s

    def _admission(self, sid: str, order: PrefetchOrder, forecast: ArrivalForecast | None,
                   use_s: float, now_s: float) -> tuple[bool, float, Bucket | None] | None:
        """``(free_only, min_key, bucket)`` for a prefetch about to start, or None: it does
        not start. Whatever room a prefetch takes, free or a resident's, pushes residents
        out sooner than recency alone would: it is a bet that the session comes back
        before them, and it starts only where such bets have been won and the prefetches
        taken have been read (:mod:`kvprefetch.controlplane.core.bets`); elsewhere the
        tier keeps what ``reactive`` keeps. With evict advice it may displace residents
        predicted to be used after a late quantile of its arrival. A certain forecast is
        not gated (it displaces those used after its arrival: Belady)."""
        if forecast is None:
            return True, use_s, None
        cfg = self._planner
        advice = self._policy.evict_advice
        min_key = max(use_s, forecast.arrival_at(cfg.displace_quantile)) if advice else use_s
        if forecast.confidence >= 1.0:
            return not advice, min_key, None
        books = self._books
        victims = (books.displaced_by(sid, order.node, order.tokens, now_s, min_key=min_key)
                   if advice else [])
        # The residents it displaces, or those its room would have kept the longest (free
        # room, or no resident it may displace); none when the tier would hold it beside
        # all it holds.
        pushed = victims or books.displaced_by(sid, order.node, order.tokens, now_s,
                                               min_key=-INF, as_if_full=True) or []
        free_only = not advice or victims is None
        if not pushed:
            return free_only, min_key, None
        pushed_ids = [v.key for v in pushed]
        bucket = self.bets.bucket(forecast.confidence >= cfg.displace_min_confidence, now_s,
                                  use_s, self._forecasts.next_uses(pushed_ids, now_s))
        self.bets.place(sid, pushed_ids, bucket, now_s)
        if not self.bets.allows(bucket):
            return None
        return free_only, min_key, bucket

    def start_load(self, s: SessionState, ticket: LoadTicket, use_s: float) -> None:
        """Start a prefetch the tier has room for; the entry is kept until ``use_s``."""
        self._stats.prefetches += 1
        s.planned_use_s = use_s
        self._forecasts.touch(ticket.session_id)
        self.due_dirty.add(ticket.session_id)
        s.prefetches += 1
        self._draft.loads.append(ticket)

    def sweep(self, now_s: float) -> None:
        """Re-plan idle sessions whose KV has left their home node and that have no armed
        order: their forecasts change as their silence grows (a session that was unlikely
        to return a minute ago may be likely now). One batched forecast for all
        candidates."""
        if not self._policy.prefetch or not self.evicted:
            return
        horizon = self._planner.max_lead_s
        due: list[str] = []
        if self.idle is not None:
            due = self._due_candidates(now_s)
        else:
            for sid in sorted(self.evicted):
                s = self._sessions[sid]
                if s.in_flight or s.home is None or now_s - s.last_finish_s > horizon:
                    self.evicted.discard(sid)
                elif s.pending is None and s.prefetches < MAX_PREFETCHES_PER_IDLE:
                    due.append(sid)
        if due:
            for sid, forecast in zip(due, self._forecasts.forecasts(due, now_s), strict=True):
                self.plan(sid, now_s, forecast)

    def sync_due(self) -> None:
        """Bring the sweep's index up to date with the sessions the call changed."""
        idle = self.idle
        if idle is not None:
            group_of = self._forecasts.predictor.idle_group  # type: ignore[attr-defined]
            for sid in self.due_dirty:
                s = self._sessions.get(sid)
                if (s is None or s.in_flight or s.home is None or s.pending is not None
                        or s.prefetches >= MAX_PREFETCHES_PER_IDLE or sid not in self.evicted):
                    idle.remove(sid)
                else:
                    idle.put(sid, group_of(sid), s.last_finish_s)
        self.due_dirty.clear()

    def _due_candidates(self, now_s: float) -> list[str]:
        """The due sessions a full sweep could plan an order for, or whose local copy may
        now cover them (see :mod:`kvprefetch.controlplane.core.sweep`), sorted as the full
        sweep plans them. Reads every due group's law once, as forecasting them all
        would."""
        idle = self.idle
        assert idle is not None
        self.sync_due()
        planner = self._planner
        horizon = planner.max_lead_s
        for sid in idle.expire(now_s, horizon):
            self.evicted.discard(sid)  # silent too long: not due again before an event
        gated: GatedPredictor = self._forecasts.predictor  # type: ignore[assignment]
        due: set[str] = set(idle.ungrouped())
        for group in idle.groups():
            region = gated.gate_region(group, min_p_return=planner.min_p_return,
                                       min_confidence=planner.min_confidence,
                                       max_silence_s=horizon)
            if region:
                due.update(idle.members_in(group, now_s, region))
        if self.recheck:
            due.update(sid for sid in self.recheck if sid in idle)
        return sorted(due)
