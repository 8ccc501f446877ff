"""One value rule for admission, eviction and prefetch: expected seconds saved per byte per
second of occupancy (issue 11). Pure and deterministic: numbers in, a plan out.

Where each idea comes from
--------------------------
* **LHD** (Beckmann et al., NSDI'18), *hit density* = P(hit) / (size x expected time in
  cache), conditioned on age. :func:`density` is LHD's hit density weighted by what a hit
  is worth here (:func:`saved_s`), with the forecast's distribution, conditioned on the
  session's silence so far, giving both P(hit) (:meth:`ArrivalForecast.p_within`) and the
  expected lifetime (:meth:`ArrivalForecast.expected_wait_s`).
* **Hazard-rate TTL caching**: inter-request gaps are heavy tailed, so the hazard falls with
  age and a long-silent session is worth less per byte; the forecast's Pareto tail carries
  that into the density without a separate recency floor.
* **Belady / LRB** (Song et al., NSDI'20, relaxed Belady): with an exact forecast (the
  oracle) the density is ``saved / (size x time to next use)``, so among equal-size,
  equal-worth entries evicting the lowest density first *is* evicting the furthest next use
  first; ties (all beyond the horizon) break on the predicted next use, keeping that exact.
  With a learned forecast the rule evicts what is predicted beyond the boundary where
  keeping it no longer pays, as LRB does.
* **Continuum** (keep KV through a tool call for a TTL chosen from the tool-duration
  distribution): a session in a tool call has a tight, early forecast, so its density is
  high while the call is expected to end and decays after; the TTL falls out of the rule.
* **KVFlow** (prefetch by steps-to-execution): a prefetch is timed to land before an early
  quantile of the conditioned arrival (:attr:`ValueConfig.landing_level`), not at once.

The rule
--------
Keep the highest-density set within capacity. Admit a remote candidate when its density,
less the cost of moving its bytes amortised over its expected occupancy, beats the
density of the lowest-density resident bytes it would displace (free space first:
displacing nothing costs nothing, the transfer cost still applies). Cancel an order whose
value fell below what it displaces (:func:`should_cancel`).

Who calls what: the scheduling core, once per node per re-plan, builds a :class:`Resident`
per session whose KV is local and a :class:`Candidate` per idle session whose KV is remote
and whose home is the node (both from forecasts it batches with ``forecast_many``), then
carries out the :class:`NodePlan` that :func:`plan_node` returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvprefetch.controlplane.base.types import ArrivalForecast

INF = math.inf
#: Default floor of the expected occupancy (seconds), see :attr:`ValueConfig.min_wait_s`.
DEFAULT_MIN_WAIT_S = 0.05


@dataclass(frozen=True, slots=True)
class ValueConfig:
    """Knobs of the value rule; units in the names."""

    #: Arrivals within this many seconds of now count as hits; also caps the expected
    #: occupancy. Long enough to cover a person's think time, short enough that a session
    #: gone for the day is worth nothing now.
    horizon_s: float = 600.0
    #: Floor of the expected occupancy in the density's denominator (seconds), so that a
    #: session due now is worth a large but finite amount.
    min_wait_s: float = DEFAULT_MIN_WAIT_S
    #: What moving one byte costs in demand-load seconds: the bandwidth a prefetch takes
    #: from demand loads on the same link (about link seconds per byte x the share of the
    #: time a demand load queues behind it). Charged on every admitted transfer.
    transfer_cost_s_per_byte: float = 2.5e-11
    #: Land a prefetch before this quantile of the conditioned arrival (KVFlow-style
    #: just-in-time): early enough that most arrivals find the bytes local.
    landing_level: float = 0.1
    #: ... and this many seconds before it (estimation error of the TTLB).
    safety_margin_s: float = 0.5
    #: Never schedule a start further ahead than this (seconds); the core re-plans then.
    max_lead_s: float = 3600.0
    #: Hysteresis of :func:`should_cancel`: an order is cancelled only when its density
    #: falls this fraction below what it displaces, so plans do not flap.
    cancel_slack: float = 0.1

    def __post_init__(self) -> None:
        if self.horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {self.horizon_s}")
        if self.min_wait_s <= 0:
            raise ValueError(f"min_wait_s must be > 0, got {self.min_wait_s}")
        if self.transfer_cost_s_per_byte < 0:
            raise ValueError(
                f"transfer_cost_s_per_byte must be >= 0, got {self.transfer_cost_s_per_byte}"
            )
        if not 0.0 < self.landing_level < 1.0:
            raise ValueError(f"landing_level must be in (0, 1), got {self.landing_level}")
        if self.safety_margin_s < 0 or self.max_lead_s <= 0:
            raise ValueError("safety_margin_s must be >= 0 and max_lead_s > 0")
        if not 0.0 <= self.cancel_slack < 1.0:
            raise ValueError(f"cancel_slack must be in [0, 1), got {self.cancel_slack}")


# ---------------------------------------------------------------------------------------------
# What a local copy is worth.
# ---------------------------------------------------------------------------------------------


def saved_s(
    nbytes: int,
    *,
    load_first_byte_s: float,
    load_s_per_byte: float,
    recompute_s: float | None = None,
    has_remote_copy: bool = True,
) -> float:
    """GPU-seconds a session's KV being local saves when the session returns.

    With a remote copy it is the on-demand load the request would otherwise stall on
    (first-byte latency + ``nbytes`` x seconds per byte), no more than ``recompute_s`` when
    given (an engine would rather recompute than wait longer). Without one (never written
    through) it is the recompute it avoids, so ``recompute_s`` is then required.
    """
    if nbytes <= 0:
        return 0.0
    if not has_remote_copy:
        if recompute_s is None:
            raise ValueError("recompute_s is required for KV with no remote copy")
        return max(0.0, recompute_s)
    load = max(0.0, load_first_byte_s) + nbytes * max(0.0, load_s_per_byte)
    return load if recompute_s is None else min(load, max(0.0, recompute_s))


def density(
    forecast: ArrivalForecast | None,
    now_s: float,
    horizon_s: float,
    saved_s: float,
    nbytes: int,
    *,
    min_wait_s: float = DEFAULT_MIN_WAIT_S,
) -> float:
    """Expected seconds saved per byte per second of occupancy (LHD's hit density times the
    worth of a hit): ``p_within(horizon) x saved / (nbytes x max(expected_wait, eps))``.
    0 without a forecast or bytes."""
    if forecast is None or nbytes <= 0 or saved_s <= 0.0:
        return 0.0
    p_hit = forecast.p_within(horizon_s, now_s)
    if p_hit <= 0.0:
        return 0.0
    wait = forecast.expected_wait_s(now_s, horizon_s)
    return p_hit * saved_s / (nbytes * max(wait, min_wait_s))


# ---------------------------------------------------------------------------------------------
# Inputs of one node's decision.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Resident:
    """A session whose KV is in the node's local tier."""

    session_id: str
    nbytes: int
    #: :func:`density` now.
    density: float
    #: Predicted next use (median conditioned arrival; ``inf`` = never): breaks ties of
    #: density (all beyond the horizon) the Belady way, furthest first.
    next_use_s: float = INF
    #: In use, being written or being read: never evicted.
    pinned: bool = False

    @classmethod
    def from_forecast(
        cls,
        session_id: str,
        forecast: ArrivalForecast | None,
        *,
        nbytes: int,
        saved_s: float,
        now_s: float,
        cfg: ValueConfig,
        pinned: bool = False,
    ) -> Resident:
        d = density(forecast, now_s, cfg.horizon_s, saved_s, nbytes, min_wait_s=cfg.min_wait_s)
        return cls(session_id, nbytes, d, _next_use_s(forecast, now_s), pinned)


