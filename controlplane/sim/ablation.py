"""What each of ``predictive``'s forecast-driven decisions is worth: the policy with one
decision's forecast switched off at a time (``kvprefetch sim --ablation``).

The decisions a forecast drives, by name (:data:`DECISIONS`):

* ``dram``: which sessions the DRAM tier keeps (predicted next use; off: recency). Only on
  a profile that lets kvprefetch rank the tier.
* ``prefetch``: which prefetches are issued, and when (off: none).
* ``advice``: which sessions a warm's room is made from, by evict advice chosen by predicted
  next use (off: the tier's own ranking). Only on a profile with evict advice whose tier
  does not already rank by predicted next use.
* ``hints``: whether the predictor reads client hints (off: it does not). Only when clients
  send hints.

Routing reads no forecast (the router weighs queue waits, what each node holds and link
backlogs), so it has no entry. A decision the profile does not offer is left out: switched
off, the policy would run exactly as ``predictive`` does. Each variant is named
``predictive-no-DECISION``; comparing it with ``predictive`` in the same run gives the
decision's worth, and ``reactive`` is all of them off at once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvprefetch.controlplane.core.engines import EngineProfile, on_engine
from kvprefetch.controlplane.core.policies import EvictionKind, PolicySpec

__all__ = ["DECISIONS", "ablations"]

#: Decision -> what it decides, and the spec fields that switch its forecast off.
DECISIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "dram": ("which sessions DRAM keeps", {"eviction": EvictionKind.LRU}),
    "prefetch": ("which prefetches are issued, and when", {"prefetch": False}),
    "advice": ("which sessions a warm's room is made from", {"evict_advice": False}),
    "hints": ("whether client hints are read", {"reads_hints": False}),
}


def ablations(policy: PolicySpec, engine: EngineProfile, *, hints: bool) -> list[PolicySpec]:
    """``policy`` with each decision's forecast switched off alone (module docstring), as
    specs to run on ``engine``; ``hints``: clients send hints in the run."""
    ran = on_engine(policy, engine)
    out = []
    for decision, (_, off) in DECISIONS.items():
        if decision == "hints" and not hints:
            continue
        if decision == "advice" and ran.eviction is EvictionKind.PREDICTED_USE:
            continue  # the tier ranks by predicted next use itself: advice changes nothing
        variant = replace(policy, name=f"{policy.name}-no-{decision}", **off)
        if replace(on_engine(variant, engine), name=policy.name) != ran:
            out.append(variant)
    return out
