"""The HTTP API: the gateway operations of :mod:`kvprefetch.controlplane.live.client` for gateways
not written in Python, as JSON ``POST /v1/<op>`` endpoints on the models of
:mod:`kvprefetch.controlplane.base.api` (the OpenAPI document at ``/openapi.json`` is generated from
them, with this server's limits).

=====================  =========================  ==================================
endpoint               body                       answer
=====================  =========================  ==================================
POST /v1/route             :class:`~api.RouteQuery`       :class:`~api.RouteAnswer`
POST /v1/cancel_route      :class:`~api.RouteCancel`      :class:`~api.RouteCancelled`
POST /v1/request_started   :class:`~api.RequestStarted`   :class:`~api.Ack`
POST /v1/request_finished  :class:`~api.RequestFinished`  :class:`~api.Ack`
POST /v1/hint              :class:`~api.HintCall`         :class:`~api.Ack`
POST /v1/session_closed    :class:`~api.SessionClosed`    :class:`~api.Ack`
POST /v1/session_state     ``SessionQuery``               ``SessionState``
POST /v1/events            ``{"events": [...]}``          :class:`EventsAnswer`
GET  /metrics              Prometheus text exposition format
GET  /healthz              ``{"status": "ok"}`` (503 when the scheduler is unreachable)
=====================  =========================  ==================================

``/v1/events`` carries up to ``max_batch_events`` fire-and-forget events in a body of at
most ``large_body_bytes``, each ``{"op": <request_started | request_finished | hint |
session_closed>, ...that endpoint's body}``, applied in order: a batch with an invalid
item is refused whole (422, each error's ``loc`` naming the item, ``events.3.node``), as is
one naming a tenant the token may not act for (403); otherwise each item is answered in
``acks`` as its own call would be, or with the typed error it met.

The operations are answered by a plain ASGI layer inside the edge guard
(:class:`_Operations`): no router, dependency or response-model pass of FastAPI per call,
the answer serialized once by pydantic; FastAPI serves the rest (``/metrics``,
``/healthz``, ``/nodes``, the OpenAPI document, 404 and 405).

Who calls (:mod:`kvprefetch.controlplane.live.tenants`): with tenant tokens configured, the bearer
token says whose call it is; ``tenant`` may be left out of the body, and a body naming
another tenant is refused (403). Sessions are keyed by (tenant, session id): another
tenant's session answers exactly like one that does not exist (404). The admin token and
the shared token act for the tenant the body names (default ``"default"``); where bodies
name their tenants, at most ``max_named_tenants`` distinct ones are admitted (403 beyond).
``/healthz`` and the OpenAPI document stay open for probes. ``/metrics`` needs the metrics
or the admin token when a metrics token is configured (its readers see tenant names);
otherwise it is open to scrapers and every ``tenant`` label is a pseudonym
(:func:`~kvprefetch.controlplane.live.metrics.pseudonymize_tenants`), unless
``metrics_tenant_names`` is set.

Limits (:class:`~kvprefetch.controlplane.live.limits.RequestLimits`): the token is checked
from the headers before any of the body is read, and the body is read within a size cap,
a deadline and a minimum rate, with a few large bodies per caller at once
(:mod:`~kvprefetch.controlplane.live.http_edge`); it is validated in bounded time and memory
(:mod:`~kvprefetch.controlplane.live.http_body`): lists over ``max_token_ids`` /
``max_chunk_hashes``, token ids outside 0..``max_token_id`` and session ids that break the
rules are refused with 422 naming the field, listing at most ``max_listed_errors`` errors.
With ``chunk_tokens`` given, token ids are hashed here, off the event loop, and the
scheduler receives the chunk hashes. :class:`HttpServer` admits, times and closes
connections (:mod:`~kvprefetch.controlplane.live.http_conn`): 503 past ``max_connections``
busy or proven ones.

Errors are JSON ``{"error": <type name>, "detail": <message>}`` with the status of the
typed error (:attr:`~kvprefetch.controlplane.base.errors.ServiceError.http_status`): 401 no or wrong
bearer token, 403 a tenant not allowed or not the token's, 404 unknown session, 408 body too
slow, 409 a route's ``request_id`` already names another route (another session or body,
or a cancelled one), 413 body too large, 422 a body that fails validation (``errors`` then
lists the first fields as ``loc``/``msg``/``type``), 429 the tenant holds its quota of live
sessions, or the caller its large bodies in progress or its budget of refused large bodies
(``Retry-After`` says when to send again), 503 scheduler unavailable or too many
connections. A call the scheduler does not answer within ``call_timeout_s`` answers 200
like the Python client does: a route with ``node: null, timed_out: true`` (run the request
without prefetch; with its ``request_id``, send it again or cancel it), an event with
``accepted: false``.

The app fronts any :class:`~kvprefetch.controlplane.live.protocol.GatewayAPI`: a
:class:`~kvprefetch.controlplane.live.service.SchedulerService` in this process (called through an
:class:`~kvprefetch.controlplane.live.client.InProcessTransport`, so ``call_timeout_s`` holds there
too), or a transport to the scheduler (the Ray actor's, in ``kvprefetch serve``), called
with ``call_timeout_s``. Endpoints validate on the event loop (in slices, see
:mod:`~kvprefetch.controlplane.live.http_body`) and await the scheduler's answer there
when the transport has coroutine calls (``acall``: a Ray transport awaits the actor's
answer, no thread per call; with event batching, as :func:`ray_client` sets up, the
fire-and-forget events answer ``accepted`` once queued and go in batches, ahead of the
next route, a refusal counted in the batcher's stats and logged, as with the Python client;
a finish without ``node`` answers ``accepted: false`` and is not queued); any other
scheduler is called on Starlette's thread pool, as its calls may block.

Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client).
"""

