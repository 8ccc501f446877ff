"""The six policies compared everywhere (ARCHITECTURE.md, "Policies compared everywhere"),
and the published peers the simulator judges them against.

A policy is a small frozen record of capabilities, not code: the simulator and the live
service read the flags, so the differences between policies come from the flags alone.

The peers (:data:`PEER_POLICIES`) are the strongest published retention policies, each
modelled at the tier it acts on over the flags of the baseline it extends (``ondemand``:
a node-local DRAM tier and a remote store, loads at GPU start), with the same router,
cost model, links and engine as every other policy: ``continuum-ttl``
(:mod:`~kvprefetch.controlplane.core.continuum`, HBM), ``mori``
(:mod:`~kvprefetch.controlplane.core.mori`, HBM) and ``ttl-lognormal``
(:mod:`~kvprefetch.controlplane.core.retention_window`, DRAM). They are simulator
baselines: the two HBM ones change the engine's prefix cache, which the simulator models
and the live service does not drive, so the live service does not offer them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvprefetch.controlplane.base.errors import ConfigError


class LoadStart(enum.Enum):
    """When missing remote KV is loaded for a request that needs it."""

    NEVER = "never"  # no remote store: recompute what is not local
    ON_SCHEDULE = "on_schedule"  # when the GPU picks the request up (blocking the GPU)
    ON_ARRIVAL = "on_arrival"  # as soon as the request arrives, overlapped with queue wait
    #: During the queue wait (when it hides at least
    #: ``planner.arrival_load_min_wait_fraction`` of the load: by default any wait), else
    #: when the GPU picks it up; behind a long queue the load starts
    #: ``planner.arrival_load_max_wait_fraction`` TTLBs before the request's estimated GPU
    #: start rather than at arrival.
    ADAPTIVE = "adaptive"


class EvictionKind(enum.Enum):
    """How the node-local DRAM tier chooses victims."""

    LRU = "lru"
    PREDICTED_USE = "predicted_use"  # furthest predicted next use first (Belady w/ oracle)
    #: Earliest end of a per-session retention window first: a window learned from the
    #: log-normal law of inter-turn gaps (:mod:`~kvprefetch.controlplane.core.retention_window`).
    RETENTION_WINDOW = "retention_window"


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    dram_tier: bool
    remote: bool
    load_start: LoadStart
    eviction: EvictionKind
    prefetch: bool
    #: Predictor this policy always uses (the oracle reads the future); None = the user's.
    predictor: str | None = None
    #: Overrides the planner's safety margin (the oracle finishes exactly in time).
    safety_margin_s: float | None = None
    modelled_on: str = ""
    #: Room is made by cutting a victim's KV back to a prefix, chunk by chunk, not by
    #: dropping the whole session: the prefix is what a returning request reuses, and an
    #: eviction frees only the bytes it needs (see :mod:`kvprefetch.controlplane.core.books`,
    #: "Suffix eviction"). The LMCache-modelled baselines drop whole sessions: LMCache's
    #: L1 LRU evicts a session's chunks in the order they were last touched, prefix first,
    #: and the suffix it leaves is of no use to a prefix lookup, so whole-session LRU is
    #: the generous model of it.
    suffix_eviction: bool = False
    #: Prefetch only within a waste budget: a prefetch starts only if, were all its bytes
    #: and those of every unread prefetch wasted, the wasted bytes would still not exceed
    #: the bytes prefetches brought that requests read, plus ``planner.waste_allowance_gib``
    #: (see :mod:`kvprefetch.controlplane.core.budgets`). Off for the oracle, whose
    #: forecasts are not guesses.
    waste_budget: bool = False
    #: How the engine's HBM prefix cache keeps a finished session's KV, by name
    #: (:mod:`~kvprefetch.controlplane.core.hbm_retention`); None = LRU, the engine's own.
    hbm_retention: str | None = None
    #: HBM and DRAM hold different contexts: a context in HBM (a finished one, or one a
    #: request read into it) has no DRAM copy, and a context HBM evicts is demoted into
    #: DRAM over the host link, where the DRAM tier's own ranking admits it or not. The
    #: nearest engine mechanism is SGLang HiCache's ``write_back`` write policy (the host
    #: pool is written when the device evicts); vLLM + LMCache write every context
    #: through when it is stored. Simulator only (docs/engines-retention.md).
    exclusive_hierarchy: bool = False


POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in (
        PolicySpec("recompute", False, False, LoadStart.NEVER, EvictionKind.LRU, False,
                   modelled_on="plain vLLM prefix cache"),
        PolicySpec("local-lru", True, False, LoadStart.NEVER, EvictionKind.LRU, False,
                   modelled_on="LMCache local CPU backend"),
        PolicySpec("ondemand", True, True, LoadStart.ON_SCHEDULE, EvictionKind.LRU, False,
                   modelled_on="LMCache + remote backend"),
        PolicySpec("queue", True, True, LoadStart.ON_ARRIVAL, EvictionKind.LRU, False,
                   modelled_on="SGLang HiCache, CachedAttention"),
        # Misses are loaded during the queue wait, but at most a few TTLBs before the GPU
        # start: loading every miss at arrival (`queue`) holds DRAM for the whole of a
        # long wait and evicts KV that requests ahead in the queue need (which is why
        # `queue` can be slower than `ondemand` on one busy node).
        PolicySpec("predictive", True, True, LoadStart.ADAPTIVE, EvictionKind.PREDICTED_USE,
                   True, modelled_on="kvprefetch", suffix_eviction=True, waste_budget=True,
                   exclusive_hierarchy=True),
        # The oracle ranks HBM by its exact next use too (``next-use``): its two local
        # tiers evict by Belady's rule, over the same exclusive hierarchy as `predictive`.
        PolicySpec("oracle", True, True, LoadStart.ON_ARRIVAL, EvictionKind.PREDICTED_USE, True,
                   predictor="oracle", safety_margin_s=0.0, modelled_on="the physical limit",
                   suffix_eviction=True, hbm_retention="next-use", exclusive_hierarchy=True),
    )
}

#: The published peers (module docstring): simulator baselines over ``ondemand``'s flags.
PEER_POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in (
        PolicySpec("continuum-ttl", True, True, LoadStart.ON_SCHEDULE, EvictionKind.LRU, False,
                   modelled_on="Continuum / CacheTTL (arXiv 2511.02230): HBM pin with a TTL "
                   "after tool calls", hbm_retention="continuum"),
        PolicySpec("mori", True, True, LoadStart.ON_SCHEDULE, EvictionKind.LRU, False,
                   modelled_on="MORI (arXiv 2606.00866): idleness-ranked HBM placement",
                   hbm_retention="mori"),
        PolicySpec("ttl-lognormal", True, True, LoadStart.ON_SCHEDULE,
                   EvictionKind.RETENTION_WINDOW, False,
                   modelled_on="llm-d PR #2928 / LMCache PR #4456: a log-normal retention "
                   "window, applied in the DRAM tier"),
    )
}

#: The six policies compared everywhere, in report order (``all``).
POLICY_NAMES: tuple[str, ...] = ("recompute", "local-lru", "ondemand", "queue", "predictive",
                                 "oracle")


#: Every policy the simulator runs: the six, then the peers.
SIM_POLICIES: dict[str, PolicySpec] = POLICIES | PEER_POLICIES


def parse_policies(spec: str | None, *, peers: bool = False) -> tuple[PolicySpec, ...]:
    """Parse a comma-separated list of policy names (None or "all" = the six, in order);
    ``peers``: the peers are known too (the simulator's callers; a live service cannot
    carry out the HBM ones)."""
    if spec is None or spec.strip() in ("", "all"):
        return tuple(POLICIES[name] for name in POLICY_NAMES)
    known = SIM_POLICIES if peers else POLICIES
    out: list[PolicySpec] = []
    for raw in spec.split(","):
        name = raw.strip()
        if name not in known:
            raise ConfigError(f"unknown policy {name!r}; known: {', '.join(known)}")
        if known[name] not in out:
            out.append(known[name])
    return tuple(out)
