"""A TCP proxy on loopback in front of a real server, whose behaviour a test sets between
calls: a scheduler that is up, dead, slow, or failing in the ways a load balancer or a
crashing process fails. It forwards bytes; it knows nothing of the client it serves.

Modes (:meth:`FaultyLink.set`):

- ``up``: every byte forwarded both ways.
- ``dead``: nothing listens on the port (connections are refused) and every open
  connection is reset, as when the server's process is gone.
- ``slow``: the request is forwarded, the answer held ``delay_s`` before it goes back.
- ``reset``: a connection that sends a request is reset before any answer.
- ``bad_gateway``: a request is answered ``502 Bad Gateway`` with an HTML page, as a load
  balancer answers while its backend is down.
- ``gateway_timeout``: the same with ``504 Gateway Timeout``.
- ``not_json``: a request is answered ``200`` with an HTML page (a captive proxy, a wrong
  service on the port).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Literal

from kvptest.sockets import reset

Mode = Literal["up", "dead", "slow", "reset", "bad_gateway", "gateway_timeout", "not_json"]
MODES: tuple[Mode, ...] = ("up", "dead", "slow", "reset", "bad_gateway", "gateway_timeout",
                           "not_json")

_PAGE = b"<html><body><h1>%s</h1></body></html>"


def _http_answer(status: bytes) -> bytes:
    body = _PAGE % status
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: text/html\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


_CANNED: dict[str, bytes] = {
    "bad_gateway": _http_answer(b"502 Bad Gateway"),
    "gateway_timeout": _http_answer(b"504 Gateway Timeout"),
    "not_json": _http_answer(b"200 OK"),
}



class FaultyLink:
    """The proxy: ``url`` is its address, ``upstream`` the real server's ``(host, port)``.
    :meth:`set` takes effect on the next bytes of every connection, open or new."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.mode: Mode = "up"
        self.delay_s = 0.0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._listen(0)
        assert self._listener is not None
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultyLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop_listening()
        self._reset_all()

    def set(self, mode: Mode, delay_s: float = 0.0) -> None:
        """From now on behave as ``mode`` (``delay_s``: how long ``slow`` holds an answer)."""
        self.delay_s = delay_s
        if mode == "dead":
            self.mode = mode
            self._stop_listening()
            self._reset_all()
            return
        if self._listener is None:
            self._listen(self.port)
        self.mode = mode

    # ------------------------------------------------------------------ plumbing
    def _listen(self, port: int) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True,
                         name="faulty-link-accept").start()

    def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()

    def _reset_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            reset(conn)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._conns.add(sock)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            self._track(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="faulty-link-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        """The client's side of one connection: each chunk of request bytes is answered
        as the mode says at the time it arrives."""
        upstream: socket.socket | None = None
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                mode = self.mode
                if mode in ("reset", "dead"):
                    reset(conn)
                    return
                if mode in _CANNED:
                    conn.sendall(_CANNED[mode])
                    return
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    self._track(upstream)
                    threading.Thread(target=self._answers, args=(upstream, conn),
                                     daemon=True, name="faulty-link-answers").start()
                upstream.sendall(data)
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            if upstream is not None:
                with contextlib.suppress(OSError):
                    upstream.close()

    def _answers(self, upstream: socket.socket, conn: socket.socket) -> None:
        """The server's answers back to the client, each held while the link is slow."""
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                if self.mode == "slow":
                    time.sleep(self.delay_s)
                if self.mode == "dead":
                    reset(conn)
                    return
                conn.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)
