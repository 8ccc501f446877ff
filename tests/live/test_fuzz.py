"""A short schemathesis pass over the HTTP API served locally with two tenants (the driver
of ``make fuzz``, tests/live/fuzz_api.py, with a few hundred cases instead of 5,000, some
of them in stateful scenarios that follow a session from call to call), and its boundary
pass (schemathesis' coverage phase: every field's limits and the values just past them,
sent as both tenants): no 5xx, no answer the OpenAPI document does not describe, no call
with tenant B's token that succeeds on tenant A's session, no invalid value accepted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from fuzz_api import Server, fuzz

#: Cases of the pass (``make fuzz`` runs 5,000), and how many of them are stateful (1,000).
CASES = int(os.environ.get("KVPREFETCH_FUZZ_CASES", "240"))
STATEFUL_CASES = int(os.environ.get("KVPREFETCH_FUZZ_STATEFUL_CASES", "100"))
#: Calls of the boundary pass: all of it by default (about 1,050, ~15 s), as in ``make fuzz``.
_BOUNDARY = os.environ.get("KVPREFETCH_FUZZ_BOUNDARY_CASES", "all")
BOUNDARY_CASES = None if _BOUNDARY == "all" else int(_BOUNDARY)


@pytest.mark.servers
@pytest.mark.slow
def test_a_short_schemathesis_pass_finds_no_5xx_undocumented_or_cross_tenant_answer(
        tmp_path: Path) -> None:
    with Server(tmp_path) as srv:
        result = fuzz(srv.url, CASES, seed=3, stateful_cases=STATEFUL_CASES)
    assert result["cases"] >= CASES
    assert result["server_errors"] == 0, result["examples"]
    assert result["undocumented"] == 0, result["examples"]
    assert result["cross_tenant_successes"] == 0, result["examples"]
    # the pass reached the scheduler (2xx) and replayed calls against the other tenant
    assert any(k.endswith(" 200") for k in result["statuses"]), result["statuses"]
    assert result["cross_tenant_replays"] > 0
    # the stateful scenarios carried sessions from call to call (2xx after 2xx on one id)
    stateful = result["stateful"]
    assert stateful["cases"] >= STATEFUL_CASES and stateful["scenarios"] > 0
    assert sum(stateful["transitions"].values()) > 0, stateful


@pytest.mark.servers
@pytest.mark.slow
def test_the_boundary_pass_finds_no_5xx_undocumented_answer_or_accepted_invalid_value(
        tmp_path: Path) -> None:
    with Server(tmp_path) as srv:
        result = fuzz(srv.url, 0, seed=3, boundary_cases=BOUNDARY_CASES)
    boundary = result["boundary"]
    assert result["cases"] == result["boundary_cases"] == boundary["cases"] > 0
    if BOUNDARY_CASES is None:  # every generated case, sent as each tenant
        assert boundary["cases"] >= 2 * boundary["generated"] - 10
    assert result["server_errors"] == 0, result["examples"]
    assert result["undocumented"] == 0, result["examples"]
    assert result["cross_tenant_successes"] == 0, result["examples"]
    assert boundary["rule_violations"] == 0, result["examples"]
    # limits and the values just past them, lists at and over maxItems, wrong methods, no
    # token: the pass covered them, and valid boundary values reached the scheduler
    assert {"value_above_maximum", "value_below_minimum", "string_above_max_length",
            "maximum_items_array", "array_above_max_items", "unspecified_http_method",
            "missing_parameter"} <= set(boundary["scenarios"]), boundary["scenarios"]
    for op in ("route", "request_started", "request_finished", "hint", "session_state"):
        assert result["statuses"].get(f"{op} 200", 0) > 0, result["statuses"]
    assert result["statuses"].get("route 401", 0) > 0  # the call without a token
    assert result["cross_tenant_replays"] > 0
