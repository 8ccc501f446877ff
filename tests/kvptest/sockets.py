"""Raw-socket helpers for the HTTP edge's tests."""

from __future__ import annotations

import contextlib
import socket
import struct


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (linger 0), as a crashed process's socket goes: the peer's
    call fails at once and no TIME_WAIT stays. The shutdown first: a close alone would
    wait for another thread's blocked ``recv`` on the socket."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def answer_head(sock: socket.socket) -> bytes:
    """An HTTP answer's head (and what came with it), or what came before the server
    closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data
