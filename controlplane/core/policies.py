"""The policies compared everywhere, and the published peers the simulator judges them
against.

A policy is a small frozen record of capabilities, not code: the simulator and the live
service read the flags, so the differences between policies come from the flags alone.
What a policy asks for is resolved against the engine it runs on
(:func:`~kvprefetch.controlplane.core.engines.on_engine`): every policy in a comparison
gets the same engine mechanisms. ``predictive`` is always shown beside its two yardsticks:
``reactive`` (its mechanisms, forecasts off) and ``perfect`` (its mechanisms, the true
next arrivals).

The peers (:data:`PEER_POLICIES`) are the strongest published retention policies, each
modelled at the tier it acts on over the flags of the baseline it extends (``ondemand``:
a node-local DRAM tier and a remote store, loads at GPU start), with the same router,
cost model, links and engine as every other policy: ``continuum-ttl``
(:mod:`~kvprefetch.controlplane.sim.peers.continuum`, HBM), ``mori``
(:mod:`~kvprefetch.controlplane.sim.peers.mori`, HBM) and ``ttl-lognormal``
(:mod:`~kvprefetch.controlplane.core.retention_window`, DRAM). They are simulator
baselines: the two HBM ones change the engine's prefix cache, which the simulator models
and the live service does not drive, so the live service does not offer them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

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
    #: Predictor this policy always uses (``perfect``: the oracle, which reads the future);
    #: None = the user's.
    predictor: str | None = None
    #: Overrides the planner's safety margin (``perfect`` finishes exactly in time).
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
    #: refilled every ``planner.waste_window_s`` (see
    #: :mod:`kvprefetch.controlplane.core.budgets`). Off for ``perfect``, whose forecasts
    #: are not guesses.
    waste_budget: bool = False
    #: The policy's own change to how the engine's HBM prefix cache keeps a finished
    #: session's KV, by name (:mod:`~kvprefetch.controlplane.sim.peers.hbm_retention`); None =
    #: the engine's LRU. Only the published HBM peers bring one: no engine profile lets an
    #: outside component rank HBM (:mod:`~kvprefetch.controlplane.core.engines`).
    hbm_retention: str | None = None
    #: The policy reads forecasts (predicted next use, hints). Off: the same mechanisms
    #: with recency in place of predicted next use and no prefetch (``reactive``).
    forecasts: bool = True
    #: The policy's predictor reads client hints when clients send them.
    reads_hints: bool = True
    # The engine's mechanisms, set for a run by
    # :func:`~kvprefetch.controlplane.core.engines.on_engine` (the defaults are the live
    # service's: write-through, loads at GPU start held by the GPU, evict advice).
    #: Room for a prefetch is made by whole-session evict advice chosen by predicted next
    #: use; without it the tier's own ranking chooses.
    evict_advice: bool = True
    #: A context reaches DRAM when HBM evicts it (lazy offload, write-back), not when it is
    #: stored; a DRAM copy read into HBM stays until DRAM evicts it.
    demote_on_evict: bool = False
    #: The GPU serves other requests while a request's remote KV loads.
    async_load: bool = False
    #: The engine profile the flags above come from; None: not resolved on one.
    engine: str | None = None


PREDICTIVE = PolicySpec(
    "predictive", True, True, LoadStart.ADAPTIVE, EvictionKind.PREDICTED_USE, True,
    modelled_on="kvprefetch", suffix_eviction=True, waste_budget=True)

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
        PREDICTIVE,
        # `predictive`'s mechanisms with its forecasts off: the yardstick of what the
        # forecasts add (recency in place of predicted next use, no prefetch, hints unread).
        replace(PREDICTIVE, name="reactive", forecasts=False, waste_budget=False,
                modelled_on="kvprefetch, forecasts off"),
        # `predictive`'s mechanisms fed the true next arrivals, finishing exactly in time
        # and spending no waste budget: the yardstick of what a perfect forecast adds.
        replace(PREDICTIVE, name="perfect", predictor="oracle", safety_margin_s=0.0,
                waste_budget=False, modelled_on="kvprefetch, perfect forecasts"),
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

#: `predictive`'s mechanisms fed the true gap laws of synthetic traffic (simulator only,
#: :mod:`kvprefetch.controlplane.sim.true_law`): the bound of what forecasts from a
#: session's history can buy, between ``reactive`` (none) and ``perfect`` (the future). It
#: reads no hints (they are not history).
TRUE_LAW_POLICY = replace(PREDICTIVE, name="true-law", predictor="true-law", reads_hints=False,
                          modelled_on="kvprefetch, forecasts from the true gap laws")

#: Every policy the simulator runs: the core policies, then the peers, then the bound that
#: only synthetic traffic has.
SIM_POLICIES: dict[str, PolicySpec] = POLICIES | PEER_POLICIES | {
    TRUE_LAW_POLICY.name: TRUE_LAW_POLICY}

#: What ``all`` runs, in report order: the references without a remote store, the
#: baselines (the engine's own loads, the peers, ``reactive``), ``predictive`` and
#: ``perfect``.
POLICY_NAMES: tuple[str, ...] = ("recompute", "local-lru", "ondemand", "queue",
                                 *PEER_POLICIES, "reactive", "predictive", "perfect")

#: The baselines ``predictive`` is judged against: every policy with a remote store that
#: reads no forecast of its own.
BASELINE_NAMES: tuple[str, ...] = ("ondemand", "queue", *PEER_POLICIES, "reactive")


def parse_policies(spec: str | None, *, peers: bool = False) -> tuple[PolicySpec, ...]:
    """Parse a comma-separated list of policy names (None or "all" = :data:`POLICY_NAMES`,
    in order, those known); ``peers``: the peers are known too
    (the simulator's callers; a live service cannot carry out the HBM ones)."""
    known = SIM_POLICIES if peers else POLICIES
    if spec is None or spec.strip() in ("", "all"):
        return tuple(known[name] for name in POLICY_NAMES if name in known)
    out: list[PolicySpec] = []
    for raw in spec.split(","):
        name = raw.strip()
        if name not in known:
            raise ConfigError(f"unknown policy {name!r}; known: {', '.join(known)}")
        if known[name] not in out:
            out.append(known[name])
    return tuple(out)
