"""``ttl-lognormal``: a retention window from a log-normal law of inter-turn gaps, at DRAM.

Sources: llm-d router PR #2928 (github.com/llm-d/llm-d-router/pull/2928: a
``session-interturn-latency-producer`` measures the idle gap between a response's end and
the session's next turn, fits a log-normal law online, because "inter-turn intervals of a
multi-turn workload follow a log-normal distribution whose parameters vary by deployment",
and a ``kv-cache-retention`` plugin asks the engine to retain the session's KV for a
window drawn from it); LMCache PR #4456 (per-request retention windows, a TTL, that protect a
request's KV from eviction in LMCache's L2 tier);
TensorRT-LLM's retention priorities with a duration (a retained block outranks ordinary
ones until its window passes, then ages normally).

What is modelled (over ``ondemand``'s flags, with the same router, cost model, links and
engine as every policy), in the node-local DRAM tier the scheduler's books keep:

* the law: ``log(gap)`` of every gap seen (response end to the session's next arrival) is
  fitted online (mean and variance, Welford); a session's own gaps shift its mean, shrunk
  to the fleet's with a prior weight of ``prior_gaps`` gaps, so a session that returns
  quickly gets a short window and a slow one a long window;
* the window: at each response end, the ``quantile`` of the session's law
  (``exp(mu + z_q sigma)``), at most ``max_window_s``; ``cold_window_s`` before
  ``min_samples`` gaps are seen;
* retention, as PR #4456 shields entries: at a response end the session's context is
  shielded until its window ends, if the contexts shielded on the node and this one stay
  within ``max_fraction`` of the tier (``retention_max_fraction``); otherwise it is not.
  A shielded entry goes only after every unshielded one (and among shielded entries the
  window that ends first goes first); an unshielded entry, or one past its window, ages
  by LRU. A finished context displaces only unshielded entries (admission).

What is left out: the header gate of PR #2928 (only ``x-session-type: agentic`` sessions
are retained; here every session is); the engine-side API it drives (vLLM's retention API,
HBM) and LMCache's L2 tier, where PR #4456 applies its windows: this model applies them in
the node-local DRAM tier, with one shield budget per node (``max_fraction`` is this
model's default; the pull request leaves it to the deployment).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvprefetch.controlplane.base.tiers import INF, TierEntry
from kvprefetch.controlplane.base.types import EventKind, SessionEvent
from kvprefetch.controlplane.core.tiers import KeyBound

__all__ = ["LognormalRetention", "RetentionConfig"]


def _z(q: float) -> float:
    """The standard normal quantile (Acklam's rational approximation, |error| < 1.2e-9)."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
         1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
         6.680131188771972e+01, -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
         -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
         3.754408661907416e+00)
    if q < 0.02425:
        t = math.sqrt(-2 * math.log(q))
        return (((((c[0] * t + c[1]) * t + c[2]) * t + c[3]) * t + c[4]) * t + c[5]) / \
            ((((d[0] * t + d[1]) * t + d[2]) * t + d[3]) * t + 1)
    if q > 1 - 0.02425:
        return -_z(1 - q)
    t = q - 0.5
    r = t * t
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * t / \
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    #: The window is this quantile of the session's gap law.
    quantile: float = 0.9
    #: Weight of the fleet's law in a session's, in gaps.
    prior_gaps: float = 2.0
    #: Gaps seen before windows come from the law; the window until then (seconds).
    min_samples: int = 20
    cold_window_s: float = 600.0
    #: The longest window (seconds).
    max_window_s: float = 4 * 3600.0
    #: Share of a node's tier that shielded contexts may hold (``retention_max_fraction``).
    max_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {self.quantile!r}")
        if not 0.0 <= self.max_fraction <= 1.0:
            raise ValueError(f"max_fraction must be in [0, 1], got {self.max_fraction!r}")


#: Keys of shielded entries lie below this and every LRU key above it (a key is minus a
#: time in seconds; shielded keys are minus the window's end, shifted far below).
SHIELD_TOP = -1e14
_SHIELD_SHIFT = 1e15


