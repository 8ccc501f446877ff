"""Run several policies over one trace and assemble the :class:`~.report.SimReport`.

Policies are independent replays, so they run in parallel worker processes (one per core
by default); each replay is deterministic, so the report does not depend on the number of
workers.

With client hints on (:attr:`SimOptions.hints`), the hints are planned once per trace and
every policy's replay sends the same ones; the policies that run the user's predictor get it
wrapped in :class:`~kvprefetch.predictors.hinted.HintedPredictor`, so that it reads them (the
oracle has its own predictor, which knows the future anyway).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.types import Trace
from kvprefetch.controlplane.core.engines import DEFAULT_ENGINE, EngineProfile
from kvprefetch.controlplane.core.policies import PolicySpec
from kvprefetch.predictors.base import Predictor
from kvprefetch.predictors.hinted import HintedPredictor, with_hints
from kvprefetch.predictors.registry import load as load_predictor

from .hints import HintConfig, HintCounts, PlannedHint, hint_kind_names, plan_hints
from .metrics import summarize, working_set_peak_bytes, yardstick
from .report import HintsMeta, PolicySummary, SimMeta, SimReport
from .simulator import PolicyRun, Simulation
from .true_law import TRUE_LAW, true_law_predictor


@dataclass(frozen=True, slots=True)
class SimOptions:
    predictor: str = "default"
    seed: int = 0
    clear_tiers_at_s: float | None = None
    #: Scale-out: the fleet's last node joins at this time (absent before).
    join_at_s: float | None = None
    scenario: str = "default"
    workers: int = 1
    #: Client hints the simulated clients send; None = no hints at all.
    hints: HintConfig | None = None
    #: Scheduler shards the decisions are split over
    #: (:mod:`kvprefetch.controlplane.sim.sharded_core`).
    shards: int = 1
    #: The shards book each node's whole tier and the node evicts LRU across them (live:
    #: ``shard_tier: shared``), instead of 1/N each.
    shared_tier: bool = False
    #: The engine profile every policy runs on (:mod:`kvprefetch.controlplane.core.engines`),
    #: or its name.
    engine: EngineProfile | str = DEFAULT_ENGINE


def hinted_predictor(policy: PolicySpec, predictor: Predictor) -> Predictor:
    """``predictor`` as a policy uses it when clients send hints: the user's predictor reads
    them through :class:`~kvprefetch.predictors.hinted.HintedPredictor` (unless it is one
    already); a policy that reads no hint gets the model under that layer (the ``default``
    predictor has it built in); a policy's own predictor (the oracle's), and that of a
    policy that reads no forecast, is left alone."""
    if policy.predictor is not None or not policy.forecasts:
        return predictor
    if not policy.reads_hints:
        return predictor.inner if isinstance(predictor, HintedPredictor) else predictor
    return with_hints(predictor)


def run_policy(trace: Trace, fleet: FleetConfig, policy: PolicySpec, predictor_spec: str,
               clear_tiers_at_s: float | None = None,
               progress: Callable[[int], None] | None = None, *,
               hints: Sequence[PlannedHint] | None = None,
               join_at_s: float | None = None, shards: int = 1,
               shared_tier: bool = False,
               engine: EngineProfile | str = DEFAULT_ENGINE) -> PolicyRun:
    """One policy's replay on ``engine``. ``hints``: the planned client hints
    (:func:`plan_hints`), which also turns the predictor's hint reading on (even when
    empty); None = no hints."""
    predictor = (true_law_predictor(trace) if policy.predictor == TRUE_LAW
                 else load_predictor(policy.predictor or predictor_spec, trace=trace))
    if hints is not None:
        predictor = hinted_predictor(policy, predictor)
    sim = Simulation(trace, fleet, policy, predictor, clear_tiers_at_s=clear_tiers_at_s,
                     join_at_s=join_at_s, hints=hints or (), shards=shards,
                     shared_tier=shared_tier, engine=engine)
    return sim.run(progress)


_WORKER_STATE: dict[str, Any] = {}


def _init_worker(trace: Trace, fleet: FleetConfig, options: SimOptions, queue: Any,
                 hints: Sequence[PlannedHint] | None) -> None:
    _WORKER_STATE.update(trace=trace, fleet=fleet, options=options, queue=queue, hints=hints)


def _run_in_worker(policy: PolicySpec) -> PolicySummary:
    st = _WORKER_STATE
    queue = st["queue"]
    return summarize(_run(st["trace"], st["fleet"], policy, st["options"], st["hints"],
                          queue.put if queue is not None else None))


def _run(trace: Trace, fleet: FleetConfig, policy: PolicySpec, options: SimOptions,
         hints: Sequence[PlannedHint] | None, progress: Callable[[int], None] | None
         ) -> PolicyRun:
    return run_policy(trace, fleet, policy, options.predictor, options.clear_tiers_at_s,
                      progress, hints=hints, join_at_s=options.join_at_s,
                      shards=options.shards, shared_tier=options.shared_tier,
                      engine=options.engine)


def run_policies(
    trace: Trace,
    fleet: FleetConfig,
    policies: Sequence[PolicySpec],
    options: SimOptions,
    *,
    progress: Callable[[int], None] | None = None,
) -> SimReport:
    """Replay ``trace`` once per policy and return the report."""
    started = time.perf_counter()
    hints = plan_hints(trace, options.hints) if options.hints is not None else None
    results: dict[str, PolicySummary] = {}
    if options.workers <= 1 or len(policies) <= 1:
        for policy in policies:
            results[policy.name] = summarize(_run(trace, fleet, policy, options, hints,
                                                  progress))
    else:
        ctx = mp.get_context("fork")
        queue = ctx.Queue() if progress is not None else None
        with ProcessPoolExecutor(
            max_workers=min(options.workers, len(policies)), mp_context=ctx,
            initializer=_init_worker,
            initargs=(trace, fleet, options, queue, hints),
        ) as pool:
            futures = {p.name: pool.submit(_run_in_worker, p) for p in policies}
            while queue is not None and progress is not None and not all(
                f.done() for f in futures.values()
            ):
                try:
                    progress(queue.get(timeout=0.2))
                except Exception:  # queue.Empty: nothing reported in this slice
                    continue
            for name, fut in futures.items():
                results[name] = fut.result()
            while queue is not None and progress is not None and not queue.empty():
                progress(queue.get())
    working_set = working_set_peak_bytes(trace, fleet.model.kv_bytes_per_token)
    local_capacity = fleet.local_capacity_bytes
    meta = SimMeta(
        trace=trace.name,
        trace_format=trace.source_format,
        requests=trace.requests,
        sessions=len(trace.sessions),
        seed=options.seed,
        scenario=options.scenario,
        predictor=options.predictor,
        model=fleet.model.name,
        nodes=fleet.nodes,
        engine=options.engine if isinstance(options.engine, str) else options.engine.name,
        working_set_peak_bytes=working_set,
        local_capacity_bytes=local_capacity,
        pressure_ratio=round(working_set / max(1, local_capacity), 3),
        wall_s=round(time.perf_counter() - started, 3),
        hints=_hints_meta(options.hints, hints),
        shards=options.shards,
        shared_tier=options.shared_tier,
    )
    return SimReport(meta, results, yardstick(results))


def _hints_meta(config: HintConfig | None, hints: Sequence[PlannedHint] | None
                ) -> HintsMeta | None:
    """The report's record of the hints; the counts are the plan's, which every replay
    sends in full (a response always ends before the hints planned after it)."""
    if config is None or hints is None:
        return None
    counts = HintCounts.of(hints)
    return HintsMeta(kinds=hint_kind_names(config.kinds), coverage=config.coverage,
                     seed=config.seed, tool_eta_sigma=config.tool_eta_sigma,
                     abandon_share=config.abandon_share, sent_typing=counts.typing,
                     sent_tool=counts.tool, sent_abandoned=counts.abandoned)
