"""The gateway's Python API: ``connect(address=...)`` and :class:`Client`.

Every call is validated here (pydantic, :mod:`controlplane.base.api`) before it leaves the
process, carries a tenant, and waits at most ``timeout_s``: a ``route`` that times out
answers :meth:`RouteAnswer.no_prefetch` (run the request anywhere, without prefetch) and an
event that times out answers ``Ack(accepted=False, timed_out=True)``; neither raises, so
the inference path is never held up for long. The service's refusals come back as typed
errors (:class:`~controlplane.base.errors.UnknownSessionError`,
:class:`~controlplane.base.errors.WrongTenantError`,
:class:`~controlplane.base.errors.MalformedHintError`, ...).

Transports: ``address="inproc"`` with ``service=`` (tests, embedding), a Ray address
(``"auto"``, ``"ray://host:10001"``, ``"127.0.0.2:6379"``: the named scheduler actor), or an
HTTP URL (``http://host:8000``, the FastAPI app of :mod:`controlplane.live.http_api`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import BaseModel

from controlplane.base import api
from controlplane.base.errors import (
    InvalidRequestError,
    KvPrefetchError,
    MalformedHintError,
    ServiceError,
    ServiceUnavailableError,
    UnauthorizedError,
    UnknownSessionError,
    WrongTenantError,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0


class Transport(Protocol):
    """Sends one validated call; raises TimeoutError after ``timeout_s`` and the service's
    typed errors as they are."""

    def call(self, op: str, payload: BaseModel, timeout_s: float) -> Any: ...

    def close(self) -> None: ...


class LocalTransport:
    """Calls a :class:`~controlplane.live.service.SchedulerService` in this process."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def call(self, op: str, payload: BaseModel, timeout_s: float) -> Any:
        return getattr(self.service, op)(payload)

    def close(self) -> None:
        return None


class RayTransport:
    """Calls the named scheduler actor; Ray's errors are translated here."""

    def __init__(self, address: str, namespace: str) -> None:
        import ray

        from agents.ray_entry import SCHEDULER_NAME

        if not ray.is_initialized():
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        try:
            self._handle = ray.get_actor(SCHEDULER_NAME, namespace=namespace)
        except ValueError as exc:
            raise ServiceUnavailableError(
                f"no kvprefetch scheduler in Ray namespace {namespace!r} at {address!r}: "
                "start one with `kvprefetch serve`") from exc

    def call(self, op: str, payload: BaseModel, timeout_s: float) -> Any:
        import ray
        from ray.exceptions import (
            ActorUnavailableError,
            GetTimeoutError,
            RayActorError,
            RayTaskError,
        )

        ref = getattr(self._handle, op).remote(payload)
        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError as exc:
            raise TimeoutError(f"{op} timed out after {timeout_s} s") from exc
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, KvPrefetchError) else None
            if cause is not None:
                raise cause from None
            raise ServiceError(f"{op} failed in the scheduler: {exc}") from exc
        except (RayActorError, ActorUnavailableError) as exc:
            raise ServiceUnavailableError(f"scheduler unavailable: {exc}") from exc

    def close(self) -> None:
        return None


_STATUS_ERRORS: dict[int, type[ServiceError]] = {
    401: UnauthorizedError,
    403: WrongTenantError,
    404: UnknownSessionError,
    422: InvalidRequestError,
    503: ServiceUnavailableError,
}
#: The typed errors the HTTP API names in its answers' ``error`` field.
_NAMED_ERRORS: dict[str, type[ServiceError]] = {
    cls.__name__: cls for cls in (*_STATUS_ERRORS.values(), MalformedHintError, ServiceError)
}


class HttpTransport:
    """Calls the HTTP API (``POST /v1/<op>``), with an optional bearer token. Its error
    answers (``{"error": <type>, "detail": <message>}``) are raised as the typed error they
    name, or by status."""

    def __init__(self, base_url: str, token: str | None) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers)

    def call(self, op: str, payload: BaseModel, timeout_s: float) -> Any:
        import httpx

        try:
            resp = self._client.post(f"/v1/{op}",
                                     content=payload.model_dump_json(exclude_none=True),
                                     headers={"Content-Type": "application/json"},
                                     timeout=timeout_s)
        except httpx.TimeoutException as exc:
            raise TimeoutError(f"{op} timed out after {timeout_s} s") from exc
        except httpx.HTTPError as exc:
            raise ServiceUnavailableError(f"scheduler HTTP API unreachable: {exc}") from exc
        if resp.status_code >= 400:
            raise _http_error(op, resp.status_code, resp.text)
        return resp.json()

    def close(self) -> None:
        self._client.close()


def _http_error(op: str, status: int, text: str) -> ServiceError:
    name = None
    detail: Any = text
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        name = body.get("error")
        detail = body.get("detail", text)
    cls = _NAMED_ERRORS.get(name) if isinstance(name, str) else None
    if cls is None:
        cls = (MalformedHintError if op == "hint" and status == 422
               else _STATUS_ERRORS.get(status, ServiceError))
    return cls(f"HTTP {status}: {detail}")