class LognormalRetention:
    """Retention windows and the DRAM tier's keys (module docstring). A
    :class:`~kvprefetch.controlplane.core.tiers.BoundedStrategy`: a key changes only by the
    entry's use (it falls) and by an event of its session (which invalidates it), so the
    key when indexed bounds it until then.

    Called by the core: :meth:`observe` once per session event, before the event's
    write-through, with the node and the context's bytes at a response end;
    :meth:`admit_key` at the write-through; ``keys``/``bounds`` at eviction decisions of
    the DRAM books. ``tier_bytes``: one node's tier (the shield budget's base).
    """

    def __init__(self, config: RetentionConfig | None = None, *, tier_bytes: int = 0) -> None:
        self.config = config or RetentionConfig()
        self._budget_bytes = self.config.max_fraction * tier_bytes
        #: session -> (node, end of its shield, bytes shielded), while shielded
        self._shield: dict[str, tuple[int, float, int]] = {}
        #: node -> bytes shielded, and its shields' ends (heap) to release them
        self._shielded_bytes: dict[int, int] = {}
        self._ends: list[tuple[float, str]] = []
        self._z = _z(self.config.quantile)
        #: Welford over log(gap), all sessions.
        self._n = 0
        self._mean = 0.0
        self._m2 = 0.0
        #: session -> (gaps seen, sum of their logs)
        self._own: dict[str, tuple[int, float]] = {}
        #: session -> end of its last response, while it is away
        self._finished_at: dict[str, float] = {}
        #: session -> its window, fixed at its last response end (seconds)
        self._window: dict[str, float] = {}

    # -- the law -----------------------------------------------------------------------
    def observe(self, event: SessionEvent, nbytes: int = 0) -> None:
        """A session event; at a response end ``nbytes`` is the context's size."""
        sid = event.session_id
        now = event.time_s
        self._release(sid)
        if event.kind is EventKind.REQUEST_STARTED:
            since = self._finished_at.pop(sid, None)
            if since is not None:
                self._add_gap(sid, now - since)
        elif event.kind is EventKind.REQUEST_FINISHED:
            self._finished_at[sid] = now
            window = self._window[sid] = self.window_s(sid)
            node = event.node if event.node is not None else 0
            self._expire(now)
            held = self._shielded_bytes.get(node, 0)
            if held + nbytes <= self._budget_bytes:
                self._shield[sid] = (node, now + window, nbytes)
                self._shielded_bytes[node] = held + nbytes
                heapq.heappush(self._ends, (now + window, sid))

    def _release(self, sid: str) -> None:
        shield = self._shield.pop(sid, None)
        if shield is not None:
            node, _, nbytes = shield
            self._shielded_bytes[node] -= nbytes

    def _expire(self, now_s: float) -> None:
        """Release the shields whose windows ended by ``now_s``."""
        ends = self._ends
        while ends and ends[0][0] <= now_s:
            end, sid = heapq.heappop(ends)
            shield = self._shield.get(sid)
            if shield is not None and shield[1] == end:
                self._release(sid)

    def shielded_until(self, sid: str) -> float:
        """When the session's shield ends (``-inf``: not shielded)."""
        shield = self._shield.get(sid)
        return shield[1] if shield is not None else -INF

    def _add_gap(self, sid: str, gap_s: float) -> None:
        x = math.log(max(gap_s, 1e-3))
        self._n += 1
        delta = x - self._mean
        self._mean += delta / self._n
        self._m2 += delta * (x - self._mean)
        n, total = self._own.get(sid, (0, 0.0))
        self._own[sid] = (n + 1, total + x)

    def window_s(self, sid: str) -> float:
        """The session's window if its response ended now (module docstring)."""
        cfg = self.config
        if self._n < cfg.min_samples:
            return cfg.cold_window_s
        sigma = math.sqrt(self._m2 / (self._n - 1))
        n, total = self._own.get(sid, (0, 0.0))
        mu = (cfg.prior_gaps * self._mean + total) / (cfg.prior_gaps + n)
        return min(cfg.max_window_s, math.exp(mu + self._z * sigma))

    def key(self, sid: str, last_use_s: float, now_s: float) -> float:
        """Shielded: below every LRU key, the window that ends first going first; else
        LRU's (minus the last use)."""
        end = self.shielded_until(sid)
        return -_SHIELD_SHIFT - end if end > now_s else -last_use_s

    def admit_key(self, sid: str, now_s: float) -> float:
        """A finished context displaces only unshielded entries."""
        return SHIELD_TOP

    # -- the strategy ------------------------------------------------------------------
    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        return [self.key(e.key, e.last_use_s, now_s) for e in entries]

    def bounds(self, entries: Sequence[TierEntry], now_s: float) -> list[KeyBound]:
        out = []
        for e in entries:
            end = self.shielded_until(e.key)
            out.append(KeyBound(-INF, -_SHIELD_SHIFT - end, end) if end > now_s
                       else KeyBound(-INF, -e.last_use_s, INF))
        return out
