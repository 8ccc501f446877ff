"""Forecast-driven HBM retention (``predictive``): keep a finished session's KV in HBM while
its predicted return is worth more than the HBM it holds.

The engine's LRU, with a retention rule on top read from the scheduler core's forecast of
each session (:class:`~kvprefetch.controlplane.base.types.ArrivalForecast`, conditioned on
the silence so far): a resident is held (its key ``-inf``, never evicted) while

    p_within(h) x reload_s  >  c x (nbytes / HBM) x E[min(wait, h)]

over the next ``horizon_s`` (``h``): the chance it returns within ``h`` times what a return
would wait to bring the context back were HBM to drop it (the engine model's estimate at
the response end: the DRAM copy, else the remote load, else the prefill), against the HBM
it holds until then, priced at ``hbm_cost_s_per_s`` seconds per second for the whole HBM
(the price :mod:`~kvprefetch.controlplane.core.continuum` uses). The rule is asked again
at every eviction decision, so a hold is released once the silence has made a return
unlikely enough; a released or never-held resident ages as LRU. The same utility as
Continuum's TTL, with the session's own forecast in place of the law of tool durations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.tiers import INF, TierEntry
from kvprefetch.controlplane.base.types import ArrivalForecast
from kvprefetch.controlplane.core.hbm_retention import FinishedTurn

__all__ = ["ForecastHbm", "ForecastHbmConfig"]


@dataclass(frozen=True, slots=True)
class ForecastHbmConfig:
    #: The window the value and the cost are weighed over (seconds).
    horizon_s: float = 60.0
    #: Price of holding the whole HBM for one second, in seconds of delay.
    hbm_cost_s_per_s: float = 1.0


class ForecastHbm:
    """See the module docstring; an :class:`~.hbm_retention.HbmRetention`."""

    def __init__(self, fleet: FleetConfig,
                 forecast: Callable[[str, float], ArrivalForecast | None],
                 config: ForecastHbmConfig | None = None) -> None:
        self.config = config or ForecastHbmConfig()
        self._forecast = forecast
        self._hbm_bytes = fleet.node.hbm_kv_bytes
        #: session -> (reload seconds, bytes) at its last response end, while it is away
        self._away: dict[str, tuple[float, int]] = {}
        self.strategy = self

    def held(self, sid: str, now_s: float) -> bool:
        """Whether the retention rule holds the session's KV at ``now_s``."""
        away = self._away.get(sid)
        if away is None:
            return False
        fc = self._forecast(sid, now_s)
        if fc is None:
            return False
        reload_s, nbytes = away
        cfg = self.config
        value = fc.p_within(cfg.horizon_s, now_s) * reload_s
        cost = (cfg.hbm_cost_s_per_s * nbytes / self._hbm_bytes
                * fc.expected_wait_s(now_s, cfg.horizon_s))
        return value > cost

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        return [-INF if self.held(e.key, now_s) else -e.last_use_s for e in entries]

    def arrived(self, session_id: str, now_s: float) -> None:
        self._away.pop(session_id, None)

    def finished(self, turn: FinishedTurn, now_s: float) -> None:
        self._away[turn.session_id] = (turn.reload_s, turn.nbytes)

    def admit_key(self, session_id: str, now_s: float) -> float:
        return -INF