class Client:
    """See the module docstring. Thread-safe when its transport is (all three are)."""

    def __init__(self, transport: Transport, *, tenant: str = "default",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._transport = transport
        self.tenant = tenant
        self.timeout_s = timeout_s
        self.timeouts = 0

    @property
    def transport(self) -> Transport:
        """How calls leave this client (the HTTP API fronts a client's transport)."""
        return self._transport

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing
    def _fields(self, session_id: str, tenant: str | None, **kw: Any) -> dict[str, Any]:
        out = {"tenant": tenant or self.tenant, "session_id": session_id}
        out.update({k: v for k, v in kw.items() if v is not None})
        return out

    def _ack(self, op: str, payload: BaseModel, timeout_s: float | None) -> api.Ack:
        try:
            answer = self._transport.call(op, payload, timeout_s or self.timeout_s)
        except TimeoutError:
            self.timeouts += 1
            log.warning("%s timed out; the event is dropped", op)
            return api.Ack(accepted=False, timed_out=True)
        return answer if isinstance(answer, api.Ack) else api.Ack.model_validate(answer)

    # ------------------------------------------------------------------ the API
    def route(self, session_id: str, *, input_tokens: int | None = None,
              token_ids: Sequence[int] | None = None,
              chunk_hashes: Sequence[str] | None = None, reused_tokens: int | None = None,
              parent_id: str | None = None, tenant: str | None = None,
              timeout_s: float | None = None) -> api.RouteAnswer:
        """The node to run this request on (and ``request_started`` if not yet sent)."""
        payload = api.parse(api.RouteQuery, self._fields(
            session_id, tenant, input_tokens=input_tokens,
            token_ids=list(token_ids) if token_ids is not None else None,
            chunk_hashes=list(chunk_hashes) if chunk_hashes is not None else None,
            reused_tokens=reused_tokens, parent_id=parent_id))
        try:
            answer = self._transport.call("route", payload, timeout_s or self.timeout_s)
        except (TimeoutError, ServiceUnavailableError) as exc:
            self.timeouts += isinstance(exc, TimeoutError)
            log.warning("route: %s; running without prefetch", exc)
            return api.RouteAnswer.no_prefetch(timed_out=isinstance(exc, TimeoutError))
        if isinstance(answer, api.RouteAnswer):
            return answer
        return api.RouteAnswer.model_validate(answer)

    def request_started(self, session_id: str, *, input_tokens: int | None = None,
                        token_ids: Sequence[int] | None = None,
                        chunk_hashes: Sequence[str] | None = None,
                        reused_tokens: int | None = None, parent_id: str | None = None,
                        tenant: str | None = None, timeout_s: float | None = None) -> api.Ack:
        payload = api.parse(api.RequestStarted, self._fields(
            session_id, tenant, input_tokens=input_tokens,
            token_ids=list(token_ids) if token_ids is not None else None,
            chunk_hashes=list(chunk_hashes) if chunk_hashes is not None else None,
            reused_tokens=reused_tokens, parent_id=parent_id))
        return self._ack("request_started", payload, timeout_s)

    def request_finished(self, session_id: str, *, node: int, input_tokens: int,
                         output_tokens: int = 0, context_tokens: int | None = None,
                         stop_reason: str | None = None,
                         chunk_hashes: Sequence[str] | None = None, tenant: str | None = None,
                         timeout_s: float | None = None) -> api.Ack:
        payload = api.parse(api.RequestFinished, self._fields(
            session_id, tenant, node=node, input_tokens=input_tokens,
            output_tokens=output_tokens, context_tokens=context_tokens,
            stop_reason=stop_reason,
            chunk_hashes=list(chunk_hashes) if chunk_hashes is not None else None))
        return self._ack("request_finished", payload, timeout_s)

    def hint(self, session_id: str, hint: api.Hint | dict[str, Any] | str, *,
             eta_s: float | None = None, tenant: str | None = None,
             timeout_s: float | None = None) -> api.Ack:
        """A typed hint: ``api.Hint(kind="tool_running", eta_s=2.0)``, the same as a dict,
        or a kind name with ``eta_s``."""
        raw: Any = hint
        if isinstance(hint, str):
            raw = {"kind": hint, "eta_s": eta_s} if eta_s is not None else {"kind": hint}
        elif isinstance(hint, api.Hint):
            raw = hint.model_dump()
        payload = api.parse(api.HintCall, self._fields(session_id, tenant, hint=raw))
        return self._ack("hint", payload, timeout_s)

    def session_closed(self, session_id: str, *, tenant: str | None = None,
                       timeout_s: float | None = None) -> api.Ack:
        payload = api.parse(api.SessionClosed, self._fields(session_id, tenant))
        return self._ack("session_closed", payload, timeout_s)


def connect(address: str = "auto", *, tenant: str = "default",
            timeout_s: float = DEFAULT_TIMEOUT_S, service: Any = None,
            token: str | None = None, namespace: str = "kvprefetch") -> Client:
    """A client of the scheduler at ``address`` (see the module docstring)."""
    if timeout_s <= 0:
        raise InvalidRequestError("timeout_s must be positive")
    transport: Transport
    if service is not None or address == "inproc":
        if service is None:
            raise InvalidRequestError("address 'inproc' needs service=")
        transport = LocalTransport(service)
    elif address.startswith(("http://", "https://")):
        transport = HttpTransport(address, token)
    else:
        transport = RayTransport(address, namespace)
    return Client(transport, tenant=tenant, timeout_s=timeout_s)