@dataclass(frozen=True, slots=True)
class Candidate:
    """An idle session whose KV is remote and could be prefetched to the node."""

    session_id: str
    nbytes: int
    #: :func:`density` now, counting only arrivals after the transfer could land if
    #: started now (earlier ones find the bytes still on the wire).
    density: float
    #: Expected occupancy (seconds): amortises the transfer cost into a density.
    expected_wait_s: float
    #: Time to last byte if started now (seconds), from the core's link estimate.
    ttlb_s: float
    #: The early arrival quantile the transfer should land before (absolute seconds).
    land_by_s: float = INF
    #: Predicted next use, for the tie-break of :class:`Resident` once it is admitted.
    next_use_s: float = INF

    @classmethod
    def from_forecast(
        cls,
        session_id: str,
        forecast: ArrivalForecast | None,
        *,
        nbytes: int,
        saved_s: float,
        ttlb_s: float,
        now_s: float,
        cfg: ValueConfig,
    ) -> Candidate:
        if forecast is None or nbytes <= 0:
            return cls(session_id, nbytes, 0.0, cfg.horizon_s, ttlb_s)
        h = cfg.horizon_s
        wait = forecast.expected_wait_s(now_s, h)
        ttlb = max(0.0, ttlb_s)
        p_hit = forecast.p_within(h, now_s) - (forecast.p_within(ttlb, now_s) if ttlb else 0.0)
        d = 0.0
        if p_hit > 0.0 and saved_s > 0.0:
            d = p_hit * saved_s / (nbytes * max(wait, cfg.min_wait_s))
        land_by = (
            forecast.arrival_quantile_after(cfg.landing_level, now_s)
            if forecast.p_return > 0.0 else INF
        )
        return cls(session_id, nbytes, d, wait, ttlb, land_by, _next_use_s(forecast, now_s))

    def net_density(self, cfg: ValueConfig) -> float:
        """Density less the transfer cost amortised over the expected occupancy."""
        return self.density - cfg.transfer_cost_s_per_byte / max(
            self.expected_wait_s, cfg.min_wait_s
        )

    def start_at_s(self, now_s: float, cfg: ValueConfig) -> float:
        """When to start so the last byte lands ``safety_margin_s`` before ``land_by_s``:
        never before now, never more than ``max_lead_s`` ahead (re-planned by then)."""
        start = self.land_by_s - self.ttlb_s - cfg.safety_margin_s
        return min(max(now_s, start), now_s + cfg.max_lead_s)


