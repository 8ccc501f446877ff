"""Discrete-event trace replay over a modelled GPU fleet (see :mod:`.simulator`)."""

from controlplane.sim.metrics import gap_closure, summarize, working_set_peak_bytes
from controlplane.sim.runner import SimOptions, run_policies, run_policy
from controlplane.sim.scenarios import SCENARIOS, FleetEvents, apply_scenario
from controlplane.sim.simulator import PolicyRun, RequestRecord, Simulation

__all__ = [
    "SCENARIOS",
    "FleetEvents",
    "PolicyRun",
    "RequestRecord",
    "SimOptions",
    "Simulation",
    "apply_scenario",
    "gap_closure",
    "run_policies",
    "run_policy",
    "summarize",
    "working_set_peak_bytes",
]
