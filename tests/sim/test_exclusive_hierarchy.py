"""The exclusive HBM/DRAM hierarchy (``PolicySpec.exclusive_hierarchy``): a finished
context stays in HBM alone, and what HBM evicts is demoted into DRAM, so a node's two tiers
hold different sessions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession
from kvprefetch.controlplane.core.policies import POLICIES, SIM_POLICIES, PolicySpec
from kvprefetch.controlplane.sim import Simulation
from kvprefetch.predictors.registry import load as load_predictor

# One node, 4 GiB of HBM and 4 GiB of DRAM: 32k tokens each of the 8B model's KV.
FLEET = fleet_from_dict({"nodes": 1, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 4 * GIB}})
EXCLUSIVE_ONDEMAND = replace(POLICIES["ondemand"], name="ondemand-exclusive",
                             exclusive_hierarchy=True)


def _session(sid: str, start_s: float, gap_s: float) -> TraceSession:
    """Two turns: 20k tokens, then 500 more after ``gap_s`` of silence."""
    first = TraceRequest(sid, 0, 0.0, 20_000, 100, 0, None, "end_turn", 1.0)
    second = TraceRequest(sid, 1, 0.0, 20_600, 100, 20_100, gap_s, "end_turn", 1.0)
    return TraceSession(sid, start_s, (first, second))


def _run(policy: PolicySpec) -> Simulation:
    """a, then b while a is silent: each context fills most of a tier, so b's evicts a's
    from HBM, and from DRAM too unless the two tiers hold different sessions."""
    trace = Trace("exclusive", (_session("a", 0.0, 100.0), _session("b", 10.0, 300.0)), "test")
    sim = Simulation(trace, FLEET, policy, load_predictor("last-gap"))
    sim.run()
    return sim


def _ttft_of_a_s_second_turn(sim: Simulation) -> float:
    (rec,) = [r for r in sim.out.records if (r.session_id, r.turn) == ("a", 1)]
    return rec.ttft_s


def test_what_hbm_evicts_is_demoted_into_dram_and_read_from_there() -> None:
    write_through, exclusive = _run(POLICIES["ondemand"]), _run(EXCLUSIVE_ONDEMAND)
    # Write-through: b's copy displaced a's in DRAM too, so a's next turn loads it from the
    # remote store. Exclusive: HBM dropped a for b and a went down to DRAM; then a's next
    # turn displaced b from HBM the same way, and neither ever reads the remote store.
    assert write_through.out.remote_bytes >= 20_100 * FLEET.model.kv_bytes_per_token
    assert exclusive.out.remote_bytes == 0
    assert _ttft_of_a_s_second_turn(exclusive) < _ttft_of_a_s_second_turn(write_through)


@pytest.mark.parametrize("policy", [EXCLUSIVE_ONDEMAND, POLICIES["predictive"]],
                         ids=lambda p: p.name)
def test_a_node_s_two_tiers_never_hold_the_same_idle_session(policy: PolicySpec) -> None:
    sim = _run(policy)
    node = sim.nodes[0]
    in_hbm = {sid for sid in ("a", "b") if node.hbm.get(sid) is not None}
    in_dram = {sid for sid in ("a", "b") if sim.core.dram_tokens(0, sid) > 0}
    assert in_hbm and in_dram and not in_hbm & in_dram


def test_predictive_and_the_oracle_keep_the_tiers_exclusive_and_the_baselines_write_through(
) -> None:
    exclusive = {name for name, p in SIM_POLICIES.items() if p.exclusive_hierarchy}
    assert exclusive == {"predictive", "oracle"}