from __future__ import annotations

import inspect
import logging
import math
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, Union

from fastapi import Depends, FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, Field, TypeAdapter, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvprefetch.controlplane import __version__
from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import (
    ConfigError,
    KvPrefetchError,
    ServiceError,
    ServiceUnavailableError,
)
from kvprefetch.controlplane.base.names import (
    SESSION_ID_MAX_CHARS,
    SESSION_ID_PATTERN,
    TENANT_MAX_CHARS,
    TENANT_PATTERN,
)
from kvprefetch.controlplane.live.batching import EventBatching
from kvprefetch.controlplane.live.client import Client, InProcessTransport
from kvprefetch.controlplane.live.http_body import BatchValidator, BigList, BodyValidator, Invalid
from kvprefetch.controlplane.live.http_conn import (
    ConnectionGate,
    ConnectionTracker,
    guarded_protocol,
)
from kvprefetch.controlplane.live.http_edge import PRINCIPAL_STATE, EdgeGuard
from kvprefetch.controlplane.live.limits import RequestLimits, prehash
from kvprefetch.controlplane.live.metrics import pseudonymize_tenants, tenant_pseudonyms
from kvprefetch.controlplane.live.node_registry import NodeListing, NodeRegistryAPI
from kvprefetch.controlplane.live.protocol import GatewayAPI, RemoteAPI
from kvprefetch.controlplane.live.sessions import SessionQuery, SessionState
from kvprefetch.controlplane.live.tenants import Principal, TenantAuth

log = logging.getLogger(__name__)

#: Seconds the app waits for the scheduler per call (the Python client's default).
DEFAULT_CALL_TIMEOUT_S = 2.0
#: Operation (the path ``/v1/<op>``, the GatewayAPI method) -> the model of its body.
OPERATIONS: dict[str, type[BaseModel]] = {
    "route": api.RouteQuery,
    "cancel_route": api.RouteCancel,
    "request_started": api.RequestStarted,
    "request_finished": api.RequestFinished,
    "hint": api.HintCall,
    "session_closed": api.SessionClosed,
    "session_state": SessionQuery,
}
#: Operation -> the model of its answer.
ANSWERS: dict[str, type[BaseModel]] = {
    "route": api.RouteAnswer, "cancel_route": api.RouteCancelled, "request_started": api.Ack,
    "request_finished": api.Ack, "hint": api.Ack, "session_closed": api.Ack,
    "session_state": SessionState,
}
#: The batched events endpoint: ``POST /v1/events`` carries items of these operations.
EVENT_OPS: tuple[str, ...] = ("request_started", "request_finished", "hint", "session_closed")
EVENTS_OP = "events"
#: The ``op`` label values of the API's own metrics.
LABELLED_OPS = frozenset({*OPERATIONS, EVENTS_OP})
HTTP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

#: Where ``/metrics`` reads the scheduler's measurements: a registry, an object holding one
#: (:class:`~kvprefetch.controlplane.live.metrics.PrometheusMetrics`), or a function returning
#: exposition text (the Ray scheduler actor's ``metrics_text``).
MetricsSource = CollectorRegistry | Callable[[], bytes] | Any


