"""Stop reasons and hints on the real path: an OpenAI-compatible engine's finish reasons go
through the gateway to a real scheduler service, whose ``default`` predictor files the
session's idle gaps under the canonical class (``tool_calls`` -> ``tool_use``) and reads the
gateway's tool hint. The engine is the in-process stand-in of test_vllm_gateway.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from test_vllm_gateway import Harness

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.types import HintKind
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService
from kvprefetch.predictors.adaptive import AdaptivePredictor
from kvprefetch.predictors.hinted import HintedPredictor

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})


def _conversation(finish: str, turns: int) -> tuple[HintedPredictor, list[str]]:
    """``turns`` chat turns of one session through the gateway, each answered with
    ``finish``; the service's predictor and the stop class of the session's idle gap after
    each turn (the bucket the shipped model forecasts it from)."""
    with SchedulerService(ServiceConfig(fleet=FLEET, tenants=("acme",))).start() as svc:
        predictor = svc.core.predictor
        assert isinstance(predictor, HintedPredictor)  # `default`: the shipped model + hints
        model = predictor.inner
        assert isinstance(model, AdaptivePredictor)
        h = Harness(connect(service=svc, tenant="acme"), finish=finish)  # type: ignore[arg-type]
        classes: list[str] = []

        async def calls(client: httpx.AsyncClient) -> None:
            messages: list[dict[str, Any]] = []
            for turn in range(turns):
                messages.append({"role": "user", "content": f"step {turn}"})
                r = await client.post("/v1/chat/completions", headers={"X-Session-ID": "s1"},
                                      json={"model": "tiny", "messages": messages,
                                            "stream": True})
                assert r.status_code == 200
                states = [st for sid, st in model._sessions.items() if "s1" in str(sid)]
                assert len(states) == 1
                classes.append(states[0].bucket.partition("|")[0])
                messages.append({"role": "assistant", "content": "ok"})

        h.run(calls)
        return predictor, classes


@pytest.mark.parametrize(("finish", "canonical"), [("tool_calls", "tool_use"),
                                                   ("stop", "end_turn"),
                                                   ("length", "max_tokens")])
def test_openai_finish_reasons_reach_the_predictor_by_their_canonical_class(
        finish: str, canonical: str) -> None:
    _, classes = _conversation(finish, 3)
    assert classes == [canonical] * 3


def test_a_tool_call_answer_reaches_the_default_predictor_as_a_tool_hint() -> None:
    predictor, _ = _conversation("tool_calls", 2)
    hints = list(predictor._hints.values())
    assert [h.kind for h in hints] == [HintKind.TOOL_RUNNING]
