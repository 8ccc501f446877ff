"""An OpenAI-compatible gateway in front of the nodes' vLLM servers.

Point an OpenAI client at the gateway; per request it does what a user would otherwise
hand-wire around the scheduler's client:

1. **identifies the session**: the ``X-Session-ID`` header, else the body's ``user``,
   else a hash of the prompt's first token ids (a conversation re-sends its whole context,
   so its first tokens stay the same turn after turn);
2. **tokenizes** the prompt with the engine's own tokenizer and chat template (vLLM's
   ``POST /tokenize``; a prompt of token ids is used as it is), since LMCache keys KV by
   token ids;
3. **asks the scheduler where to run it** (``route``, which records ``request_started``),
   and forwards the request to that node's vLLM unchanged, streaming or not, but for the
   tenant's ``cache_salt`` (:func:`~kvprefetch.controlplane.base.keys.tenant_cache_salt`: vLLM's
   prefix cache and LMCache's keys then keep tenants apart; none for the default tenant
   without a base salt);
4. after the answer: **stores the session's token ids** in the token store, where the
   nodes' ``lmcache-mp`` agents read them to warm the session, and reports
   ``request_finished`` with the stop reason (and a ``tool_running`` hint when the answer
   ends in tool calls).

The scheduler unreachable (no client, a timeout, an error) is not an outage: the request
runs on the node with the fewest requests in flight at this gateway, without prefetch, and
``kvprefetch_gateway_routed_total{by="load"}`` and
``kvprefetch_gateway_scheduler_unavailable_total`` say so. Upstream errors are answered with
the upstream's status and body. ``/metrics`` also has the time to first token as the caller
sees it (``kvprefetch_gateway_ttft_seconds``, with ``returning`` for a session's later
turns) and the route call's latency (:mod:`~kvprefetch.controlplane.live.gateway_metrics`).

``python -m kvprefetch.controlplane.live.gateway --upstream http://node0:8000 --upstream ...`` runs
it locally (uvicorn); :func:`build_app` gives the FastAPI app for any ASGI host. Nodes are
numbered in upstream order, as the scheduler numbers them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.controlplane.base.keys import tenant_cache_salt
from kvprefetch.controlplane.base.types import DEFAULT_TENANT, SessionKey
from kvprefetch.controlplane.base.vocabulary import stop_reason_or_none
from kvprefetch.controlplane.live.gateway_options import (
    TOKEN_ENV,
    add_arguments,
    stores_of_serve_config,
    token_store,
)
from kvprefetch.controlplane.live.node_registry import UpstreamDirectory

log = logging.getLogger(__name__)

Endpoint = Literal["completions", "chat/completions"]


class TokenSink(Protocol):
    """Where the gateway stores a session's token ids after each turn (called once per
    finished request, from a worker thread; idempotent: the latest context wins)."""

    def __call__(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> None: ...


class GatewayConfig(BaseModel):
    """The gateway's settings (units in names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Node i's OpenAI base URL (its vLLM), in the scheduler's node order.
    upstreams: list[str] = Field(min_length=1)
    #: The tenant named in scheduler calls and token-store keys (None: the token's).
    tenant: str | None = None
    session_header: str = "X-Session-ID"
    #: Without a header or ``user``, the session is a hash of this many first token ids.
    identity_prefix_tokens: int = Field(default=256, ge=1)
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    scheduler_timeout_s: float = Field(default=2.0, gt=0)
    #: The longest a request waits for the scheduler's route answer: past it the request
    #: runs on the least-loaded node without prefetch (counted in
    #: ``kvprefetch_gateway_route_deadline_total``) and the late answer is dropped.
    route_deadline_s: float = Field(default=0.005, gt=0, le=60)
    #: The base of the tenants' cache salts: the agents' ``lmcache.cache_salt`` (a secret
    #: makes the salts unguessable). "" and the default tenant: requests carry none.
    cache_salt: str = ""
    #: The ``deployment`` label of the gateway's latency histograms.
    deployment: str = "default"
    #: Follow the scheduler's node registry, read this often (seconds): nodes that join
    #: get traffic once their engine answers, lost ones none, a new engine address is used
    #: (:mod:`~kvprefetch.controlplane.live.node_registry`). 0: the configured upstreams
    #: only.
    nodes_refresh_s: float = Field(default=5.0, ge=0)