class FieldError(BaseModel):
    loc: str
    msg: str
    type: str


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer of the API."""

    error: str
    detail: str
    errors: list[FieldError] | None = None


class EventAck(BaseModel):
    """One item's answer in a batch of events: as the event's own call answers
    (``accepted``, ``timed_out``), or the typed error it met (``error`` names its type,
    ``detail`` says why; the items after it are still applied)."""

    accepted: bool = True
    timed_out: bool = False
    error: str | None = None
    detail: str | None = None


class EventsAnswer(BaseModel):
    """The answer to ``POST /v1/events``: ``acks``, one per item in order; ``accepted``
    and ``not_accepted`` count them."""

    accepted: int
    not_accepted: int
    acks: list[EventAck]


_EVENT_ACCEPTED = EventAck()


class Health(BaseModel):
    status: str
    detail: str | None = None


#: Module level: FastAPI resolves the (postponed) annotations of endpoints in this namespace.
_BEARER = HTTPBearer(auto_error=False,
                     description="a tenant's token (its calls are that tenant's), the admin "
                                 "token, or the shared token of `http.bearer_token`; "
                                 "`/metrics`: the metrics or the admin token where "
                                 "`http.metrics_token` is set")
_Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    408: {"model": ErrorBody, "description": "the body did not arrive within "
                                             "`body_read_timeout_s` or at "
                                             "`min_body_rate_bytes_per_s`"},
    403: {"model": ErrorBody, "description": "the tenant is not allowed, or the body names "
                                             "a tenant other than the token's"},
    404: {"model": ErrorBody, "description": "the caller's tenant has no live session by "
                                             "this id (whether or not another tenant has "
                                             "one)"},
    409: {"model": ErrorBody, "description": "the route's `request_id` names another route "
                                             "of the tenant (another session or body, or "
                                             "a cancelled one); nothing was applied"},
    413: {"model": ErrorBody, "description": "the request body is larger than "
                                             "`max_body_bytes`"},
    422: {"model": ErrorBody, "description": "the body fails validation or a limit; "
                                             "`errors` names the first fields "
                                             "(`max_listed_errors`)"},
    429: {"model": ErrorBody, "description": "the tenant holds its quota of live sessions "
                                             "(`max_live_sessions`), or the caller "
                                             "`max_large_bodies_per_caller` large bodies "
                                             "in progress, or its refused large bodies "
                                             "spent `refused_body_burst_bytes`, or the "
                                             "caller's calls exceed its rate "
                                             "(`rate_limit_calls_per_s`); answered unread, "
                                             "with `Retry-After`; other tenants are not "
                                             "affected"},
    503: {"model": ErrorBody, "description": "the scheduler is unavailable, or the server "
                                             "holds `max_connections`"},
}
#: A list stops at its first bad item: a 422 costs one error per list, however long.
_FAIL_FAST = Field(fail_fast=True)
_HASH = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]
_TENANT_DOC = ("the tenant this call is for. With a tenant's token leave it out (the token "
               "says whose call it is; another tenant's name is refused with 403); with the "
               "admin or the shared token it names the tenant (default `default`)")
_SESSION_DOC = (f"the gateway's id of the session, unique within its tenant: 1-"
                f"{SESSION_ID_MAX_CHARS} characters of A-Z a-z 0-9 . _ : @ + = - and '/' "
                "between parts (sub-agents: `parent/agent_002`); no part empty, `.` or `..`")


def _edge_models(limits: RequestLimits) -> dict[str, type[BaseModel]]:
    """The operations' bodies as this server takes them: the models of
    :mod:`kvprefetch.controlplane.base.api` with the server's limits and name rules, and ``tenant``
    optional (so the OpenAPI document states the limits a call must keep)."""
    tenant = Annotated[str | None, Field(None, min_length=1, max_length=TENANT_MAX_CHARS,
                                         pattern=TENANT_PATTERN, description=_TENANT_DOC)]
    session = Annotated[str, Field(min_length=1, max_length=SESSION_ID_MAX_CHARS,
                                   pattern=SESSION_ID_PATTERN, description=_SESSION_DOC)]
    parent = Annotated[str | None, Field(None, min_length=1, max_length=SESSION_ID_MAX_CHARS,
                                         pattern=SESSION_ID_PATTERN)]
    token_id = Annotated[int, Field(ge=0, le=limits.max_token_id)]
    token_ids: Any = (Annotated[list[token_id], _FAIL_FAST, api.JSON_INTS] | None,
                      Field(None, max_length=limits.max_token_ids,
                            description=f"the prompt's token ids (at most "
                                        f"{limits.max_token_ids}, each 0.."
                                        f"{limits.max_token_id}): chunks keyed by content"))
    hashes: Any = (Annotated[list[_HASH], _FAIL_FAST] | None,
                   Field(None, max_length=limits.max_chunk_hashes,
                         description=f"precomputed chunk hashes (at most "
                                     f"{limits.max_chunk_hashes})"))
    common: dict[str, Any] = {"tenant": (tenant, None), "session_id": (session, ...)}
    sized: dict[str, Any] = {**common, "token_ids": token_ids, "chunk_hashes": hashes,
                             "parent_id": (parent, None)}
    fields = {"route": sized, "request_started": sized,
              "request_finished": {**common, "chunk_hashes": hashes}}
    out: dict[str, type[BaseModel]] = {}
    for op, base in OPERATIONS.items():
        extra = fields.get(op, common)
        model: type[BaseModel] = create_model(
            base.__name__, __base__=base, __doc__=base.__doc__, **extra)
        out[op] = model
    return out


def _as_call(op: str, body: BaseModel, tenant: str) -> Any:
    """The body as the scheduler's record for ``op``, for ``tenant`` (already validated,
    under the same or stricter rules: not validated twice)."""
    values = {name: getattr(body, name) for name in type(body).model_fields}
    values["tenant"] = tenant
    return OPERATIONS[op].model_construct(_fields_set=set(body.model_fields_set) | {"tenant"},
                                          **values)


def ray_client(address: str, namespace: str, *, timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
               batching: EventBatching | None = None) -> Client:
    """The client the HTTP API fronts a Ray scheduler with (``kvprefetch serve``'s): the
    fire-and-forget events batched as the Python client batches them (``batching``,
    default :class:`EventBatching`'s defaults), each call bounded by ``timeout_s``."""
    from kvprefetch.controlplane.live.connect import connect

    return connect(address, namespace=namespace, timeout_s=timeout_s,
                   batching=batching or EventBatching())


def _gateway(target: GatewayAPI | Client, call_timeout_s: float) -> RemoteAPI:
    """The API the endpoints call, bounded by ``call_timeout_s``: a transport (the one a
    client holds), or one over a scheduler in this process."""
    scheduler = target.scheduler if isinstance(target, Client) else target
    if not isinstance(scheduler, GatewayAPI):  # untyped callers: fail at start-up
        raise ConfigError(f"create_app: cannot serve {type(target).__name__}: give a "
                          "GatewayAPI (a SchedulerService or a transport to one)")
    if isinstance(scheduler, RemoteAPI):
        return scheduler.with_timeout(call_timeout_s)
    return InProcessTransport(scheduler, timeout_s=call_timeout_s)


def _metrics_reader(source: MetricsSource | None) -> Callable[[], bytes]:
    if source is None:
        return lambda: b""
    if isinstance(source, CollectorRegistry):
        return lambda: bytes(generate_latest(source))
    registry = getattr(source, "registry", None)
    if isinstance(registry, CollectorRegistry):
        return lambda: bytes(generate_latest(registry))
    if callable(source):
        return lambda: bytes(source())
    raise ConfigError(f"metrics_registry: expected a CollectorRegistry, an object with "
                      f".registry or a function returning bytes, got {type(source).__name__}")


def _error(exc: Exception, status: int, name: str | None = None) -> JSONResponse:
    body = ErrorBody(error=name or type(exc).__name__, detail=str(exc))
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status,
                        headers=headers)


def _field_errors(exc: RequestValidationError) -> list[FieldError]:
    out = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ())]
        if loc and loc[0] == "body":  # every operation takes its whole body as one model
            loc = loc[1:]
        out.append(FieldError(loc=".".join(loc) or "(root)", msg=str(err.get("msg", "")),
                              type=str(err.get("type", ""))))
    return out


