"""The HTTP API: the gateway operations of :mod:`controlplane.live.client` for gateways not
written in Python, as JSON ``POST /v1/<op>`` endpoints on the models of
:mod:`controlplane.base.api` (the OpenAPI document at ``/openapi.json`` is generated from them).

=====================  =========================  ==================================
endpoint               body                       answer
=====================  =========================  ==================================
POST /v1/route             :class:`~api.RouteQuery`       :class:`~api.RouteAnswer`
POST /v1/request_started   :class:`~api.RequestStarted`   :class:`~api.Ack`
POST /v1/request_finished  :class:`~api.RequestFinished`  :class:`~api.Ack`
POST /v1/hint              :class:`~api.HintCall`         :class:`~api.Ack`
POST /v1/session_closed    :class:`~api.SessionClosed`    :class:`~api.Ack`
GET  /metrics              Prometheus text exposition format
GET  /healthz              ``{"status": "ok"}`` (503 when the scheduler is unreachable)
=====================  =========================  ==================================

Errors are JSON ``{"error": <type name>, "detail": <message>}`` with the status of the
typed error (:attr:`~controlplane.base.errors.ServiceError.http_status`): 401 no or wrong bearer
token, 403 wrong tenant, 404 unknown session, 422 a body that fails validation (``errors``
then lists each field as ``loc``/``msg``/``type``), 503 scheduler unavailable. A call the
scheduler does not answer within ``call_timeout_s`` answers 200 like the Python client
does: a route with ``node: null, timed_out: true`` (run the request without prefetch), an
event with ``accepted: false``.

The app fronts any :class:`~controlplane.live.protocol.GatewayAPI`: a
:class:`~controlplane.live.service.SchedulerService` in this process, or a transport to the
scheduler (the Ray actor's, in ``kvprefetch serve``); one across a process boundary
(:class:`~controlplane.live.protocol.RemoteAPI`) is called with ``call_timeout_s``.
Endpoints are plain functions, run on Starlette's thread pool, because every call may
block (a lock, ``ray.get``).

Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client).
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel

from controlplane import __version__
from controlplane.base import api
from controlplane.base.errors import (
    ConfigError,
    KvPrefetchError,
    ServiceError,
    ServiceUnavailableError,
    UnauthorizedError,
)
from controlplane.live.client import Client
from controlplane.live.protocol import GatewayAPI, RemoteAPI

log = logging.getLogger(__name__)

#: Seconds the app waits for the scheduler per call (the Python client's default).
DEFAULT_CALL_TIMEOUT_S = 2.0
#: Operation (the path ``/v1/<op>``, the GatewayAPI method) -> the model of its body.
OPERATIONS: dict[str, type[BaseModel]] = {
    "route": api.RouteQuery,
    "request_started": api.RequestStarted,
    "request_finished": api.RequestFinished,
    "hint": api.HintCall,
    "session_closed": api.SessionClosed,
}
HTTP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

#: Where ``/metrics`` reads the scheduler's measurements: a registry, an object holding one
#: (:class:`~controlplane.live.metrics.PrometheusMetrics`), or a function returning exposition
#: text (the Ray scheduler actor's ``metrics_text``).
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


class Health(BaseModel):
    status: str
    detail: str | None = None


#: Module level: FastAPI resolves the (postponed) annotations of endpoints in this namespace.
_BEARER = HTTPBearer(auto_error=False, description="the token of `http.bearer_token`")
_Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorBody, "description": "the session belongs to another tenant, or "
                                             "the tenant is not allowed"},
    404: {"model": ErrorBody, "description": "unknown session"},
    422: {"model": ErrorBody, "description": "the body fails validation; `errors` names "
                                             "the fields"},
    503: {"model": ErrorBody, "description": "the scheduler is unavailable"},
}


def _gateway(target: GatewayAPI | Client, call_timeout_s: float) -> GatewayAPI:
    """The API the endpoints call: ``target``, or the one a client holds; a remote one
    bounded by ``call_timeout_s``."""
    scheduler = target.scheduler if isinstance(target, Client) else target
    if not isinstance(scheduler, GatewayAPI):  # untyped callers: fail at start-up
        raise ConfigError(f"create_app: cannot serve {type(target).__name__}: give a "
                          "GatewayAPI (a SchedulerService or a transport to one)")
    if isinstance(scheduler, RemoteAPI):
        return scheduler.with_timeout(call_timeout_s)
    return scheduler


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

    def observe(self, path: str, status: int, seconds: float) -> None:
        op = path.removeprefix("/v1/") if path.startswith("/v1/") else None
        if op not in OPERATIONS:
            return  # only the operations: unknown paths must not grow the label set
        self.requests.labels(op, str(status)).inc()
        self.latency.labels(op).observe(seconds)


def create_app(scheduler: GatewayAPI | Client, *, bearer_token: str | None,
               metrics_registry: MetricsSource | None = None,
               call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
               health_check: Callable[[], None] | None = None) -> FastAPI:
    """The FastAPI app in front of ``scheduler`` (see the module docstring; a
    :class:`~controlplane.live.client.Client` stands for the API it holds).

    ``bearer_token``: when given, every ``/v1`` call must carry ``Authorization: Bearer
    <token>`` (401 otherwise); ``/healthz``, ``/metrics`` and the OpenAPI document stay open
    for probes and scrapers. ``health_check`` raises when the scheduler is unreachable
    (``/healthz`` then answers 503). Raises :class:`ConfigError` on a bad argument."""
    if bearer_token is not None and not bearer_token.strip():
        raise ConfigError("http bearer_token: empty (give a token or None for no auth)")
    if call_timeout_s <= 0:
        raise ConfigError("http call_timeout_s: must be > 0")
    backend = _gateway(scheduler, call_timeout_s)
    read_metrics = _metrics_reader(metrics_registry)
    http_metrics = _HttpMetrics()
    app = FastAPI(
        title="kvprefetch",
        version=__version__,
        description="Session events and hints for the kvprefetch scheduler: it predicts "
                    "when each session returns and warms the KV cache of the node that "
                    "will serve it.",
    )
    token = bearer_token.encode() if bearer_token is not None else None

    def authorize(creds: _Credentials) -> None:
        if token is None:
            return
        if creds is None:
            raise UnauthorizedError("missing bearer token (Authorization: Bearer <token>)")
        if not secrets.compare_digest(creds.credentials.encode(), token):
            raise UnauthorizedError("wrong bearer token")

    responses = dict(_ERROR_RESPONSES)
    if token is not None:
        responses[401] = {"model": ErrorBody, "description": "no or wrong bearer token"}
    guarded: list[Any] = [Depends(authorize)] if token is not None else []

    def event(op: str, send: Callable[[], api.Ack]) -> api.Ack:
        try:
            return send()
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

    @app.middleware("http")
    async def _measure(request: Request,
                       call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        http_metrics.observe(request.url.path, response.status_code,
                             time.perf_counter() - started)
        return response

    # ------------------------------------------------------------------ operations
    @app.post("/v1/route", response_model=api.RouteAnswer, dependencies=guarded,
              responses=responses, tags=["sessions"])
    def route(call_: api.RouteQuery) -> api.RouteAnswer:
        """Where to run this request (records `request_started` too unless it was sent for
        this request). `node: null` means: no advice, run it anywhere without prefetch."""
        try:
            return backend.route(call_)
        except TimeoutError:
            log.warning("route: the scheduler did not answer in %.3g s", call_timeout_s)
            return api.RouteAnswer.no_prefetch(timed_out=True)

    @app.post("/v1/request_started", response_model=api.Ack, dependencies=guarded,
              responses=responses, tags=["sessions"])
    def request_started(call_: api.RequestStarted) -> api.Ack:
        """A request of the session arrived at the gateway."""
        return event("request_started", lambda: backend.request_started(call_))

    @app.post("/v1/request_finished", response_model=api.Ack, dependencies=guarded,
              responses=responses, tags=["sessions"])
    def request_finished(call_: api.RequestFinished) -> api.Ack:
        """The response ended on `node`; the session's context grew."""
        return event("request_finished", lambda: backend.request_finished(call_))

    @app.post("/v1/hint", response_model=api.Ack, dependencies=guarded,
              responses=responses, tags=["sessions"])
    def hint(call_: api.HintCall) -> api.Ack:
        """A typed hint: `user_typing` (optional `eta_s`), `tool_running` (`eta_s` = the
        expected duration) or `session_closed`."""
        return event("hint", lambda: backend.hint(call_))

    @app.post("/v1/session_closed", response_model=api.Ack, dependencies=guarded,
              responses=responses, tags=["sessions"])
    def session_closed(call_: api.SessionClosed) -> api.Ack:
        """The session will not return: its prefetches stop and its state is freed."""
        return event("session_closed", lambda: backend.session_closed(call_))

    # ------------------------------------------------------------------ operations' side
    @app.get("/metrics", tags=["ops"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}},
                              "description": "Prometheus text exposition format"}})
    def metrics() -> Response:
        """The scheduler's Prometheus metrics (lateness and TTLB histograms, bytes, hit
        rate, orders in flight, events) and the API's own call counts and latency."""
        try:
            scheduler = read_metrics()
        except Exception as exc:  # the API's own metrics are still worth serving
            log.warning("metrics: scheduler metrics unavailable: %s", exc)
            scheduler = b""
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
                return JSONResponse(Health(status="unavailable", detail=str(exc)).model_dump(),
                                    status_code=503)
        return Health(status="ok")

    return app


class HttpServer:
    """Runs an ASGI app with uvicorn on a background thread, so that signals stay with the
    caller (``kvprefetch serve`` shuts its Ray actors down after the server). ``port=0``:
    the OS picks a free port (see :attr:`port`)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *,
                 log_level: str = "warning", access_log: bool = False) -> None:
        self.app = app
        self.host = host
        self._port = port
        self.log_level = log_level
        self.access_log = access_log
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
            sock.bind((self.host, self._port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"http: cannot listen on {self.host}:{self._port}: {exc}") from exc
        config = uvicorn.Config(self.app, host=self.host, port=self._port,
                                log_level=self.log_level, access_log=self.access_log,
                                log_config=None, lifespan="off")
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
