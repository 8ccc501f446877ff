"""The OpenAI-compatible gateway (controlplane/live/gateway.py) against a stand-in engine.

The stand-in answers vLLM's ``/tokenize``, ``/v1/completions`` and ``/v1/chat/completions``
(streaming with a usage-only last event, as vLLM sends when asked) in-process; the
scheduler is a recording double. What is checked: the session is identified (header,
``user``, prompt hash), the request goes to the node the scheduler chose, unchanged, token
ids are stored, ``request_finished`` carries the stop reason and token counts, a tool-call
answer sends a hint, and a scheduler that fails or times out still serves, routed by
load, counted in metrics. The real engine behind the gateway: tests/agents/test_vllm_cpu.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.keys import tenant_cache_salt
from kvprefetch.controlplane.live.gateway import Gateway, GatewayConfig, build_app

UPSTREAMS = ["http://node0", "http://node1"]


def _fake_engine(seen: list[tuple[str, dict[str, Any]]], finish: str = "stop") -> FastAPI:
    """vLLM's answers, in shape; the host header tells which node was called."""
    app = FastAPI()

    def ids(text: str) -> list[int]:
        return list(text.encode())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        body = await request.json()
        if "messages" not in body and not isinstance(body.get("prompt"), str):
            return JSONResponse({"error": {"message": "prompt: not a string"}}, 400)
        if "messages" in body:
            tokens = ids("".join(f"<{m['role']}>{m['content']}" for m in body["messages"]))
        else:
            tokens = ids(body["prompt"])
        return {"tokens": tokens, "count": len(tokens), "max_model_len": 4096}

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append((request.headers["host"], body))
        return JSONResponse({"id": "c1", "object": "text_completion", "choices": [
            {"index": 0, "text": "ok", "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                      "prompt_tokens_details": {"cached_tokens": 2}}})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        seen.append((request.headers["host"], body))

        async def events() -> Any:
            for text in ("he", "llo"):
                yield "data: " + json.dumps({"choices": [
                    {"index": 0, "delta": {"content": text}, "finish_reason": None}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [
                {"index": 0, "delta": {}, "finish_reason": finish}]}) + "\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + json.dumps({"choices": [], "usage": {
                    "prompt_tokens": 9, "completion_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 8}}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

    return app


class RecordingScheduler:
    """The parts of kvprefetch.controlplane.live.client.Client the gateway calls."""

    def __init__(self, node: int | None = 1, fail: bool = False) -> None:
        self.node, self.fail = node, fail
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def route(self, session_id: str, **kw: Any) -> api.RouteAnswer:
        self.calls.append(("route", session_id, kw))
        if self.fail:
            raise ConnectionError("scheduler down")
        return api.RouteAnswer(node=self.node) if self.node is not None else (
            api.RouteAnswer.no_prefetch(timed_out=True))

    def request_finished(self, session_id: str, **kw: Any) -> api.Ack:
        self.calls.append(("request_finished", session_id, kw))
        if self.fail:
            raise ConnectionError("scheduler down")
        return api.Ack()

    def hint(self, session_id: str, hint: str, **kw: Any) -> api.Ack:
        self.calls.append(("hint", session_id, {"hint": hint, **kw}))
        return api.Ack()


class Harness:
    def __init__(self, scheduler: RecordingScheduler | None, finish: str = "stop",
                 tenant: str | None = "acme", cache_salt: str = "") -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.stored: list[tuple[str, str, list[int]]] = []
        self.scheduler = scheduler

        def sink(tenant: str, session: str, ids: Sequence[int]) -> None:
            self.stored.append((tenant, session, list(ids)))

        # A generous route deadline: these tests check what a route answer does, on a
        # shared machine where a thread hop can take more than the default.
        self.gateway = Gateway(GatewayConfig(upstreams=UPSTREAMS, tenant=tenant,
                                             cache_salt=cache_salt, route_deadline_s=2.0),
                               scheduler=scheduler, tokens=sink,
                               transport=httpx.ASGITransport(app=_fake_engine(self.seen,
                                                                              finish)))
        self.app = build_app(self.gateway)

    def run(self, calls: Any) -> Any:
        async def go() -> Any:
            await self.gateway.start()
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                             base_url="http://gateway") as client:
                    return await calls(client)
            finally:
                await self.gateway.close()

        return asyncio.run(go())

    def metric(self, name: str, **labels: str) -> float:
        value = self.gateway.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def test_a_completion_goes_to_the_scheduler_s_node_and_is_reported() -> None:
    h = Harness(RecordingScheduler(node=1))
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}

    async def calls(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/completions", json=body,
                                 headers={"X-Session-ID": "s1"})

    response = h.run(calls)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "ok"
    assert response.headers["x-kvp-node"] == "1" and response.headers["x-session-id"] == "s1"
    # forwarded unchanged but for the tenant's cache salt and the session vLLM's KV events
    # name (the agent maps HBM blocks to sessions by it), to node 1
    assert h.seen == [("node1", {**body, "cache_salt": tenant_cache_salt("acme"),
                                 "session_id": "acme/s1",
                                 "vllm_xargs": {"kv_cache_report_mode": "full"}})]
    ids = list(b"hello")
    assert h.stored == [("acme", "s1", ids)]
    kinds = [(c[0], c[1]) for c in h.scheduler.calls] if h.scheduler else []
    assert kinds == [("route", "s1"), ("request_finished", "s1")]
    route, finished = h.scheduler.calls[0][2], h.scheduler.calls[1][2]  # type: ignore[union-attr]
    assert route["token_ids"] == ids and route["tenant"] == "acme"
    assert finished["node"] == 1 and finished["input_tokens"] == 5
    assert finished["output_tokens"] == 2
    assert finished["stop_reason"] == "end_turn"  # the engine's "stop", by its canonical name
    # vLLM's cached prompt tokens: the request's local-tier read, for the prefetch books
    assert finished["local_tokens_read"] == 2
    assert h.metric("kvprefetch_gateway_routed_total", by="scheduler") == 1
    assert h.metric("kvprefetch_gateway_requests_total", endpoint="completions", outcome="ok") == 1


def test_a_streamed_chat_is_forwarded_event_by_event_and_counted() -> None:
    h = Harness(RecordingScheduler(node=0), finish="tool_calls")
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "messages": messages, "stream": True, "user": "u-7"}

    async def calls(client: httpx.AsyncClient) -> list[str]:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            return [line async for line in response.aiter_lines() if line]

    lines = h.run(calls)
    # The usage-only event the gateway asked for is not shown to a caller who did not.
    assert len(lines) == 4 and lines[-1] == "data: [DONE]"
    assert "".join(json.loads(x[5:])["choices"][0]["delta"].get("content", "")
                   for x in lines[:-1]) == "hello"
    host, sent = h.seen[0]
    assert host == "node0" and sent["stream_options"] == {"include_usage": True}
    assert sent["cache_salt"] == tenant_cache_salt("acme")
    assert h.stored == [("acme", "u-7", list(b"<user>hi"))]  # the engine's tokenization
    finished = [c for c in h.scheduler.calls if c[0] == "request_finished"]  # type: ignore[union-attr]
    assert finished[0][2]["output_tokens"] == 3 and finished[0][2]["local_tokens_read"] == 8
    assert finished[0][2]["stop_reason"] == "tool_use"  # "tool_calls", canonical
    hints = [c for c in h.scheduler.calls if c[0] == "hint"]  # type: ignore[union-attr]
    assert hints == [("hint", "u-7", {"hint": "tool_running", "tenant": "acme",
                                      "timeout_s": 2.0})]


def test_usage_is_passed_on_when_the_caller_asks_for_it() -> None:
    h = Harness(RecordingScheduler(node=0))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "stream_options": {"include_usage": True}}

    async def calls(client: httpx.AsyncClient) -> list[str]:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            return [line async for line in response.aiter_lines() if line]

    lines = h.run(calls)
    assert any('"usage"' in line for line in lines) and len(lines) == 5


@pytest.mark.parametrize("scheduler", [RecordingScheduler(fail=True),
                                       RecordingScheduler(node=None), None],
                         ids=["fails", "times-out", "absent"])
def test_without_a_scheduler_answer_it_still_serves_routed_by_load(
        scheduler: RecordingScheduler | None) -> None:
    h = Harness(scheduler)
    prompt = list(range(40))

    async def calls(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.post("/v1/completions",
                                  json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
                for _ in range(2)]

    responses = h.run(calls)
    assert [r.status_code for r in responses] == [200, 200]
    assert h.metric("kvprefetch_gateway_routed_total", by="load") == 2
    expected_unavailable = 0 if scheduler is None else (4 if scheduler.fail else 2)
    assert h.metric("kvprefetch_gateway_scheduler_unavailable_total") == expected_unavailable
    # No header, no user: the session is the prompt's hash, the same on every turn.
    sessions = {s for _, s, _ in h.stored}
    assert len(sessions) == 1 and next(iter(sessions)).startswith("prefix-")
    assert h.stored[0][2] == prompt  # token ids given as the prompt are used as they are


def test_models_and_upstream_errors_pass_through() -> None:
    h = Harness(RecordingScheduler(node=0))

    async def calls(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        models = await client.get("/v1/models")
        bad = await client.post("/v1/completions", json={"model": "tiny", "prompt": 5})
        return models, bad

    models, bad = h.run(calls)
    assert models.json()["data"][0]["id"] == "tiny"
    # The stand-in cannot tokenize an int prompt: the engine's error comes back, no store.
    assert bad.status_code == 400 and "not a string" in bad.text and h.stored == []
    assert h.metric("kvprefetch_gateway_requests_total", endpoint="completions",
                    outcome="tokenize_error") == 1


@pytest.mark.parametrize(("tenant", "base", "salt"), [
    (None, "", None),  # the default tenant without a base salt: the body as it came
    ("default", "node-secret", "node-secret"),
    ("acme", "", tenant_cache_salt("acme")),
    ("acme", "node-secret", tenant_cache_salt("acme", "node-secret")),
])
def test_each_tenant_s_requests_carry_its_cache_salt(tenant: str | None, base: str,
                                                     salt: str | None) -> None:
    """The engine keys KV (vLLM's prefix cache, LMCache's objects) by the request's
    cache_salt: the gateway sets the tenant's, replacing any the caller gave."""
    h = Harness(RecordingScheduler(node=0), tenant=tenant, cache_salt=base)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "cache_salt": "forged"}

    async def calls(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/completions", json=body, headers={"X-Session-ID": "s"})

    assert h.run(calls).status_code == 200
    (_, sent), = h.seen
    assert sent.get("cache_salt") == (salt or "forged")