class _HttpMetrics:
    """Calls and latency per operation, on the app's own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvprefetch_http_requests", "HTTP API calls",
                                ["op", "status"], registry=self.registry)
        self.latency = Histogram("kvprefetch_http_request_seconds",
                                 "HTTP API call latency (server side)", ["op"],
                                 buckets=HTTP_BUCKETS_S, registry=self.registry)

        #: The labelled children already looked up: a call costs two dict reads, not
        #: prometheus_client's label resolution under its lock.
        self._counts: dict[tuple[str, int], Any] = {}
        self._latencies: dict[str, Any] = {}

    def observe(self, path: str, status: int, seconds: float) -> None:
        op = path[4:] if path.startswith("/v1/") else None
        if op not in LABELLED_OPS:
            return  # only the operations: unknown paths must not grow the label set
        count = self._counts.get((op, status))
        if count is None:
            count = self._counts[(op, status)] = self.requests.labels(op, str(status))
        latency = self._latencies.get(op)
        if latency is None:
            latency = self._latencies[op] = self.latency.labels(op)
        count.inc()
        latency.observe(seconds)


class _Measured:
    """ASGI middleware: each call's status and latency (to its answer's start) into the
    API's metrics; plain ASGI, so a call costs no task or stream of its own."""

    def __init__(self, app: Any, metrics: _HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                self.metrics.observe(scope["path"], status[0], time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, sending)


def create_app(scheduler: GatewayAPI | Client, *, bearer_token: str | None = None,
               auth: TenantAuth | None = None, limits: RequestLimits | None = None,
               chunk_tokens: int | None = None,
               metrics_registry: MetricsSource | None = None,
               call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
               health_check: Callable[[], None] | None = None,
               metrics_tenant_names: bool = False) -> FastAPI:
    """The FastAPI app in front of ``scheduler`` (see the module docstring; a
    :class:`~kvprefetch.controlplane.live.client.Client` stands for the API it holds).

    ``auth``: who may call and for which tenant (tenant tokens, admin token);
    ``bearer_token``: instead of ``auth``, the one shared token of older configs (every
    ``/v1`` call must carry ``Authorization: Bearer <token>``, the body names the
    tenant). Neither: no auth. ``limits``: per-call limits (default
    :class:`RequestLimits`). ``chunk_tokens``: the scheduler's chunk size, to hash token ids
    here instead of in the scheduler. ``health_check`` raises when the scheduler is
    unreachable (``/healthz`` then answers 503). ``metrics_tenant_names``: an open
    ``/metrics`` (no metrics token in ``auth``) names tenants as they are instead of by
    pseudonym. Raises :class:`ConfigError` on a bad argument."""
    if auth is not None and bearer_token is not None:
        raise ConfigError("create_app: give auth or bearer_token, not both")
    if auth is None:
        auth = TenantAuth(shared_token=bearer_token)
    if call_timeout_s <= 0:
        raise ConfigError("http call_timeout_s: must be > 0")
    if chunk_tokens is not None and chunk_tokens <= 0:
        raise ConfigError("create_app: chunk_tokens must be > 0")
    limits = limits or RequestLimits()
    backend = _gateway(scheduler, call_timeout_s)
    read_metrics = _metrics_reader(metrics_registry)
    #: None: tenant labels as they are (the readers are authenticated, or opted in).
    pseudonym = (None if auth.metrics_guarded or metrics_tenant_names
                 else tenant_pseudonyms(auth.pseudonym_key()))
    http_metrics = _HttpMetrics()
    models = _edge_models(limits)
    app = FastAPI(
        title="kvprefetch",
        version=__version__,
        description="Session events and hints for the kvprefetch scheduler: it predicts "
                    "when each session returns and warms the KV cache of the node that "
                    "will serve it. Sessions are keyed by (tenant, session id); the "
                    "bearer token says which tenant calls.",
    )

    def authenticate(creds: _Credentials) -> Principal:
        return auth.authenticate(creds.credentials if creds is not None else None)

    responses = dict(_ERROR_RESPONSES)
    if auth.required:
        responses[401] = {"model": ErrorBody, "description": "no or wrong bearer token"}

    acall = getattr(backend, "acall", None)
    #: Events are queued and answered `accepted` at once (a batching Ray transport).
    queued = acall is not None and getattr(backend, "batcher", None) is not None

    async def call(op: str, payload: Any) -> Any:
        """The scheduler's answer to ``op``, awaited on the event loop where the transport
        has coroutine calls (a Ray transport: the actor's answer is awaited, its events
        queued and batched), else the blocking call on Starlette's thread pool."""
        if acall is not None:
            return await acall(op, payload)
        return await run_in_threadpool(getattr(backend, op), payload)

    async def hashed(payload: Any) -> Any:
        """Token ids as chunk hashes, computed off the event loop (a long prompt's hashes
        would hold every other call up)."""
        if chunk_tokens is None or getattr(payload, "token_ids", None) is None:
            return payload
        return await run_in_threadpool(prehash, payload, chunk_tokens)

    async def event(op: str, payload: Any) -> api.Ack:
        try:
            answer: api.Ack = await call(op, payload)
            return answer
        except TimeoutError:
            log.warning("%s: the scheduler did not answer in %.3g s", op, call_timeout_s)
            return api.Ack(accepted=False, timed_out=True)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ServiceError)
    def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return _error(exc, exc.http_status)

    @app.exception_handler(KvPrefetchError)
    def _kvprefetch_error(request: Request, exc: KvPrefetchError) -> JSONResponse:
        log.warning("%s %s: %s", request.method, request.url.path, exc)
        return _error(exc, 500)

    @app.exception_handler(StarletteHTTPException)
    def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI answers 400 to a body it cannot decode at all (not UTF-8): for the
        # operations that is an invalid body like any other (422).
        if exc.status_code == 400 and request.url.path.removeprefix("/v1/") in OPERATIONS:
            body = ErrorBody(error="InvalidRequestError",
                             detail=f"invalid body: {exc.detail} (expected a JSON object "
                                    "in UTF-8)", errors=[])
            return JSONResponse(body.model_dump(), status_code=422)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        op = request.url.path.removeprefix("/v1/")
        model = OPERATIONS.get(op)
        fields = _field_errors(exc)
        what = model.__name__ if model is not None else "request"
        detail = f"invalid {what}: " + "; ".join(f"{f.loc}: {f.msg}" for f in fields)
        name = "MalformedHintError" if op == "hint" else "InvalidRequestError"
        body = ErrorBody(error=name, detail=detail, errors=fields)
        return JSONResponse(body.model_dump(), status_code=422)

    #: Path -> the operation's runner, answered by the _Operations layer (filled below).
    runners: dict[str, _Runner] = {}
    # Innermost: the edge guard has read the body and authenticated the caller.
    app.add_middleware(_Operations, runners=runners)
    # Inside the metrics middleware below, so that its refusals are counted too.
    app.add_middleware(EdgeGuard, auth=auth, limits=limits,
                       operations=[f"/v1/{op}" for op in OPERATIONS],
                       batches=[f"/v1/{EVENTS_OP}"])
    app.state.limits = limits  # HttpServer reads max_connections here

    app.add_middleware(_Measured, metrics=http_metrics)

    # ------------------------------------------------------------------ operations
    async def route(payload: Any) -> api.RouteAnswer:
        """Where to run this request (records `request_started` too unless it was sent for
        this request). `node: null` means: no advice, run it anywhere without prefetch.
        With `request_id` the call is idempotent: the same call again (a retry after a
        timeout or a 503) answers the first answer and applies nothing twice, also after
        the scheduler restarted; the id with another session or body is refused (409)."""
        payload = await hashed(payload)
        try:
            answer: api.RouteAnswer = await call("route", payload)
            return answer
        except TimeoutError:
            log.warning("route: the scheduler did not answer in %.3g s", call_timeout_s)
            return api.RouteAnswer.no_prefetch(timed_out=True,
                                               request_id=payload.request_id)

    async def cancel_route(payload: Any) -> api.RouteCancelled:
        """Undo the route `request_id` of this session, whose request will not run (its
        answer never came, or the caller gave up). While that request is in flight it
        ends: the session's first request closes the session (its tenant's live-session
        quota is released); a later one finishes as `aborted` with no output, the context
        unchanged. Idempotent. `outcome`: `cancelled` (undone, now or by an earlier
        cancel), `unknown` (no route by that id is remembered: nothing to undo) or
        `finished` (the request already ended: nothing undone). 503 when the scheduler
        does not answer in time (send it again)."""
        try:
            answer: api.RouteCancelled = await call("cancel_route", payload)
            return answer
        except TimeoutError:
            raise ServiceUnavailableError(
                f"cancel_route: the scheduler did not answer in {call_timeout_s:.3g} s"
            ) from None

    async def request_started(payload: Any) -> api.Ack:
        """A request of the session arrived at the gateway."""
        return await event("request_started", await hashed(payload))

    async def request_finished(payload: Any) -> api.Ack:
        """The response ended on `node`; the session's context grew. Without `node` (or
        `node: null`, when the route gave no advice) the finish is on no known node: it is
        answered `accepted: false` and not recorded (no node's books take a context no
        node is known to hold); the request stays in flight until the session's next
        finish on a node."""
        if queued and payload.node is None:
            # The scheduler records nothing for it: a queue that answers `accepted` at
            # once must not say otherwise.
            return api.Ack(accepted=False)
        return await event("request_finished", payload)

    async def hint(payload: Any) -> api.Ack:
        """A typed hint: `user_typing` (optional `eta_s`), `tool_running` (`eta_s` = the
        expected duration) or `session_closed` (closes the session, as
        `/v1/session_closed` does)."""
        return await event("hint", payload)

    async def session_closed(payload: Any) -> api.Ack:
        """The session will not return: its prefetches stop and its state is freed."""
        return await event("session_closed", payload)

    async def session_state(payload: Any) -> SessionState:
        """What the scheduler holds for one live session of the caller's tenant (404 when
        the tenant has none by this id). Read-only."""
        try:
            state: SessionState = await call("session_state", payload)
            return state
        except TimeoutError:
            raise ServiceUnavailableError(
                f"session_state: the scheduler did not answer in {call_timeout_s:.3g} s"
            ) from None

    handlers: dict[str, Callable[[Any], Awaitable[Any]]] = {
        "route": route, "cancel_route": cancel_route, "request_started": request_started,
        "request_finished": request_finished, "hint": hint,
        "session_closed": session_closed, "session_state": session_state,
    }

    async def events(items: list[tuple[str, Any]]) -> EventsAnswer:
        """Several fire-and-forget events in one call, applied in order: each item is
        `{"op": <operation>, ...}` with the body of `/v1/request_started`,
        `/v1/request_finished`, `/v1/hint` or `/v1/session_closed`, at most
        `max_batch_events` items in a body of at most `large_body_bytes`. A batch with
        any invalid item is refused whole (422; `errors` name the item, as
        `events.3.node`), as is one naming a tenant the token may not act for (403);
        otherwise each item is answered in `acks`, in order, as its own call would be:
        `accepted`, `timed_out`, or the typed `error` it met (with `detail`), the items
        after it still applied."""
        acks: list[EventAck] = []
        accepted = 0
        for op, payload in items:
            try:
                ack: api.Ack = await handlers[op](payload)
            except ServiceError as exc:
                acks.append(EventAck(accepted=False, error=type(exc).__name__,
                                     detail=str(exc)))
                continue
            if ack.accepted and not ack.timed_out:
                acks.append(_EVENT_ACCEPTED)
                accepted += 1
            else:
                acks.append(EventAck(accepted=ack.accepted, timed_out=ack.timed_out))
                accepted += ack.accepted
        return EventsAnswer(accepted=accepted, not_accepted=len(acks) - accepted, acks=acks)

    lists = {"token_ids": BigList(Annotated[int, Field(ge=0, le=limits.max_token_id)],
                                  limits.max_token_ids, (0, limits.max_token_id)),
             "chunk_hashes": BigList(_HASH, limits.max_chunk_hashes)}
    documented: list[APIRoute] = []
    for op, handle in handlers.items():
        route_args: dict[str, Any] = dict(
            methods=["POST"], response_model=ANSWERS[op], responses=responses,
            tags=["sessions"], summary=op.replace("_", " "),
            description=inspect.getdoc(handle) or "")
        validator = BodyValidator(models[op], lists, large_body_bytes=limits.large_body_bytes,
                                  max_errors=limits.max_listed_errors)
        runner = runners[f"/v1/{op}"] = _runner(op, validator, handle, auth, ANSWERS[op])
        app.add_api_route(f"/v1/{op}", _endpoint(op, runner), include_in_schema=False,
                          **route_args)
        documented.append(APIRoute(f"/v1/{op}", _documented(op, models[op], authenticate),
                                   **route_args))
    batch = BatchValidator({op: models[op] for op in EVENT_OPS},
                           max_items=limits.max_batch_events,
                           max_errors=limits.max_listed_errors)
    runner = runners[f"/v1/{EVENTS_OP}"] = _batch_runner(batch, events, auth)
    batch_responses = {status: answer for status, answer in responses.items()
                       if status != 409}
    batch_responses[413] = {"model": ErrorBody, "description": "the batch's body is larger "
                                                               "than `large_body_bytes`"}
    batch_responses[422] = {"model": ErrorBody, "description": "an item fails validation, "
                                                               "or the batch carries more "
                                                               "than `max_batch_events`; "
                                                               "`errors` name the item and "
                                                               "field (`events.3.node`); "
                                                               "nothing was applied"}
    route_args = dict(methods=["POST"], response_model=EventsAnswer,
                      response_model_exclude_none=True, responses=batch_responses,
                      tags=["sessions"], summary="events (a batch)",
                      description=inspect.getdoc(events) or "")
    app.add_api_route(f"/v1/{EVENTS_OP}", _endpoint(EVENTS_OP, runner),
                      include_in_schema=False, **route_args)
    documented.append(APIRoute(f"/v1/{EVENTS_OP}", _documented(
        EVENTS_OP, _batch_model({op: models[op] for op in EVENT_OPS}, limits),
        authenticate, EventsAnswer), **route_args))

    # ------------------------------------------------------------------ operations' side
    @app.get("/metrics", tags=["ops"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}},
                              "description": "Prometheus text exposition format"}})
    def metrics(creds: _Credentials) -> Response:
        """The scheduler's Prometheus metrics (lateness and TTLB histograms, bytes, hit
        rate, orders in flight, events, live sessions and quota refusals per tenant) and
        the API's own call counts and latency. With a metrics token configured it needs
        that token or the admin token (401 otherwise); without one it is open and its
        `tenant` labels are pseudonyms (`t-` and a keyed hash of the name), unless
        `http.metrics_tenant_names` is set."""
        auth.authorize_metrics(creds.credentials if creds is not None else None)
        try:
            scheduler = read_metrics()
        except Exception as exc:  # the API's own metrics are still worth serving
            log.warning("metrics: scheduler metrics unavailable: %s", exc)
            scheduler = b""
        if pseudonym is not None:
            scheduler = pseudonymize_tenants(scheduler, pseudonym)
        body = scheduler + bytes(generate_latest(http_metrics.registry))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", response_model=Health, response_model_exclude_none=True, tags=["ops"],
             responses={503: {"model": Health, "description": "scheduler unreachable"}})
    def healthz() -> Any:
        """200 while the API and (when checked) the scheduler answer."""
        if health_check is not None:
            try:
                health_check()
            except Exception as exc:
                # A remote scheduler's own error (the cause of a Ray task error), without
                # the remote traceback around it.
                cause = getattr(exc, "cause", None)
                detail = str(cause if isinstance(cause, KvPrefetchError) else exc)
                return JSONResponse(Health(status="unavailable", detail=detail).model_dump(),
                                    status_code=503)
        return Health(status="ok")

    @app.get("/nodes", response_model=NodeListing, tags=["ops"], responses=responses)
    def nodes(principal: Principal = Depends(authenticate)) -> Any:  # noqa: B008
        """The scheduler's node registry: every node slot, whether requests are routed to
        it, and its engine's URL (the gateway follows it)."""
        if not isinstance(backend, NodeRegistryAPI):
            raise ServiceUnavailableError("this scheduler keeps no node registry")
        return backend.nodes()

    def openapi() -> dict[str, Any]:
        # The operations read their bodies themselves (bounded, see http_body): the
        # document describes them through stand-ins that declare body and token.
        if app.openapi_schema is None:
            served = [r for r in app.routes if r.path not in  # type: ignore[attr-defined]
                      {d.path for d in documented}]
            app.openapi_schema = get_openapi(
                title=app.title, version=app.version, openapi_version=app.openapi_version,
                description=app.description, routes=[*documented, *served],
                separate_input_output_schemas=app.separate_input_output_schemas)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


