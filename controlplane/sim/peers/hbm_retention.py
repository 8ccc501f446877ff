"""The HBM retention seam: how an engine's prefix cache keeps a finished session's KV.

Every policy's HBM is the engine's prefix cache, LRU (``PolicySpec.hbm_retention`` None):
the simulator's engine model evicts the least recently used context when another needs
room. A peer that names an :class:`HbmRetention` (by ``PolicySpec.hbm_retention``, made by
its factory in :data:`~kvprefetch.controlplane.sim.peers.registry.HBM_RETENTIONS`, which
imports its module only when selected, so none of its code runs for the others) replaces
that with its own engine change: its ``strategy`` gives the HBM tier's eviction keys (the
tiers' one convention: the largest goes first; ``-inf`` is never evicted, the way a pin with
an expiry is expressed: a key of ``-inf`` until the expiry, an ordinary key after), and
``admit_key`` is the admission rule a finished session's KV passes to stay in HBM (only
residents whose key is above it may make room for it).

Who calls what: the engine model (:class:`~kvprefetch.controlplane.sim.simulator.Simulation`)
calls :meth:`HbmRetention.arrived` once per request arrival, :meth:`HbmRetention.finished`
once per response end (before the context is written to HBM), ``strategy.keys`` at every
HBM eviction decision, and :meth:`HbmRetention.admit_key` once per write of a finished
context. Pure: no clock of its own, every call takes ``now_s``; deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvprefetch.controlplane.base.tiers import EvictionStrategy

__all__ = ["FinishedTurn", "HbmRetention"]


@dataclass(frozen=True, slots=True)
class FinishedTurn:
    """A response that just ended, as the engine sees it."""

    session_id: str
    stop_reason: str | None
    #: Bytes of the session's context (what staying in HBM holds).
    nbytes: int
    #: Seconds the next request would wait to bring the context back if HBM dropped it
    #: now (the DRAM copy over the host link, else the remote load, else its prefill).
    reload_s: float
    #: The node's prefill queue wait now (seconds).
    queue_s: float


class HbmRetention(Protocol):
    """A retention policy of the engine's HBM prefix cache (module docstring)."""

    @property
    def strategy(self) -> EvictionStrategy:
        """The HBM tier's eviction keys (largest first; ``-inf`` never goes)."""
        ...

    def arrived(self, session_id: str, now_s: float) -> None:
        """A request of the session arrived (its gap since the last response ended)."""
        ...

    def finished(self, turn: FinishedTurn, now_s: float) -> None:
        """A response of the session ended; its context is about to be written to HBM."""
        ...

    def admit_key(self, session_id: str, now_s: float) -> float:
        """Residents whose key is at or below this stay when the session's finished
        context is written (``-inf``: it may displace any unpinned resident)."""
        ...