def _next_use_s(forecast: ArrivalForecast | None, now_s: float) -> float:
    if forecast is None or forecast.p_return <= 0.0:
        return INF
    return forecast.arrival_quantile_after(0.5, now_s)


# ---------------------------------------------------------------------------------------------
# The decision.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedPrefetch:
    """Warm ``session_id``'s KV on the node, starting at ``start_at_s``, after evicting
    ``evicts`` (also listed in :attr:`NodePlan.evictions`)."""

    session_id: str
    nbytes: int
    start_at_s: float
    #: The arrival quantile it is timed to land before.
    land_by_s: float
    density: float
    evicts: tuple[str, ...] = ()
    #: False when the last byte cannot land ``safety_margin_s`` before ``land_by_s`` even
    #: if started now; admitted because it is worth it anyway (its density counts only
    #: arrivals after it lands).
    on_time: bool = True


@dataclass(frozen=True, slots=True)
class NodePlan:
    """What one node should do now: evictions (lowest density first) and prefetches
    (highest net density first)."""

    prefetches: tuple[PlannedPrefetch, ...] = ()
    evictions: tuple[str, ...] = ()

    @classmethod
    def empty(cls) -> NodePlan:
        return cls()


def eviction_order(residents: Sequence[Resident]) -> list[Resident]:
    """Unpinned residents, first to go first: lowest density, then furthest predicted
    next use (Belady's order for an exact forecast), then larger, then by id."""
    free = [r for r in residents if not r.pinned]
    return sorted(free, key=lambda r: (r.density, -r.next_use_s, -r.nbytes, r.session_id))


def plan_node(
    residents: Sequence[Resident],
    candidates: Sequence[Candidate],
    *,
    capacity_bytes: int,
    used_bytes: int,
    now_s: float,
    cfg: ValueConfig,
) -> NodePlan:
    """Keep the highest-density set within ``capacity_bytes``.

    ``used_bytes`` is everything the tier holds or has reserved (residents, in-flight
    transfers); only unpinned residents can be evicted. First, if the tier is over
    capacity, the lowest-density residents go until it fits. Then candidates are taken
    in order of net density (density less the amortised transfer cost): each uses free
    space first and displaces the lowest-density residents for the rest, and is admitted
    only if ``nbytes x net density`` beats the summed ``nbytes x density`` of the whole
    entries it displaces. A candidate that cannot land before its arrival quantile is
    admitted by the same test, its density already counting only arrivals after it lands.
    Residents admitted in this plan are not displaced by later candidates of the same plan.

    Evictions of a prefetch whose ``start_at_s`` is later than ``now_s`` are what the plan
    assumes; the core carries them out when it starts the transfer, after re-planning.
    Never plans the tier above ``capacity_bytes``.
    """
    free = capacity_bytes - used_bytes
    order = eviction_order(residents)
    evictions: list[str] = []
    i = 0  # order[:i] are evicted
    while free < 0 and i < len(order):
        free += order[i].nbytes
        evictions.append(order[i].session_id)
        i += 1
    if free < 0:
        return NodePlan((), tuple(evictions))

    prefetches: list[PlannedPrefetch] = []
    ranked = sorted(candidates, key=lambda c: (-c.net_density(cfg), c.session_id))
    for c in ranked:
        net = c.net_density(cfg)
        if c.nbytes <= 0 or net <= 0.0 or c.nbytes > capacity_bytes:
            continue
        j, gained, displaced = i, free, 0.0
        while gained < c.nbytes and j < len(order):
            gained += order[j].nbytes
            displaced += order[j].density * order[j].nbytes
            j += 1
        if gained < c.nbytes or c.nbytes * net <= displaced:
            continue
        evicts = tuple(r.session_id for r in order[i:j])
        evictions.extend(evicts)
        i, free = j, gained - c.nbytes
        earliest_landing = now_s + c.ttlb_s + cfg.safety_margin_s
        prefetches.append(PlannedPrefetch(
            c.session_id, c.nbytes, c.start_at_s(now_s, cfg), c.land_by_s, c.density, evicts,
            on_time=earliest_landing <= c.land_by_s,
        ))
    return NodePlan(tuple(prefetches), tuple(evictions))