#: An operation's runner: (the caller, the body, its content type) -> the answer, as
#: JSON bytes, or a response (a refusal).
_Runner = Callable[[Principal, bytes, "str | None"], Awaitable["bytes | Response"]]


def _runner(op: str, validator: BodyValidator, handle: Callable[[Any], Awaitable[Any]],
            auth: TenantAuth, answer: type[BaseModel]) -> _Runner:
    """The call ``op``: the caller (authenticated by the edge guard before the body was
    read), its body validated in bounded time (422 listing the first errors), the tenant
    taken from the token (or the body where the caller may name it, within
    ``auth.max_named_tenants``), then ``handle`` awaited with the scheduler's record; its
    answer serialized once, as ``answer``."""
    dump = TypeAdapter(answer).dump_json

    async def run(principal: Principal, body: bytes, content_type: str | None
                  ) -> bytes | Response:
        checked = await validator.validate(body, content_type)
        if isinstance(checked, Invalid):
            return _invalid_body(op, checked)
        tenant = auth.tenant_for(principal, getattr(checked, "tenant", None))
        return dump(await handle(_as_call(op, checked, tenant)))

    return run


def _batch_runner(validator: BatchValidator,
                  handle: Callable[[list[tuple[str, Any]]], Awaitable[EventsAnswer]],
                  auth: TenantAuth) -> _Runner:
    """``POST /v1/events``: the batch validated (422 naming the item and field), every
    item's tenant admitted (403 for any: nothing applied), then ``handle`` awaited with
    the scheduler's records, in order."""

    async def run(principal: Principal, body: bytes, content_type: str | None
                  ) -> bytes | Response:
        checked = validator.validate(body, content_type)
        if isinstance(checked, Invalid):
            return _invalid_body(EVENTS_OP, checked)
        calls = [(op, _as_call(op, item, auth.tenant_for(principal,
                                                           getattr(item, "tenant", None))))
                 for op, item in checked]
        answer = await handle(calls)
        return answer.__pydantic_serializer__.to_json(answer, exclude_none=True)

    return run


