"""The gateway as a Ray Serve application on local Ray: one request through Serve's HTTP
proxy reaches a fake upstream (a plain HTTP stub standing in for a node's vLLM), and comes
back with the gateway's headers. No scheduler: the gateway routes by load and says so."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import Request  # at module level: the stub's annotations are strings

pytestmark = [pytest.mark.servers, pytest.mark.live]


@contextlib.contextmanager
def _stub_upstream() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """An OpenAI-ish upstream on loopback that records what it was sent."""
    import uvicorn
    from fastapi import FastAPI

    from kvprefetch.agents.embedded import free_port

    seen: list[dict[str, Any]] = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body)
        return {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
                          "total_tokens": len(body["prompt"]) + 1}}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the stub upstream did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_gateway_serves_a_request_as_a_ray_serve_application() -> None:
    import httpx
    import ray
    from ray import serve

    from kvprefetch.agents.embedded import free_port
    from kvprefetch.controlplane.base.keys import tenant_cache_salt
    from kvprefetch.controlplane.live.gateway import GatewayConfig
    from kvprefetch.controlplane.live.serve_app import gateway_application

    with _stub_upstream() as (upstream, seen):
        ray.init(num_cpus=2, object_store_memory=80 << 20, include_dashboard=False,
                 log_to_driver=False)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(gateway_application(GatewayConfig(upstreams=[upstream],
                                                        tenant="t")),
                      name="gateway", route_prefix="/")
            url = f"http://127.0.0.1:{port}"
            response = httpx.post(f"{url}/v1/completions", timeout=60.0,
                                  headers={"X-Session-ID": "s1"},
                                  json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 1})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == "hi"
            assert response.headers["x-session-id"] == "s1"
            assert response.headers["x-kvp-node"] == "0"
            # forwarded unchanged but for tenant t's cache salt (tenants never share KV)
            # and the session vLLM's KV events name
            assert seen == [{"model": "m", "prompt": [1, 2, 3], "max_tokens": 1,
                             "cache_salt": tenant_cache_salt("t"), "session_id": "t/s1",
                             "vllm_xargs": {"kv_cache_report_mode": "full"}}]
            metrics = httpx.get(f"{url}/metrics", timeout=30.0).text
            assert 'kvprefetch_gateway_requests_total{endpoint="completions",outcome="ok"} 1.0' \
                in metrics
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
