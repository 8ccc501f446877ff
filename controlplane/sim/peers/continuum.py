"""``continuum-ttl``: Continuum / CacheTTL's tool-call TTL pin, at the HBM tier.

Source: H. Li et al., "Continuum: Efficient and Robust Multi-Turn LLM Agent Scheduling
with KV Cache Time-to-Live", arXiv 2511.02230 (code: github.com/Hanchenli/vllm-continuum).
After a response that ends in a tool call, the engine pins the session's KV in GPU memory
for a time-to-live tau* chosen from the distribution of tool-call durations, the cost of
reloading the KV and the queueing delay that eviction would add; at expiry the pin is
released and the KV ages like any other.

What is modelled (over ``ondemand``'s flags, with the same router, cost model, links and
engine as every policy):

* the pin: after a ``tool_use`` response the session's HBM entry ranks below every
  unpinned one until ``now + tau*``, then takes its LRU key; any other response, and the
  session's next arrival, release it. Under pressure (HBM holds nothing unpinned to make
  room with) pins are released, the program pinned last first, as Continuum gives pinned
  programs up in reverse order of arrival;
* tau*: the expected utility of a TTL ``tau`` is ``F(tau) x (reload_s + queue_s) -
  c x E[min(T, tau)]`` over the empirical law ``F`` of the tool durations ``T`` seen so far
  (the last ``window`` gaps after ``tool_use`` responses, measured from each response end
  to the session's next arrival); ``reload_s`` is what the next request would wait to
  bring the context back were it dropped now (the engine model's estimate: the DRAM copy,
  else the remote load, else the prefill), ``queue_s`` the node's prefill queue wait; ``c``
  prices the HBM the pin holds: ``hbm_cost_s_per_s`` seconds per second for the whole of
  HBM, times the share the context takes. tau* maximises the utility over the observed
  durations (0, no pin, when none is positive); before ``min_samples`` durations are seen
  the TTL is ``cold_ttl_s``.

What is left out (Continuum does it, the simulator does not): program-level
first-come-first-serve (Continuum schedules a returning
turn of a program ahead of later programs' requests); the simulator's prefill queue is
FIFO for every policy and this model keeps it so, so the queueing term enters the choice of
tau* (as in the paper) but the pin saves no queue position. Continuum's TTL adjustments by
turn number are not modelled; the utility's HBM price ``c`` is this model's own (the paper
weighs the memory a pin holds; its constant is not given here).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.tiers import INF, TierEntry
from kvprefetch.controlplane.sim.peers.hbm_retention import FinishedTurn

__all__ = ["ContinuumConfig", "ContinuumTtl"]

TOOL_STOP = "tool_use"


@dataclass(frozen=True, slots=True)
class ContinuumConfig:
    #: Tool durations kept for the empirical law (the most recent).
    window: int = 1024
    #: Durations needed before tau* is chosen from them.
    min_samples: int = 16
    #: TTL before that (seconds).
    cold_ttl_s: float = 5.0
    #: Price of holding the whole HBM for one second, in seconds of delay.
    hbm_cost_s_per_s: float = 1.0
    #: The most tau* may be (seconds): a pin is released by then in any case.
    max_ttl_s: float = 600.0


#: Pinned keys lie this far below LRU keys (minus a time in seconds).
_PIN_SHIFT = 1e15


class _PinKeys:
    """LRU keys; while a pin holds, below every LRU key, the latest pin the largest."""

    def __init__(self, held: dict[str, tuple[float, float]]) -> None:
        self._held = held

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        out = []
        for e in entries:
            until, since = self._held.get(e.key, (-INF, 0.0))
            out.append(since - _PIN_SHIFT if until > now_s else -e.last_use_s)
        return out


class ContinuumTtl:
    """See the module docstring; an :class:`~.hbm_retention.HbmRetention`."""

    def __init__(self, fleet: FleetConfig, config: ContinuumConfig | None = None) -> None:
        self.config = config or ContinuumConfig()
        self._hbm_bytes = fleet.node.hbm_kv_bytes
        #: session -> (end of its pin, when it was pinned) (seconds)
        self._held: dict[str, tuple[float, float]] = {}
        #: session -> end of its last tool-call response (until it returns)
        self._tool_since: dict[str, float] = {}
        self._durations: deque[float] = deque(maxlen=self.config.window)
        self._sorted: list[float] = []
        self._prefix: list[float] = []
        self._stale = True
        self.strategy = _PinKeys(self._held)
        #: Pins made and TTLs chosen (for reports and tests).
        self.pins = 0

    def arrived(self, session_id: str, now_s: float) -> None:
        self._held.pop(session_id, None)
        since = self._tool_since.pop(session_id, None)
        if since is not None:
            self._durations.append(max(0.0, now_s - since))
            self._stale = True

    def finished(self, turn: FinishedTurn, now_s: float) -> None:
        sid = turn.session_id
        if turn.stop_reason != TOOL_STOP:
            self._held.pop(sid, None)
            return
        self._tool_since[sid] = now_s
        tau = self.ttl_s(turn)
        if tau > 0.0:
            self._held[sid] = (now_s + tau, now_s)
            self.pins += 1
        else:
            self._held.pop(sid, None)

    def pinned_until(self, session_id: str) -> float:
        """When the session's pin ends (``-inf``: not pinned)."""
        return self._held.get(session_id, (-INF, 0.0))[0]

    def admit_key(self, session_id: str, now_s: float) -> float:
        """A finished context may displace any resident, a pinned one last."""
        return -INF

    def ttl_s(self, turn: FinishedTurn) -> float:
        """tau* for this response (module docstring)."""
        cfg = self.config
        if len(self._durations) < cfg.min_samples:
            return cfg.cold_ttl_s
        if self._stale:
            self._sorted = sorted(self._durations)
            total = 0.0
            self._prefix = []
            for x in self._sorted:
                total += x
                self._prefix.append(total)
            self._stale = False
        xs, prefix = self._sorted, self._prefix
        n = len(xs)
        gain = turn.reload_s + turn.queue_s
        price = cfg.hbm_cost_s_per_s * turn.nbytes / self._hbm_bytes
        best_u, best_tau = 0.0, 0.0
        last = bisect.bisect_right(xs, cfg.max_ttl_s)
        for k in range(1, last + 1):
            tau = xs[k - 1]
            if k < n and xs[k] == tau:
                continue  # the last of equal durations carries the whole step of F
            held = (prefix[k - 1] + (n - k) * tau) / n  # E[min(T, tau)]
            u = k / n * gain - price * held
            if u > best_u:
                best_u, best_tau = u, tau
        return best_tau
