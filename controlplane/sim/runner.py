"""Run several policies over one trace and assemble the :class:`~.report.SimReport`.

Policies are independent replays, so they run in parallel worker processes (one per core
by default); each replay is deterministic, so the report does not depend on the number of
workers.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from controlplane.base.config import FleetConfig
from controlplane.base.types import Trace
from controlplane.core.policies import PolicySpec
from predictors.registry import load as load_predictor

from .metrics import gap_closure, summarize, working_set_peak_bytes
from .report import PolicySummary, SimMeta, SimReport
from .simulator import PolicyRun, Simulation


@dataclass(frozen=True, slots=True)
class SimOptions:
    predictor: str = "last-gap"
    seed: int = 0
    clear_tiers_at_s: float | None = None
    scenario: str = "default"
    workers: int = 1


def run_policy(trace: Trace, fleet: FleetConfig, policy: PolicySpec, predictor_spec: str,
               clear_tiers_at_s: float | None = None,
               progress: Callable[[int], None] | None = None) -> PolicyRun:
    predictor = load_predictor(policy.predictor or predictor_spec, trace=trace)
    sim = Simulation(trace, fleet, policy, predictor, clear_tiers_at_s=clear_tiers_at_s)
    return sim.run(progress)


_WORKER_STATE: dict[str, Any] = {}


def _init_worker(trace: Trace, fleet: FleetConfig, predictor: str, clear: float | None,
                 queue: Any) -> None:
    _WORKER_STATE.update(trace=trace, fleet=fleet, predictor=predictor, clear=clear,
                         queue=queue)


def _run_in_worker(policy: PolicySpec) -> PolicySummary:
    st = _WORKER_STATE
    queue = st["queue"]
    run = run_policy(st["trace"], st["fleet"], policy, st["predictor"], st["clear"],
                     progress=queue.put if queue is not None else None)
    return summarize(run)


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
    results: dict[str, PolicySummary] = {}
    if options.workers <= 1 or len(policies) <= 1:
        for policy in policies:
            run = run_policy(trace, fleet, policy, options.predictor, options.clear_tiers_at_s,
                             progress)
            results[policy.name] = summarize(run)
    else:
        ctx = mp.get_context("fork")
        queue = ctx.Queue() if progress is not None else None
        with ProcessPoolExecutor(
            max_workers=min(options.workers, len(policies)), mp_context=ctx,
            initializer=_init_worker,
            initargs=(trace, fleet, options.predictor, options.clear_tiers_at_s, queue),
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
        working_set_peak_bytes=working_set,
        local_capacity_bytes=local_capacity,
        pressure_ratio=round(working_set / max(1, local_capacity), 3),
        wall_s=round(time.perf_counter() - started, 3),
    )
    closure = gap_closure({name: p.returning.ttft_mean_s for name, p in results.items()})
    return SimReport(meta, results, closure)
