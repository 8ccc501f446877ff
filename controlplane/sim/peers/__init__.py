"""The published peers' own engine changes to HBM, as the simulator models them: the seam
(:mod:`.hbm_retention`), its registry (:mod:`.registry`) and the two strategies behind it,
Continuum's TTL pin (:mod:`.continuum`) and MORI's idleness ranking (:mod:`.mori`).
Simulator only: no engine profile lets an outside component rank HBM."""

from kvprefetch.controlplane.sim.peers.hbm_retention import FinishedTurn, HbmRetention
from kvprefetch.controlplane.sim.peers.registry import HBM_RETENTIONS, make_hbm_retention

__all__ = ["HBM_RETENTIONS", "FinishedTurn", "HbmRetention", "make_hbm_retention"]