def _endpoint(op: str, run: _Runner) -> Callable[..., Any]:
    """``op``'s endpoint on FastAPI's router (the calls :class:`_Operations` does not
    answer itself take this path): ``run`` with the request's caller and body."""

    async def endpoint(request: Request) -> Any:
        principal: Principal = getattr(request.state, PRINCIPAL_STATE)
        answer = await run(principal, await request.body(),
                           request.headers.get("content-type"))
        if isinstance(answer, bytes):
            return Response(answer, media_type="application/json")
        return answer

    endpoint.__name__ = op
    return endpoint


class _Operations:
    """ASGI middleware, inside the edge guard: a ``POST`` to an operation's path is run
    here (``runners``), without the router, dependency and response-model layers of
    FastAPI (the edge guard has read the body and authenticated the caller; the answer is
    serialized once, by pydantic); the typed errors answer as the app's exception
    handlers do. Any other call goes on to the app."""

    def __init__(self, app: Any, *, runners: dict[str, _Runner]) -> None:
        self.app = app
        self.runners = runners

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        run = (self.runners.get(scope["path"])
               if scope["type"] == "http" and scope["method"] == "POST" else None)
        if run is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away: nobody to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        content_type = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value.decode("latin-1")
                break
        try:
            answer = await run(scope["state"][PRINCIPAL_STATE], b"".join(chunks),
                               content_type)
        except ServiceError as exc:
            answer = _error(exc, exc.http_status)
        except KvPrefetchError as exc:
            log.warning("POST %s: %s", scope["path"], exc)
            answer = _error(exc, 500)
        if isinstance(answer, bytes):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"%d" % len(answer)),
                                    (b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": answer})
            return
        await answer(scope, receive, send)


def _batch_model(models: dict[str, type[BaseModel]], limits: RequestLimits
                 ) -> type[BaseModel]:
    """The body of ``POST /v1/events`` for the OpenAPI document: ``events``, a list of
    the event operations' bodies told apart by ``op``."""
    items = []
    for op, model in models.items():
        tag: Any = (Literal[op], Field(description="the operation"))
        items.append(create_model(f"{model.__name__}Item", __base__=model,
                                  __doc__=model.__doc__, op=tag))
    item: Any = Annotated[Union[tuple(items)], Field(discriminator="op")]  # noqa: UP007
    batch: type[BaseModel] = create_model(
        "EventBatch", __doc__="Fire-and-forget events, applied in order.",
        events=(list[item], Field(min_length=1, max_length=limits.max_batch_events)))
    return batch


def _documented(op: str, model: type[BaseModel],
                authenticate: Callable[..., Principal],
                answer: type[BaseModel] | None = None) -> Callable[..., Any]:
    """A stand-in of ``op``'s endpoint, for the OpenAPI document only: its body is
    ``model``, its token the bearer scheme (FastAPI reads both from the signature, which is
    built here because ``model`` is made per app)."""

    def endpoint(call_: BaseModel, principal: Principal) -> Any:  # pragma: no cover
        raise NotImplementedError

    param = inspect.Parameter.POSITIONAL_OR_KEYWORD
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("call_", param, annotation=model),
         inspect.Parameter("principal", param, annotation=Principal,
                           default=Depends(authenticate))],
        return_annotation=answer or ANSWERS[op])
    endpoint.__name__ = op
    return endpoint


