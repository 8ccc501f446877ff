"""Discrete-event trace replay over a modelled GPU fleet (see :mod:`.simulator`)."""

from kvprefetch.controlplane.sim.metrics import summarize, working_set_peak_bytes, yardstick
from kvprefetch.controlplane.sim.runner import SimOptions, run_policies, run_policy
from kvprefetch.controlplane.sim.scenarios import SCENARIOS, FleetEvents, apply_scenario
from kvprefetch.controlplane.sim.simulator import PolicyRun, RequestRecord, Simulation

__all__ = [
    "SCENARIOS",
    "FleetEvents",
    "PolicyRun",
    "RequestRecord",
    "SimOptions",
    "Simulation",
    "apply_scenario",
    "run_policies",
    "run_policy",
    "summarize",
    "working_set_peak_bytes",
    "yardstick",
]