def should_cancel(
    order_density: float,
    lowest_resident_density: float,
    *,
    remaining_fraction: float = 1.0,
    expected_wait_s: float = INF,
    cfg: ValueConfig,
) -> bool:
    """Whether to cancel a queued or in-flight prefetch whose value was re-assessed.

    ``order_density`` is the session's :func:`density` now; ``lowest_resident_density``
    that of the lowest-density resident bytes its space displaces (0 where it took free
    space); ``remaining_fraction`` the share of its bytes not yet moved (the cost already
    paid is sunk). Cancelled when nothing is left to gain (its density fell to 0 with
    bytes still to move) or when its density, less the remaining transfer cost amortised
    over ``expected_wait_s``, falls ``cancel_slack`` below what it displaces.
    """
    if remaining_fraction <= 0.0:
        return False
    if order_density <= 0.0:
        return True
    remaining_cost = (
        cfg.transfer_cost_s_per_byte * remaining_fraction / max(expected_wait_s, cfg.min_wait_s)
    )
    return order_density - remaining_cost < lowest_resident_density * (1.0 - cfg.cancel_slack)


# ---------------------------------------------------------------------------------------------
# The rule over the core's sessions.
# ---------------------------------------------------------------------------------------------


class SessionValues:
    """The value rule applied to the scheduling core's sessions: eviction keys of tier
    entries and prefetch candidates, from batched forecasts.

    ``state(sid)`` gives ``(running, tokens)`` of a live session or None (closed or
    unknown); ``forecasts(sids, now_s)`` one batched forecast per session;
    ``remote_source(sid)`` the (seconds per byte, first-byte latency) of its remote copy.
    """

    def __init__(self, cfg: ValueConfig, bytes_per_token: int,
                 state: Callable[[str], tuple[bool, int] | None],
                 forecasts: Callable[[Sequence[str], float], list[ArrivalForecast | None]],
                 remote_source: Callable[[str], tuple[float, float]]) -> None:
        self.cfg = cfg
        self._bpt = bytes_per_token
        self._state = state
        self._forecasts = forecasts
        self._remote_source = remote_source

    def saved_s(self, sid: str, nbytes: int) -> float:
        """Seconds a local copy saves at the session's return: the load it avoids."""
        s_per_byte, latency = self._remote_source(sid)
        return saved_s(nbytes, load_first_byte_s=latency, load_s_per_byte=s_per_byte)

    def keys(self, sids: Sequence[str], now_s: float) -> list[float]:
        """Eviction keys (largest first out): ``-density`` for sessions worth keeping;
        sessions worth nothing within the horizon by furthest predicted use (``inf``:
        never), so they go first, the Belady way; running sessions never (``-inf``)."""
        out: list[float] = [-INF] * len(sids)
        ask: list[tuple[int, int]] = []
        for i, sid in enumerate(sids):
            st = self._state(sid)
            if st is None:
                out[i] = INF  # closed or unknown: never used again
            elif not st[0]:
                ask.append((i, max(1, st[1]) * self._bpt))
        if not ask:
            return out
        cfg = self.cfg
        fcs = self._forecasts([sids[i] for i, _ in ask], now_s)
        for (i, nbytes), fc in zip(ask, fcs, strict=True):
            d = density(fc, now_s, cfg.horizon_s, self.saved_s(sids[i], nbytes), nbytes,
                        min_wait_s=cfg.min_wait_s)
            if d > 0.0:
                out[i] = -d
            else:
                out[i] = _next_use_s(fc, now_s)
        return out

    def candidate(self, sid: str, tokens: int, forecast: ArrivalForecast | None,
                  ttlb_s: Callable[[int], float], now_s: float) -> Candidate:
        """The session as a prefetch candidate now (``ttlb_s(nbytes)``: the link's
        estimate)."""
        nbytes = tokens * self._bpt
        return Candidate.from_forecast(sid, forecast, nbytes=nbytes,
                                       saved_s=self.saved_s(sid, nbytes),
                                       ttlb_s=ttlb_s(nbytes), now_s=now_s, cfg=self.cfg)