def _invalid_body(op: str, invalid: Invalid) -> JSONResponse:
    """The 422 of a body that fails validation: its first errors, and whether it has more."""
    model = OPERATIONS.get(op)
    what = (model.__name__ if model is not None
            else "batch of events" if op == EVENTS_OP else "request")
    fields = [FieldError(loc=p.loc, msg=p.msg, type=p.type) for p in invalid.problems]
    detail = f"invalid {what}: " + "; ".join(f"{f.loc}: {f.msg}" for f in fields)
    if invalid.more:
        detail += f"; and more (the first {len(fields)} errors are listed)"
    name = "MalformedHintError" if op == "hint" else "InvalidRequestError"
    body = ErrorBody(error=name, detail=detail, errors=fields)
    return JSONResponse(body.model_dump(), status_code=422)


class HttpServer:
    """Runs an ASGI app with uvicorn on a background thread, so that signals stay with the
    caller (``kvprefetch serve`` shuts its Ray actors down after the server). ``port=0``:
    the OS picks a free port (see :attr:`port`). Connections are admitted, timed and
    closed by :mod:`~kvprefetch.controlplane.live.http_conn` under ``limits`` (default:
    the app's ``limits`` for an app of :func:`create_app`, else :class:`RequestLimits`);
    ``max_connections``, when given, replaces theirs. :attr:`gate` keeps the books.
    ``loop``: uvicorn's event loop, ``auto`` (uvloop where it is installed, else asyncio's),
    ``asyncio`` or ``uvloop``."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *,
                 log_level: str = "warning", access_log: bool = False,
                 max_connections: int | None = None,
                 limits: RequestLimits | None = None,
                 loop: Literal["auto", "asyncio", "uvloop"] = "auto") -> None:
        self.app = app
        if limits is None:
            limits = getattr(getattr(app, "state", None), "limits", None)
            if not isinstance(limits, RequestLimits):
                limits = RequestLimits()
        if max_connections is not None:
            limits = limits.model_copy(update={"max_connections": max_connections})
        self.limits = limits
        self.max_connections = limits.max_connections
        self.gate = ConnectionGate(limits)
        self.host = host
        self._port = port
        self.log_level = log_level
        self.access_log = access_log
        self.loop = loop
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    def start(self, timeout_s: float = 10.0) -> HttpServer:
        """Listen; raises :class:`ConfigError` when the address cannot be bound."""
        import uvicorn

        if self._server is not None:
            return self
        # Bound here, not in uvicorn's thread: a taken port is a clear error for the caller
        # (uvicorn would sys.exit its thread), and port 0 is resolved before start returns.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Accepted connections inherit it: an answer's headers and body go out at
            # once instead of the body waiting ~40 ms for the client's delayed ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.host, self._port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"http: cannot listen on {self.host}:{self._port}: {exc}") from exc
        config = uvicorn.Config(ConnectionTracker(self.app), host=self.host, port=self._port,
                                log_level=self.log_level, access_log=self.access_log,
                                log_config=None, lifespan="off", loop=self.loop,
                                http=guarded_protocol(self.gate),  # type: ignore[arg-type]
                                timeout_keep_alive=math.ceil(self.limits.idle_timeout_s))
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                  name="kvprefetch-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                thread.join(timeout=5)
                sock.close()
                raise ServiceUnavailableError(
                    f"http: the server on {self.host}:{self._port} did not start")
            time.sleep(0.01)
        self._server, self._thread, self._socket = server, thread, sock
        return self

    @property
    def port(self) -> int:
        if self._socket is None:
            raise ServiceUnavailableError("the HTTP server is not started")
        return int(self._socket.getsockname()[1])

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, finish the calls in progress, return (idempotent)."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        if self._socket is not None:
            self._socket.close()
        self._server, self._thread, self._socket = None, None, None

    def __enter__(self) -> HttpServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
