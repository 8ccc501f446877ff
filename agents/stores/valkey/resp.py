"""A minimal RESP connection for the Valkey store's bulk paths, and a pool of them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from kvprefetch.agents.stores.errors import CorruptObjectError
from kvprefetch.agents.stores.valkey.config import ValkeyStoreConfig


class BulkConnection:
    """A minimal RESP connection that reads a GET reply straight into caller memory.

    valkey-py's parsers return each value as a new ``bytes`` object (one copy more than the
    kernel's), a large share of the work for multi-MiB stripes on a CPU-bound node
    (``kvprefetch bench store`` compares the two paths). This reader receives the value with
    ``recv_into`` into the destination (a mapped local tier file), so the only copy is the
    kernel's. It speaks just enough RESP2 for AUTH, SELECT, GET and pipelined SET;
    everything else goes through valkey-py.
    """

    def __init__(self, config: ValkeyStoreConfig) -> None:
        import socket
        import ssl

        c = config
        sock = socket.create_connection((c.host, c.port), timeout=c.connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if c.tls:
            ctx = ssl.create_default_context(cafile=c.tls_ca_file)
            if c.tls_cert_file and c.tls_key_file:
                ctx.load_cert_chain(c.tls_cert_file, c.tls_key_file)
            if not c.tls_verify:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            sock = ctx.wrap_socket(sock, server_hostname=c.host)
        self._tls = c.tls
        sock.settimeout(c.socket_timeout_s)
        self._sock = sock
        self._buf = bytearray()
        self._small = bytearray(64 * 1024)
        if c.password is not None:
            args = [b"AUTH"]
            if c.username:
                args.append(c.username.encode())
            args.append(c.password.get_secret_value().encode())
            self._simple(args)
        if c.db:
            self._simple([b"SELECT", str(c.db).encode()])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def _send(self, args: list[bytes]) -> None:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self._sock.sendall(b"".join(out))

    def _line(self, read_size: int = 64 * 1024) -> bytes:
        while True:
            i = self._buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[: i + 2]
                return line
            n = self._sock.recv_into(self._small, read_size)
            if n == 0:
                raise ConnectionError("connection closed by server")
            self._buf += self._small[:n]

    def _error(self, line: bytes) -> Exception:
        import valkey.exceptions as vex

        msg = line[1:].decode(errors="replace")
        if msg.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            return vex.AuthenticationError(msg)
        return vex.ResponseError(msg)

    def _simple(self, args: list[bytes]) -> None:
        self._send(args)
        line = self._line()
        if line.startswith(b"-"):
            raise self._error(line)

    def _fill(self, view: memoryview) -> None:
        have = min(len(self._buf), len(view))
        if have:
            view[:have] = self._buf[:have]
            del self._buf[:have]
        got = have
        total = len(view)
        while got < total:
            n = self._sock.recv_into(view[got:], total - got)
            if n == 0:
                raise ConnectionError("connection closed by server")
            got += n

    def _send_gather(self, head: bytes, views: Sequence[memoryview]) -> None:
        """Send ``head`` then ``views`` in as few system calls as the socket allows
        (``sendmsg`` with every buffer): two ``sendall`` calls would put the small command
        line in a segment of its own (``TCP_NODELAY``), a wake-up of the server for 30-odd
        bytes per value (the Valkey CPU per GiB that ``kvprefetch bench store`` reports)."""
        if self._tls:  # SSL sockets have no sendmsg
            self._sock.sendall(head)
            for view in views:
                self._sock.sendall(view)
            return
        bufs = [b for b in (memoryview(head), *views) if len(b)]
        while bufs:
            n = self._sock.sendmsg(bufs)
            while bufs and n >= len(bufs[0]):
                n -= len(bufs.pop(0))
            if n:
                bufs[0] = bufs[0][n:]

    @staticmethod
    def _set_command(key: bytes, size: int, px: int | None) -> bytes:
        """The RESP of ``SET key <value of size bytes> [PX px]`` up to the value."""
        if px is None:
            return b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size)
        return b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size)

    @staticmethod
    def _set_tail(px: int | None) -> bytes:
        """What follows a SET's value: its CRLF and the ``PX`` argument."""
        if px is None:
            return b"\r\n"
        return b"\r\n$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px)

    def _send_sets(self, items: Iterable[tuple[bytes, Sequence[memoryview]]], px: int | None,
                   before: Callable[[bytes], bytes] | None = None, after: bytes = b"") -> int:
        """Write a ``SET key value [PX px]`` per item, each value the concatenation of its
        buffers sent straight from their memory (taken from ``items`` one at a time, as they
        are sent), with ``before(key)`` written ahead of each and ``after`` behind; returns
        how many were written."""
        pending = b""
        sent = 0
        for key, views in items:
            sent += 1
            command = self._set_command(key, sum(map(len, views)), px)
            self._send_gather(pending + (before(key) if before else b"") + command, views)
            pending = self._set_tail(px) + after
        if pending:
            self._sock.sendall(pending)
        return sent

    def set_many(self, items: Iterable[tuple[bytes, Sequence[memoryview]]], px: int | None
                 ) -> None:
        """SET each ``(key, value)`` (with ``PX px``), pipelined: every command is written
        (see :meth:`_send_sets`), then every reply read. Raises on the first error reply (the
        connection must then be dropped: replies are left unread)."""
        for _ in range(self._send_sets(items, px)):
            self._status()

    def swap_many(self, items: Iterable[tuple[bytes, Sequence[memoryview]]], px: int | None,
                  peek: int) -> list[bytes | None]:
        """SET each ``(key, value)`` as :meth:`set_many` does, each in a transaction that
        first reads the first ``peek`` bytes of the value it replaces (``MULTI``,
        ``GETRANGE key 0 peek-1``, ``SET``, ``EXEC``): what a head's parts are named by,
        without the inline payload that may follow (``SET ... GET`` sent every replaced
        payload back). Returns those bytes per key (None: the key held nothing). Raises on
        the first error reply (the connection must then be dropped)."""
        last = b"%d" % (peek - 1)

        def begin(key: bytes) -> bytes:
            return (b"*1\r\n$5\r\nMULTI\r\n*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n"
                    b"$1\r\n0\r\n$%d\r\n%s\r\n" % (len(key), key, len(last), last))

        olds: list[bytes | None] = []
        for _ in range(self._send_sets(items, px, begin, b"*1\r\n$4\r\nEXEC\r\n")):
            for _ in range(3):  # MULTI's +OK, then +QUEUED twice
                self._status()
            line = self._line(64)
            if line.startswith(b"-"):
                raise self._error(line)
            if line != b"*2":
                raise ConnectionError(f"unexpected reply {line[:20]!r} to EXEC")
            n = self.reply_size()
            old = bytearray(max(n, 0))
            self._fill(memoryview(old))
            self.skip(2)
            self._status()  # the SET's +OK (or its error)
            olds.append(bytes(old) if old else None)
        return olds

    def _status(self) -> None:
        """Read a status reply; raise on an error reply."""
        line = self._line(64)
        if line.startswith(b"-"):
            raise self._error(line)

    def skip(self, n: int) -> None:
        """Read ``n`` bytes of the stream and drop them."""
        scratch = memoryview(self._small)
        while n > 0:
            take = min(n, len(scratch))
            self._fill(scratch[:take])
            n -= take

    def send_gets(self, names: Sequence[str]) -> None:
        """Send ``GET`` for every name at once (pipelined); the caller then reads each reply
        in order: :meth:`reply_size`, then :meth:`read_into` / :meth:`skip` its value and
        :meth:`skip` (2) its CRLF."""
        out = []
        for name in names:
            raw = name.encode("utf-8")
            out.append(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(raw), raw))
        self._sock.sendall(b"".join(out))

    def reply_size(self) -> int:
        """The size of the next bulk reply's value (-1: null); raises on an error reply.
        Reads the reply line in small pieces, so the value lands where the caller says."""
        line = self._line(64)
        if line.startswith(b"-"):
            raise self._error(line)
        if not line.startswith(b"$"):
            raise ConnectionError(f"unexpected reply {line[:20]!r}")
        return int(line[1:])

    def read_into(self, view: memoryview) -> None:
        """The next ``len(view)`` bytes of the stream into ``view``."""
        self._fill(view)

    def get_into(self, key: str, view: memoryview) -> bool:
        """GET ``key`` into ``view`` (which must be exactly the value's size).

        Returns False when the key does not exist; raises :class:`CorruptObjectError` (and the
        connection must be dropped) when the value has another size.
        """
        self.send_gets([key])
        n = self.reply_size()
        if n < 0:
            return False
        if n != len(view):
            raise CorruptObjectError(f"{key!r}: value of {n} bytes, expected {len(view)}")
        self._fill(view)
        self.skip(2)
        return True


class BulkPool:
    """A bounded pool of :class:`BulkConnection` (one per part-fetching thread)."""

    def __init__(self, config: ValkeyStoreConfig) -> None:
        self._config = config
        self._idle: list[BulkConnection] = []
        self._lock = threading.Lock()

    @contextmanager
    def connection(self) -> Iterator[BulkConnection]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = BulkConnection(self._config)
        try:
            yield conn
        except BaseException:
            conn.close()  # its stream position is unknown now
            raise
        with self._lock:
            self._idle.append(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