@dataclass(frozen=True)
class Routed:
    """Where one request runs and why."""

    node: int
    by: Literal["scheduler", "load"]


class Gateway:
    """The gateway's request handling, apart from the HTTP framework (see the module
    docstring). ``scheduler`` is a :class:`kvprefetch.controlplane.live.client.Client` (or None:
    route
    by load only); ``tokens`` stores token ids for the agents (None: not stored)."""

    def __init__(self, config: GatewayConfig, *, scheduler: Any | None = None,
                 tokens: TokenSink | None = None, transport: Any | None = None) -> None:
        from kvprefetch.controlplane.live.gateway_metrics import GatewayMetrics

        self.config = config
        #: The tenant's cache salt (fixed by the config: one hash, not one per request).
        self._salt = tenant_cache_salt(config.tenant or DEFAULT_TENANT, config.cache_salt)
        self._scheduler = scheduler
        self._tokens = tokens
        #: Node -> engine URL, following the scheduler's node registry once started.
        self.nodes = UpstreamDirectory(config.upstreams)
        self._follow: asyncio.Task[None] | None = None
        self._in_flight: Counter[int] = Counter()
        #: Streaming responses opened and not released yet (:meth:`release`).
        self._open_streams: set[Any] = set()
        #: The turn of the next tie among idle nodes for a call without a session.
        self._turn = -1
        self._http: Any = None
        #: An httpx transport for the upstream calls (tests: an ASGI app); None = network.
        self._transport = transport
        self.metrics = GatewayMetrics(config.deployment)
        self.metrics.follow_nodes(self.nodes.states)
        self.registry = self.metrics.registry

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        import httpx

        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.config.upstream_timeout_s,
                                           transport=self._transport)
        if (self.config.nodes_refresh_s > 0 and hasattr(self._scheduler, "nodes")
                and self._follow is None):
            self._follow = asyncio.ensure_future(self._follow_nodes())

    async def close(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follow
            self._follow = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # -- the node set -----------------------------------------------------------------

    async def _follow_nodes(self) -> None:
        """Read the scheduler's node registry every ``nodes_refresh_s`` until closed."""
        while True:
            await self.refresh_nodes()
            await asyncio.sleep(self.config.nodes_refresh_s)

    async def refresh_nodes(self) -> bool:
        """One read of the scheduler's node registry, applied to :attr:`nodes`: a node it
        newly routes to is routed to once its engine answers (:meth:`engine_answers`);
        whether a listing came (a failed read is counted, and the last listing holds)."""
        try:
            listing = await self._call("nodes", timeout_s=self.config.scheduler_timeout_s)
        except Exception as exc:  # the scheduler is unreachable: the last listing holds
            self.nodes.failed(exc)
            return False
        pending = self.nodes.pending(listing)
        answers = await asyncio.gather(*(self.engine_answers(url) for _, url in pending))
        self.nodes.apply(listing, unready={n for (n, _), ok in zip(pending, answers,
                                                                   strict=True) if not ok})
        return True

    async def engine_answers(self, url: str) -> bool:
        """Whether the engine at ``url`` serves requests: ``GET /health`` answered with a
        status below 500 (an engine without the endpoint answers 404; one still loading
        refuses the connection or answers 503)."""
        import httpx

        try:
            response = await self._http.get(f"{url}/health",
                                            timeout=self.config.scheduler_timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code < 500

    # -- the phases of one request ----------------------------------------------------

    def session_id(self, headers: dict[str, str], body: dict[str, Any],
                   token_ids: Sequence[int]) -> str:
        """The header, else ``user``, else a hash of the first token ids."""
        header = headers.get(self.config.session_header.lower())
        if header:
            return header
        user = body.get("user")
        if isinstance(user, str) and user:
            return user
        head = token_ids[: self.config.identity_prefix_tokens]
        digest = hashlib.blake2b(json.dumps(list(head)).encode(), digest_size=12).hexdigest()
        return f"prefix-{digest}"

    def least_loaded(self, session: str | None = None) -> int:
        """The routable node with the fewest requests in flight at this gateway. Ties
        spread: a session's tie goes to the node its name hashes to among the tied ones
        (an idle fleet sends a session's turns to one node, where its prefix is cached);
        a call without a session takes the tied nodes in turn."""
        return self._pick(self.nodes.routable() or tuple(range(len(self.config.upstreams))),
                          session)

    def _pick(self, nodes: Sequence[int], session: str | None) -> int:
        fewest = min(self._in_flight[n] for n in nodes)
        tied = sorted(n for n in nodes if self._in_flight[n] == fewest)
        if session is None:
            self._turn += 1
            return tied[self._turn % len(tied)]
        return tied[_stable_hash(session) % len(tied)]

    def instead_of(self, tried: Collection[int], session: str | None = None) -> int | None:
        """The least-loaded routable node not in ``tried`` (as :meth:`least_loaded`), for
        a request whose node's engine refused the connection; None when none is left."""
        nodes = [n for n in self.nodes.routable() if n not in tried]
        return self._pick(nodes, session) if nodes else None

    def upstream(self, node: int) -> str:
        """Node ``node``'s engine URL: the one it has, or had last when a listing took it
        out after the request was routed there."""
        url = self.nodes.last_url(node)
        if url is None:
            raise KeyError(f"node {node}: no engine URL known")
        return url

    async def token_ids(self, endpoint: Endpoint, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as the engine sees them (its chat template included)."""
        prompt = body.get("prompt")
        if endpoint == "completions" and isinstance(prompt, list) and all(
                isinstance(t, int) for t in prompt):
            return list(prompt)
        request: dict[str, Any] = {"model": body.get("model")}
        if endpoint == "chat/completions":
            request["messages"] = body.get("messages", [])
            request["add_generation_prompt"] = body.get("add_generation_prompt", True)
            for key in ("chat_template_kwargs", "tools"):
                if key in body:
                    request[key] = body[key]
        else:
            request["prompt"] = prompt
        async def send(n: int) -> Any:
            return await self._http.post(f"{self.upstream(n)}/tokenize", json=request)

        _, response = await self._connect(self.least_loaded(), None, send, in_flight=False)
        response.raise_for_status()
        return [int(t) for t in response.json()["tokens"]]

    def metrics_tenant(self) -> str:
        """The tenant the gateway's metrics name."""
        return self.config.tenant or DEFAULT_TENANT

    def returning(self, session: str) -> bool:
        """Whether the session had an earlier turn at this gateway (remembers this one)."""
        return self.metrics.returning(SessionKey(self.metrics_tenant(), session))

    async def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        """The scheduler's ``name`` awaited: its coroutine form (``<name>_async`` of a
        :class:`~kvprefetch.controlplane.live.client.Client`: the actor handle with
        batching in a Ray cluster, persistent async connections over HTTP), else the
        blocking call on a worker thread."""
        call = getattr(self._scheduler, f"{name}_async", None)
        if call is not None:
            return await call(*args, **kw)
        return await asyncio.to_thread(getattr(self._scheduler, name), *args, **kw)

    async def route(self, session: str, token_ids: Sequence[int]) -> Routed:
        """The scheduler's node, waited for at most ``route_deadline_s``. Past the
        deadline the request runs on the least-loaded node without prefetch and the call
        is cancelled: its answer is never applied here, and the route is never sent
        again (the scheduler applies it at most once; the request's finish names the
        node it ran on)."""
        if self._scheduler is None:
            return Routed(self.least_loaded(session), "load")
        started = time.perf_counter()
        ask = asyncio.ensure_future(self._call(
            "route", session, token_ids=list(token_ids), tenant=self.config.tenant,
            timeout_s=self.config.scheduler_timeout_s))
        done, _ = await asyncio.wait({ask}, timeout=self.config.route_deadline_s)
        answer: Any = None
        if not done:
            ask.cancel()
            self.metrics.route_deadline.inc()
            log.debug("route %s: no answer within %.3g s; routing by load", session,
                      self.config.route_deadline_s)
        elif ask.exception() is not None:  # any failure of the scheduler: serve anyway
            log.warning("route %s: scheduler failed (%s); routing by load", session,
                        ask.exception())
            self.metrics.scheduler_unavailable.inc()
        else:
            answer = ask.result()
        node = getattr(answer, "node", None)
        routed = (Routed(node, "scheduler")
                  if node is not None and self.nodes.url(node) is not None
                  else Routed(self.least_loaded(session), "load"))
        self.metrics.route_time(time.perf_counter() - started, node=routed.node,
                                tenant=self.metrics_tenant())
        if done and answer is not None and routed.by == "load":
            self.metrics.scheduler_unavailable.inc()  # answered without a node
        return routed

    async def finished(self, session: str, node: int, token_ids: Sequence[int],
                       output_tokens: int, stop_reason: str | None,
                       cached_tokens: int | None = None) -> None:
        """Token ids to the store first (an agent warming the session needs them), then
        the scheduler's ``request_finished`` (and a hint for tool calls). ``cached_tokens``
        is the engine's count of prompt tokens it did not compute (vLLM's
        ``prompt_tokens_details``), sent as ``local_tokens_read``: vLLM does not tell the
        scheduler when it reads the node's local tier, so this is how a prefetch that
        landed before the request counts as read."""
        tenant = self.config.tenant or "default"
        if self._tokens is not None:
            try:
                await asyncio.to_thread(self._tokens, tenant, session, list(token_ids))
            except Exception as exc:
                self.metrics.token_store_errors.inc()
                log.warning("storing %s's token ids failed: %s", session, exc)
        if self._scheduler is None:
            return
        # The engine's finish reason (OpenAI's names), as the scheduler's canonical name; one
        # the vocabulary does not know is sent as none.
        stop = stop_reason_or_none(stop_reason)
        try:
            await self._call(
                "request_finished", session, node=node, input_tokens=len(token_ids),
                output_tokens=output_tokens, stop_reason=stop, tenant=self.config.tenant,
                local_tokens_read=cached_tokens, timeout_s=self.config.scheduler_timeout_s)
            if stop == "tool_use":
                await self._call("hint", session, "tool_running", tenant=self.config.tenant,
                                 timeout_s=self.config.scheduler_timeout_s)
        except Exception as exc:
            self.metrics.scheduler_unavailable.inc()
            log.warning("request_finished %s: scheduler failed (%s)", session, exc)

    # -- forwarding -------------------------------------------------------------------

    async def prepare(self, endpoint: Endpoint, headers: dict[str, str],
                      body: dict[str, Any]) -> tuple[str, list[int], Routed]:
        ids = await self.token_ids(endpoint, body)
        session = self.session_id(headers, body, ids)
        routed = await self.route(session, ids)
        self.metrics.routed.labels(routed.by).inc()
        return session, ids, routed

    def _enter(self, node: int) -> None:
        self._in_flight[node] += 1
        self.metrics.in_flight.labels(str(node)).set(self._in_flight[node])

    def _leave(self, node: int) -> None:
        self._in_flight[node] -= 1
        self.metrics.in_flight.labels(str(node)).set(self._in_flight[node])

    def salted(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request for the engine: the caller's, with the tenant's ``cache_salt`` in
        place of any the caller gave (a caller must not pick another tenant's)."""
        if not self._salt:
            return body
        return {**body, "cache_salt": self._salt}

    async def _connect(self, node: int, session: str | None,
                       send: Callable[[int], Awaitable[Any]], *, in_flight: bool = True
                       ) -> tuple[int, Any]:
        """``send(node)``; ``in_flight``: counted in flight on the node it returns with
        (the caller leaves it). An engine that refuses the connection got nothing: the
        request goes to another routable node (:meth:`instead_of`; counted in
        ``kvprefetch_gateway_failovers_total``), until none is left (the error is raised).
        A node that leaves the fleet answers so until the next node listing."""
        import httpx

        tried: list[int] = []
        while True:
            if in_flight:
                self._enter(node)
            try:
                return node, await send(node)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if in_flight:
                    self._leave(node)
                tried.append(node)
                other = self.instead_of(tried, session)
                if other is None:
                    raise
                self.metrics.failovers.inc()
                log.warning("node %d: its engine refused the connection (%s); the request "
                            "goes to node %d", node, exc, other)
                node = other
            except BaseException:
                if in_flight:
                    self._leave(node)
                raise

    async def forward(self, endpoint: Endpoint, node: int, body: dict[str, Any],
                      session: str | None = None) -> tuple[int, int, dict[str, Any]]:
        """A non-streaming request: the node it ran on (another one when ``node``'s
        engine refused the connection, see :meth:`_connect`), the upstream's status and
        JSON body."""
        async def send(n: int) -> Any:
            return await self._http.post(f"{self.upstream(n)}/v1/{endpoint}",
                                         json=self.salted(body))

        node, response = await self._connect(node, session, send)
        self._leave(node)
        return node, response.status_code, response.json()

    async def open_stream(self, endpoint: Endpoint, node: int, body: dict[str, Any],
                          session: str | None = None) -> tuple[int, Any]:
        """A streaming request sent: the node it runs on (as :meth:`forward`) and the
        upstream's response, its body not read yet (:meth:`stream` reads and closes it).
        Usage is asked of the upstream, to count output tokens."""
        upstream_body = {**self.salted(body),
                         "stream_options": {**(body.get("stream_options") or {}),
                                            "include_usage": True}}

        async def send(n: int) -> Any:
            request = self._http.build_request("POST", f"{self.upstream(n)}/v1/{endpoint}",
                                               json=upstream_body)
            return await self._http.send(request, stream=True)

        node, response = await self._connect(node, session, send)
        self._open_streams.add(response)
        return node, response

    async def release(self, node: int, response: Any) -> None:
        """Close a response :meth:`open_stream` opened on ``node`` and count its request
        out of flight, once (later calls do nothing): after its last event, or when the
        caller went before the first."""
        if response not in self._open_streams:
            return
        self._open_streams.discard(response)
        self._leave(node)
        await response.aclose()

    async def stream(self, node: int, response: Any, body: dict[str, Any],
                     outcome: dict[str, Any]) -> AsyncIterator[bytes]:
        """The server-sent events of a response :meth:`open_stream` opened on ``node``,
        forwarded as they come; the upstream's usage-only event is dropped unless the
        caller asked for it (``body``'s ``stream_options``); ``outcome`` gets status, finish
        reason and token count."""
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        try:
            outcome["status"] = response.status_code
            if response.status_code != 200:
                yield await response.aread()
                return
            async for line in response.aiter_lines():
                if not line:
                    continue
                forward = _observe_event(line, outcome)
                if forward or wants_usage:
                    yield (line + "\n\n").encode()
        finally:
            await self.release(node, response)


def _stable_hash(text: str) -> int:
    """A hash of ``text`` that every process and run agrees on (``hash`` is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def engine_body(body: dict[str, Any], key: SessionKey) -> dict[str, Any]:
    """The request as the engine gets it: vLLM's ``session_id`` is the session's wire
    name, and ``kv_cache_report_mode: full`` makes its KV events name the session for the
    prefix it reuses too, so that the node's agent maps HBM blocks to sessions
    (:mod:`kvprefetch.agents.vllm.hbm_residency`). A caller's own values are replaced."""
    xargs = body.get("vllm_xargs")
    return {**body, "session_id": key.wire,
            "vllm_xargs": {**(xargs if isinstance(xargs, dict) else {}),
                           "kv_cache_report_mode": "full"}}


def cached_tokens(usage: dict[str, Any]) -> int | None:
    """The prompt tokens an OpenAI-style ``usage`` says were cached (vLLM fills it with
    ``--enable-prompt-tokens-details``); None when it does not say."""
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if isinstance(value, int) and value >= 0 else None


def _observe_event(line: str, outcome: dict[str, Any]) -> bool:
    """Note a stream event's finish reason and usage; False for a usage-only event."""
    if not line.startswith("data:"):
        return True
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    with contextlib.suppress(ValueError):
        event = json.loads(data)
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                outcome["finish_reason"] = choice["finish_reason"]
        usage = event.get("usage")
        if usage:
            outcome["output_tokens"] = int(usage.get("completion_tokens", 0))
            outcome["cached_tokens"] = cached_tokens(usage)
            return bool(event.get("choices"))
    return True


def build_app(gateway: Gateway) -> Any:
    """The FastAPI app: ``/v1/completions``, ``/v1/chat/completions`` (streaming or
    not), ``/v1/models``, ``/health`` and ``/metrics``."""
    from fastapi import FastAPI, Response
    from fastapi.responses import JSONResponse, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.background import BackgroundTask

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(title="kvprefetch gateway", lifespan=lifespan)

    async def handle(endpoint: Endpoint, request: Request) -> Response:
        import httpx

        arrival = time.perf_counter()
        body = await request.json()
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            session, ids, routed = await gateway.prepare(endpoint, headers, body)
        except httpx.HTTPStatusError as exc:
            gateway.metrics.requests.labels(endpoint, "tokenize_error").inc()
            return Response(exc.response.content, status_code=exc.response.status_code,
                            media_type="application/json")
        except httpx.HTTPError as exc:
            gateway.metrics.requests.labels(endpoint, "upstream_unreachable").inc()
            return JSONResponse({"error": {"message": f"no engine answered: {exc}"}}, 502)
        returning = gateway.returning(session)
        body = engine_body(body, SessionKey(gateway.metrics_tenant(), session))

        def first_token(node: int) -> None:
            gateway.metrics.ttft(time.perf_counter() - arrival, node=node,
                                 tenant=gateway.metrics_tenant(), returning=returning)

        try:
            if body.get("stream"):
                node, upstream = await gateway.open_stream(endpoint, routed.node, body,
                                                           session)
            else:
                node, status, answer = await gateway.forward(endpoint, routed.node, body,
                                                             session)
        except httpx.HTTPError as exc:
            gateway.metrics.requests.labels(endpoint, "upstream_unreachable").inc()
            return JSONResponse({"error": {"message": f"node {routed.node}: {exc}"}}, 502)
        if body.get("stream"):
            outcome: dict[str, Any] = {}

            async def events() -> AsyncIterator[bytes]:
                first = True
                try:
                    async for chunk in gateway.stream(node, upstream, body, outcome):
                        if first and outcome.get("status") == 200:
                            first_token(node)
                        first = False
                        yield chunk
                finally:
                    ok = outcome.get("status") == 200
                    gateway.metrics.requests.labels(
                        endpoint, "ok" if ok else "upstream_error").inc()
                    if ok:
                        await gateway.finished(session, node, ids,
                                               outcome.get("output_tokens", 0),
                                               outcome.get("finish_reason"),
                                               outcome.get("cached_tokens"))

            # the upstream is released after the last event, or here when the caller went
            # before the first one was read
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"X-Session-ID": session,
                                              "X-KVP-Node": str(node)},
                                     background=BackgroundTask(gateway.release, node,
                                                               upstream))
        gateway.metrics.requests.labels(
            endpoint, "ok" if status == 200 else "upstream_error").inc()
        if status == 200:
            first_token(node)  # not streamed: the caller's first token comes with the answer
            choices = answer.get("choices") or [{}]
            usage = answer.get("usage") or {}
            await gateway.finished(session, node, ids,
                                   int(usage.get("completion_tokens", 0)),
                                   choices[0].get("finish_reason"), cached_tokens(usage))
        return JSONResponse(answer, status, headers={"X-Session-ID": session,
                                                     "X-KVP-Node": str(node)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle("chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        response = await gateway._http.get(f"{gateway.nodes.any_url()}/v1/models")
        return Response(response.content, response.status_code,
                        media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.registry), media_type=CONTENT_TYPE_LATEST)

    return app


@contextlib.contextmanager
def serve_in_thread(gateway: Gateway, host: str = "127.0.0.1", port: int = 0,
                    start_timeout_s: float = 30.0) -> Iterator[str]:
    """Serve the gateway with uvicorn on a thread of this process (``port`` 0: a free
    one); yields its base URL and stops it on exit. For demos and tests; a deployment runs
    :func:`main` or hosts :func:`build_app` itself."""
    import threading
    import time

    import uvicorn

    if port == 0:
        from kvprefetch.agents.embedded import free_port

        port = free_port(host)
    server = uvicorn.Server(uvicorn.Config(build_app(gateway), host=host, port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name="kvp-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start listening on {host}:{port}")
            time.sleep(0.05)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def store_sink(store: Any) -> TokenSink:
    """A :class:`TokenSink` over an object store (``kvprefetch.agents.backends.tokens``' format)."""
    from kvprefetch.agents.backends.tokens import put_session_tokens

    def put(tenant: str, session_id: str, token_ids: Sequence[int]) -> None:
        put_session_tokens(store, tenant, session_id, token_ids)

    return put




def read_token_file(path: str | os.PathLike[str]) -> str:
    """A secret from a file only its owner may read (mode 0600 or 0400), without the
    trailing newline. Raises :class:`~kvprefetch.controlplane.base.errors.ConfigError` (one
    line, never the secret) for a file others may read, a missing or an empty one."""
    import stat

    from kvprefetch.controlplane.base.errors import ConfigError

    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"token file {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise ConfigError(f"token file {path}: mode {mode:04o} lets group or others read it; "
                          f"chmod 600 {path}")
    token = text.rstrip("\r\n")
    if not token.strip():
        raise ConfigError(f"token file {path}: empty")
    return token


def scheduler_token(token_file: str | None) -> str | None:
    """The scheduler's API token: ``token_file`` (see :func:`read_token_file`) or the
    :data:`TOKEN_ENV` environment variable; None when neither is given. Never from argv:
    a command line is visible to every user of the machine (``ps``)."""
    if token_file:
        return read_token_file(token_file)
    return os.environ.get(TOKEN_ENV) or None


def run(args: argparse.Namespace) -> int:
    """Serve the gateway in the foreground (uvicorn) until interrupted."""
    import uvicorn

    token = scheduler_token(args.token_file)
    scheduler = None
    if args.scheduler:
        from kvprefetch.controlplane.live.batching import EventBatching
        from kvprefetch.controlplane.live.connect import connect

        # In a Ray cluster the actor handle, events batched; over HTTP, persistent
        # connections (batching applies to Ray only).
        scheduler = connect(args.scheduler, tenant=args.tenant, token=token,
                            batching=EventBatching())
    tokens = None
    if args.config:
        store = token_store(stores_of_serve_config(args.config))
        store.start()
        tokens = store_sink(store)
    salt = os.environ.get(args.cache_salt_env, "") if args.cache_salt_env else ""
    gateway = Gateway(GatewayConfig(upstreams=args.upstream, tenant=args.tenant,
                                    cache_salt=salt, nodes_refresh_s=args.nodes_refresh_s,
                                    route_deadline_s=args.route_deadline_s),
                      scheduler=scheduler, tokens=tokens)
    uvicorn.run(build_app(gateway), host=args.host, port=args.port)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvprefetch's OpenAI-compatible gateway",
                                     allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args(argv)
    import sys

    from kvprefetch.controlplane.base.errors import ConfigError

    try:
        return run(args)
    except ConfigError as exc:
        print(f"kvprefetch gateway: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
