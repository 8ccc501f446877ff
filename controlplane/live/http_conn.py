"""Connections at the HTTP edge: who gets a socket, for how long, and how one is closed.

:class:`HttpServer <kvprefetch.controlplane.live.http_api.HttpServer>` runs uvicorn with
:func:`guarded_protocol` as its HTTP protocol: uvicorn's own protocol (httptools or h11) does
the parsing, wrapped by :class:`GuardedProtocol`, which keeps the books of every connection in
one :class:`ConnectionGate` per server (event-loop thread only, no locks).

* **Admission.** At most ``max_connections`` connections, and at most
  ``max_connections_per_client`` from one client address. A connection over either cap takes
  the slot of the oldest *idle, unproven* connection (one with no call in progress that has
  not passed the edge's token check), which is closed; when every connection is busy or
  proven, the newcomer is answered 503 and closed. Idle sockets of anonymous clients can so
  never shut out the keep-alive connections of callers with a token.
* **``/healthz`` has a budget of its own.** Past the cap, up to ``health_connections`` more
  connections are admitted for ``GET /healthz`` only (503 for any other call on them).
* **Deadlines.** A new connection must deliver a request's headers within
  ``header_read_timeout_s`` (not reset by each byte: a header sent at 1 byte/s is cut off),
  and a kept-alive connection its next request's headers within ``idle_timeout_s``; the
  connection is closed otherwise. The body's pace is the edge guard's
  (:mod:`~kvprefetch.controlplane.live.http_edge`).
* **Lingering close.** A refusal sent before the request's body was read (401, 413, 429,
  408, 422 ...) goes out with ``Connection: close``; closing the socket then with the
  client's body still arriving would reset the connection and the client would lose the
  answer. The gate half-closes instead (the answer, then FIN), and reads and discards up to
  ``refusal_drain_bytes`` for up to ``refusal_drain_timeout_s`` before it closes.

Limits are the connection fields of :class:`~kvprefetch.controlplane.live.limits.RequestLimits`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from kvprefetch.controlplane.live.limits import RequestLimits

#: Where each request's ``scope["state"]`` carries its connection's :class:`Connection`.
CONNECTION_STATE = "kvprefetch.connection"
#: Set in ``scope["state"]`` by the edge guard once a call passed its token check: the
#: connection is then proven and never closed to make room.
PROVEN_STATE = "kvprefetch.proven"
HEALTH_PATH = "/healthz"


@dataclass(eq=False, slots=True)
class Connection:
    """One accepted connection's books. ``busy``: a call in progress; ``proven``: a call
    on it passed the token check; ``reserve``: admitted past the cap, for ``/healthz``
    only; ``body_open``: the call in progress has body bytes not yet received."""

    host: str
    protocol: GuardedProtocol = field(repr=False)
    busy: bool = False
    proven: bool = False
    reserve: bool = False
    body_open: bool = False

    @property
    def evictable(self) -> bool:
        return not (self.busy or self.proven or self.reserve)


class ConnectionGate:
    """The books of one server's connections (see the module docstring). Counters:
    ``evicted`` idle connections closed to make room, ``refused`` connections answered
    503 at the door, ``timed_out`` connections closed for a header or idle deadline."""

    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        #: Admitted connections in the order they were opened (the oldest first).
        self.connections: dict[Connection, None] = {}
        self.reserve = 0
        self.per_host: dict[str, int] = {}
        self.evicted = self.refused = self.timed_out = 0

    def admit(self, conn: Connection) -> bool:
        """Take ``conn`` in (closing an idle unproven one to make room where needed), or
        False: answer it 503."""
        limits = self.limits
        per_client = min(limits.max_connections_per_client, limits.max_connections)
        if self.per_host.get(conn.host, 0) >= per_client and not self._evict(conn.host):
            self.refused += 1
            return False
        full = len(self.connections) - self.reserve >= limits.max_connections
        if full and not self._evict(None):
            if self.reserve >= limits.health_connections:
                self.refused += 1
                return False
            conn.reserve = True
            self.reserve += 1
        self.connections[conn] = None
        self.per_host[conn.host] = self.per_host.get(conn.host, 0) + 1
        return True

    def release(self, conn: Connection) -> None:
        if conn not in self.connections:
            return  # never admitted, or already released
        del self.connections[conn]
        if conn.reserve:
            self.reserve -= 1
        left = self.per_host[conn.host] - 1
        if left:
            self.per_host[conn.host] = left
        else:
            del self.per_host[conn.host]

    def _evict(self, host: str | None) -> bool:
        """Close the oldest evictable connection (of ``host``, if given): True if one was."""
        for conn in self.connections:
            if conn.evictable and (host is None or conn.host == host):
                self.release(conn)
                conn.protocol.abort_idle()
                self.evicted += 1
                return True
        return False


class _LingeringTransport:
    """The transport the wrapped protocol writes to: the real one, except that
    :meth:`close` lingers (the module docstring) while the call's body is still open, and
    that an answer's head is held until its body is written (:meth:`GuardedProtocol.hold`),
    so that head and body leave in one write."""

    def __init__(self, transport: asyncio.Transport, owner: GuardedProtocol) -> None:
        self._transport = transport
        self._owner = owner

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._owner.held
        if held is not None:
            held.append(bytes(data))
        else:
            self._transport.write(data)

    def close(self) -> None:
        self._owner.release()
        self._owner.close_after_answer()

    def is_closing(self) -> bool:
        return self._owner.closing or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedProtocol(asyncio.Protocol):
    """uvicorn's HTTP protocol (``inner``) behind the gate: admission, deadlines and the
    lingering close of the module docstring. Made per connection by uvicorn through
    :func:`guarded_protocol`."""

    def __init__(self, gate: ConnectionGate, inner: Callable[..., asyncio.Protocol], *,
                 config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.gate = gate
        self.limits = gate.limits
        self.loop = _loop or asyncio.get_event_loop()
        self._make_inner = lambda state: inner(config=config, server_state=server_state,
                                               app_state=state, _loop=_loop)
        self._app_state = app_state
        self.inner: Any = None
        self.conn: Connection | None = None
        self.transport: asyncio.Transport | None = None
        self.closing = False
        self._draining = False
        self._drained = 0
        self._timer: asyncio.TimerHandle | None = None
        #: Writes held back until :meth:`release` (None: none held).
        self.held: list[bytes] | None = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports (uvicorn's choice wherever uvloop is
        # installed) have asyncio.Transport's methods without subclassing it.
        self.transport = real = cast(asyncio.Transport, transport)
        peer = real.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple | list) and peer else "?"
        conn = Connection(host, self)
        if not self.gate.admit(conn):
            self._refuse_at_door()
            return
        self.conn = conn
        self.inner = self._make_inner({**self._app_state, CONNECTION_STATE: conn})
        self.inner.connection_made(_LingeringTransport(real, self))
        self._arm(self.limits.header_read_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._draining:
            self._drained += len(data)
            if self._drained > self.limits.refusal_drain_bytes:
                self._close_now()
            return
        if self.inner is not None and not self.closing:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._draining or self.inner is None:
            self._close_now()
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.conn is not None:
            self.gate.release(self.conn)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # ------------------------------------------------------------------ the gate's calls
    def request_started(self) -> None:
        """A call's headers arrived (its ASGI app starts): no deadline while it runs."""
        self._disarm()

    def response_done(self) -> None:
        """A call was answered: the next call's headers are due within the idle timeout."""
        if not self.closing:
            self._arm(self.limits.idle_timeout_s)

    def hold(self) -> None:
        """Hold the wrapped protocol's writes until :meth:`release` (an answer's head,
        until its body follows: one system call and one segment instead of two)."""
        if self.held is None:
            self.held = []

    def release(self) -> None:
        """Write what was held, in one write."""
        held, self.held = self.held, None
        if held and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(held))

    def abort_idle(self) -> None:
        """Close this idle connection to make room for another (no call in progress)."""
        self._close_now()

    def close_after_answer(self) -> None:
        """The wrapped protocol closes the connection: at once, or lingering while the
        call's body is still arriving (the module docstring)."""
        if self.closing or self.transport is None:
            return
        self.closing = True
        if self.conn is None or not self.conn.body_open or self.transport.is_closing():
            self._close_now()
            return
        self._linger()

    # ------------------------------------------------------------------ mechanism
    def _refuse_at_door(self) -> None:
        assert self.transport is not None
        body = json.dumps({"error": "ServiceUnavailableError",
                           "detail": "the server holds max_connections busy or proven "
                                     "connections (or max_connections_per_client of this "
                                     "address): retry later"}).encode()
        self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: "
                             b"application/json\r\nconnection: close\r\nretry-after: 1\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
        self.closing = True
        self._linger()

    def _linger(self) -> None:
        assert self.transport is not None
        self._draining = True
        self._disarm()
        if self.transport.can_write_eof():
            self.transport.write_eof()  # after the answer still buffered
        self.transport.resume_reading()
        self._timer = self.loop.call_later(self.limits.refusal_drain_timeout_s,
                                           self._close_now)

    def _close_now(self) -> None:
        self._disarm()
        self.closing = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _arm(self, timeout_s: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.conn is not None and not self.conn.busy and not self.closing:
            self.gate.timed_out += 1
            self._close_now()


def guarded_protocol(gate: ConnectionGate) -> Callable[..., asyncio.Protocol]:
    """uvicorn's ``http`` argument: its automatic HTTP protocol behind ``gate``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    def make(*, config: Any, server_state: Any, app_state: dict[str, Any],
             _loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
        return GuardedProtocol(gate, AutoHTTPProtocol, config=config,
                               server_state=server_state, app_state=app_state, _loop=_loop)

    return make


class ConnectionTracker:
    """ASGI middleware (outermost) that tells each call's connection when the call starts,
    whether its body is still arriving, and when it is answered; and answers any call but
    ``GET /healthz`` on a connection admitted past the cap with 503."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        state = scope.get("state") or {}
        conn: Connection | None = state.get(CONNECTION_STATE)
        if scope["type"] != "http" or conn is None:
            await self.app(scope, receive, send)
            return
        conn.busy = True
        conn.body_open = _has_body(scope.get("headers", ()))
        conn.protocol.request_started()

        async def tracked_receive() -> Any:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                conn.body_open = False
            return message

        async def tracked_send(message: Any) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                conn.protocol.hold()  # the head goes out with the body's first part
                await send(message)
                return
            if kind == "http.response.body":
                done = not message.get("more_body", False)
                if done:
                    conn.busy = False
                    conn.proven = conn.proven or bool(scope["state"].get(PROVEN_STATE))
                try:
                    await send(message)
                finally:
                    conn.protocol.release()
                if done:
                    conn.protocol.response_done()
                return
            await send(message)

        try:
            if conn.reserve and not (scope["path"] == HEALTH_PATH
                                     and scope.get("method") in ("GET", "HEAD")):
                await _over_cap(tracked_send)
            else:
                await self.app(scope, tracked_receive, tracked_send)
        finally:
            conn.protocol.release()
            conn.busy = False


def _has_body(headers: Any) -> bool:
    for name, value in headers:
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False


async def _over_cap(send: Any) -> None:
    body = json.dumps({"error": "ServiceUnavailableError",
                       "detail": "the server holds max_connections connections: this one "
                                 "is admitted for GET /healthz only"}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})
