"""Raw-socket helpers for the HTTP edge's tests."""

from __future__ import annotations

import socket


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
