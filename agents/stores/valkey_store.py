"""Valkey (or Redis) as the hot tier: striped values fetched in parallel over several
connections, pipelined batches, key prefix and TTL, standalone or cluster, TLS and AUTH.

Layout of one object under ``key`` (``P`` = ``key_prefix``)::

    P h:<key>                 the head: the encoded header, then either the whole payload
                              (an object of at most one part) or the 8-byte version tag of
                              a striped object
    P v:<key>:<tag>:<i>       payload part i (``part_bytes`` each) of the version ``tag``
                              (16 hex digits) when the object has several parts

Objects are immutable once published. A put draws a fresh random tag, writes the new
version's parts under it, then swaps the head (``SET ... GET``) and only then deletes the
parts of the head it replaced. A reader that read a head therefore either finds every part
of that version, or finds one gone (replaced and cleaned up, evicted, expired) and misses
cleanly; it never mixes two versions. A read that finds a part gone or a checksum failure
deletes nothing unless the head is still the very one it read (compare-and-delete in one
small Lua script); a newer version is never touched. A missing part whose head changed
under the reader is retried once with the new head. Explicit deletes take the head with
``GETDEL``, so exactly one caller cleans each version's parts.

Fill leases (read-through promotion that an overwrite always wins): a reader that missed
takes a *lease* on the key before it reads the durable tier: ``SET P h:<key> <marker> NX``,
the marker being :data:`LEASE_MAGIC` and a random token, which every reader answers as a
miss. Its fill publishes the copy only if the head still holds that very marker (a small Lua
script). Any put (the head swapped) or delete (``GETDEL``) since the lease replaced the
marker, and an expired or evicted marker is absent, so a fill never lands over, or after, a
newer version. The marker lives in the head key itself, so the check touches one key (one
cluster slot) and a put pays nothing for it.

Parts of one object hash to different cluster slots on purpose: a large object is then
spread over every shard and read from all of them at once.

Layout change (issue 15): striped objects used to be ``P p:<key>:<i>``, overwritten in
place. A striped head written in that old layout (no tag after its header) reads as a miss;
the next put of the key replaces it and deletes its old parts.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvprefetch.agents.stores.base import (
    Buffer,
    CancelToken,
    GetResult,
    KeyPool,
    MemorySink,
    OpResult,
    PayloadSink,
    StatsCounter,
    StoreLifecycle,
    check_cancel,
)
from kvprefetch.agents.stores.errors import (
    CorruptObjectError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreConfigError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
    TierFullError,
)
from kvprefetch.agents.stores.format import (
    MAX_KEY_BYTES,
    PREFIX_BYTES,
    ObjectHeader,
    decode_header,
    header_length,
    make_header,
    part_count,
    part_digest,
    validate_key,
)

log = logging.getLogger(__name__)
MIB = 1 << 20
#: Bytes of the version tag that follows a striped object's header in its head.
TAG_BYTES = 8

#: The first bytes of a fill lease's marker in a head (never the start of an object).
LEASE_MAGIC = b"KVPL"
#: Random bytes after :data:`LEASE_MAGIC` in a marker: tells one reader's lease from another's.
LEASE_TOKEN_BYTES = 16

#: Publish a fill: set KEYS[1] to ARGV[2] (PX ARGV[3] unless empty) only if it still holds
#: the lease marker ARGV[1]; 1 if set.
_FILL_IF_LEASED = """
if redis.call('STRLEN', KEYS[1]) ~= string.len(ARGV[1])
    or redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 1
"""

#: Compare-and-delete: delete KEYS[1] only if it still holds ARGV[1]; 1 if deleted.
_DELETE_IF_UNCHANGED = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


@dataclass(frozen=True, slots=True)
class _Head:
    """One head as read: its raw value (what compare-and-delete compares), its header, and
    the version tag of a striped object's parts (None when the payload is in the head)."""

    raw: bytes
    header: ObjectHeader
    tag: str | None


class ValkeyStoreConfig(BaseModel):
    """Where the Valkey hot tier is and how to talk to it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(6379, gt=0, lt=65536)
    #: Cluster mode: ``startup_nodes`` as ``host:port``; defaults to ``host:port``.
    cluster: bool = False
    startup_nodes: tuple[str, ...] = ()
    db: int = Field(0, ge=0)
    username: str | None = None
    password: SecretStr | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    key_prefix: str = "kvp:"
    #: Expire every key written after this long; None keeps them until evicted.
    ttl_s: float | None = Field(None, gt=0)
    #: Stripe size: objects larger than this are split into parts fetched in parallel.
    #: 4 MiB: large enough that per-request overhead is small, small enough to keep the
    #: client parser's buffers cheap (a plain GET loop slows down 3x at 32 MiB values).
    part_bytes: int = Field(4 * MIB, ge=4096, le=512 * MIB)
    #: Connections (and part-fetching threads) to the server.
    connections: int = Field(4, ge=1, le=256)
    max_object_bytes: int = Field(8 << 30, gt=0)
    #: Receive stripes straight into the destination (standalone mode only); see
    #: ``_BulkConnection``. Off = every value goes through valkey-py.
    direct_reads: bool = True
    #: With ``direct_reads``: read the parts of all of a ``get``'s striped objects on this
    #: many connections, one thread each (the calling thread takes the first); 0 = object
    #: by object on the ``connections`` pool, each object's parts on up to ``connections``
    #: lanes (for a few large objects). 1 suits many small striped objects: no thread
    #: hand-off per object or part (the LMCache adapter's default).
    get_lanes: int = Field(0, ge=0, le=256)
    connect_timeout_s: float = Field(1.0, gt=0)
    socket_timeout_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _check_tls(self) -> ValkeyStoreConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        return self


@contextmanager
def translate_valkey_errors(what: str) -> Iterator[None]:
    """Translate valkey-py exceptions into :mod:`kvprefetch.agents.stores.errors` (the store
    edge)."""
    import valkey.exceptions as vex

    try:
        yield
    except StoreError:
        raise
    except vex.AuthenticationError as exc:
        raise StoreConfigError(f"valkey {what}: authentication failed: {exc}") from exc
    except vex.TimeoutError as exc:
        raise StoreTimeoutError(f"valkey {what}: timed out: {exc}") from exc
    except vex.ConnectionError as exc:
        raise StoreConnectionError(f"valkey {what}: connection failed: {exc}") from exc
    except vex.ResponseError as exc:
        msg = str(exc)
        if msg.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            raise StoreConfigError(f"valkey {what}: {msg}") from exc
        if msg.startswith("OOM"):
            raise TierFullError(f"valkey {what}: server out of memory: {msg}") from exc
        raise StoreError(f"valkey {what}: {msg}") from exc
    except vex.ValkeyError as exc:
        raise StoreConnectionError(f"valkey {what}: {exc}") from exc
    except OSError as exc:
        raise StoreConnectionError(f"valkey {what}: {exc}") from exc


class _BulkConnection:
    """A minimal RESP connection that reads a GET reply straight into caller memory.

    valkey-py's parsers return each value as a new ``bytes`` object (one copy more than the
    kernel's); for multi-MiB stripes on a CPU-bound node that copy is a third of the work.
    This reader receives the value with ``recv_into`` into the destination (a mapped local
    tier file), so the only copy is the kernel's. It speaks just enough RESP2 for AUTH,
    SELECT and GET; everything else goes through valkey-py.
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
        (``sendmsg`` with every buffer). Two ``sendall`` calls put the small command line in
        a segment of its own (``TCP_NODELAY``), a wake-up of the server for 30-odd bytes per
        value: ~10-20% more Valkey CPU per stored GiB, measured with 1-4 MiB values."""
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


class _BulkPool:
    """A bounded pool of :class:`_BulkConnection` (one per part-fetching thread)."""

    def __init__(self, config: ValkeyStoreConfig) -> None:
        self._config = config
        self._idle: list[_BulkConnection] = []
        self._lock = threading.Lock()

    @contextmanager
    def connection(self) -> Iterator[_BulkConnection]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = _BulkConnection(self._config)
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


class ValkeyStore(StoreLifecycle):
    """The Valkey hot tier (see the module docstring for the key layout)."""

    def __init__(self, config: ValkeyStoreConfig, *, name: str = "valkey") -> None:
        self.config = config
        self.name = name
        self._client: Any = None
        self._parts = KeyPool(config.connections, f"{name}-part")
        self._keys = KeyPool(max(2, config.connections // 2), f"{name}-key")
        self._stats = StatsCounter()
        self._lock = threading.Lock()
        self._bulk = _BulkPool(config)
        self._delete_if_unchanged: Any = None
        self._fill_if_leased: Any = None
        #: Bytes of a replaced head read back on a put: room for the header and tag of the
        #: largest object this store writes (or 64 KiB: 8,000-odd parts, for other writers).
        max_parts = -(-config.max_object_bytes // config.part_bytes)
        self._peek = max(64 * 1024, PREFIX_BYTES + MAX_KEY_BYTES + 8 * max_parts + 8 + TAG_BYTES)

    # -- lifecycle ---------------------------------------------------------------------------

    def _client_kwargs(self) -> dict[str, Any]:
        c = self.config
        kw: dict[str, Any] = {
            "username": c.username,
            "password": c.password.get_secret_value() if c.password else None,
            "socket_connect_timeout": c.connect_timeout_s,
            "socket_timeout": c.socket_timeout_s,
            "socket_keepalive": True,
        }
        if c.tls:
            import ssl

            kw.update(
                ssl=True,
                ssl_ca_certs=c.tls_ca_file,
                ssl_certfile=c.tls_cert_file,
                ssl_keyfile=c.tls_key_file,
                ssl_cert_reqs=ssl.CERT_REQUIRED if c.tls_verify else ssl.CERT_NONE,
            )
        return kw

    def start(self) -> None:
        """Connect and check the server answers (and that the credentials are right).

        Raises :class:`StoreConfigError` (bad credentials, bad TLS files) or
        :class:`StoreConnectionError` (nothing listening at the endpoint).
        """
        import valkey
        from valkey.cluster import ClusterNode, ValkeyCluster

        c = self.config
        kw = self._client_kwargs()
        where = f"{c.host}:{c.port}"
        with translate_valkey_errors(f"connect to {where}"):
            if c.cluster:
                nodes = [n.rsplit(":", 1) for n in (c.startup_nodes or (where,))]
                client: Any = ValkeyCluster(
                    startup_nodes=[ClusterNode(h, int(p)) for h, p in nodes],
                    max_connections=c.connections + 4,
                    **kw,
                )
            else:
                if c.tls:
                    kw.pop("ssl")
                    kw["connection_class"] = valkey.SSLConnection
                pool = valkey.BlockingConnectionPool(
                    host=c.host, port=c.port, db=c.db, max_connections=c.connections + 4,
                    timeout=c.socket_timeout_s, **kw,
                )
                client = valkey.Valkey(connection_pool=pool)
            try:
                client.ping()
            except Exception:
                client.close()
                raise
        self._client = client
        # Registered here (no I/O: loaded on first use, re-sent after NOSCRIPT).
        self._delete_if_unchanged = client.register_script(_DELETE_IF_UNCHANGED)
        self._fill_if_leased = client.register_script(_FILL_IF_LEASED)
        log.info("valkey store %s connected to %s", self.name, where)

    def close(self) -> None:
        self._parts.close()
        self._keys.close()
        self._bulk.close()
        client, self._client = self._client, None
        if client is not None:
            client.close()

    @property
    def client(self) -> Any:
        """The valkey-py client (for tests and the benchmark's raw baseline)."""
        if self._client is None:
            raise StoreConfigError(f"store {self.name!r} is not started")
        return self._client

    # -- key layout --------------------------------------------------------------------------

    def head_key(self, key: str) -> str:
        return f"{self.config.key_prefix}h:{key}"

    def _part_name(self, key: str, tag: str, index: int) -> str:
        return f"{self.config.key_prefix}v:{key}:{tag}:{index}"

    def _old_part_name(self, key: str, index: int) -> str:
        """A part in the layout before version tags (only ever deleted now)."""
        return f"{self.config.key_prefix}p:{key}:{index}"

    def part_key(self, key: str, index: int, tag: str | None = None) -> str:
        """The Valkey key of part ``index`` of version ``tag`` of ``key``. Without ``tag``
        (tools, tests, the benchmark), the current head is read once to learn it; raises
        :class:`ObjectNotFoundError` when the key holds no striped object."""
        if tag is None:
            tag = self._current(key).tag
            if tag is None:
                raise ObjectNotFoundError(f"{key!r}: not a striped object in {self.name}")
        return self._part_name(key, tag, index)

    def physical_keys(self, header: ObjectHeader, tag: str | None = None) -> list[str]:
        """Every Valkey key that holds part of the object (head first). Without ``tag`` the
        current head is read once; it must still be the version ``header`` describes."""
        keys = [self.head_key(header.key)]
        if header.parts > 1:
            if tag is None:
                current = self._current(header.key)
                if current.header != header or current.tag is None:
                    raise ObjectNotFoundError(f"{header.key!r}: replaced by another version")
                tag = current.tag
            keys += [self._part_name(header.key, tag, i) for i in range(header.parts)]
        return keys

    def _current(self, key: str) -> _Head:
        with translate_valkey_errors("get"):
            raw = self.client.get(self.head_key(key))
        if raw is None:
            raise ObjectNotFoundError(f"{key!r} not in {self.name}")
        return self._parse_head(key, raw)

    def _parse_head(self, key: str, raw: bytes) -> _Head:
        """Decode a head. Raises :class:`CorruptObjectError` for a damaged one and
        :class:`ObjectNotFoundError` for a striped head of the old layout (no tag) and for
        a fill lease's marker."""
        if raw[: len(LEASE_MAGIC)] == LEASE_MAGIC:
            raise ObjectNotFoundError(f"{key!r}: not in {self.name} (a fill is pending)")
        header = decode_header(raw, expected_key=key)
        rest = len(raw) - header.header_bytes
        if header.parts <= 1:
            return _Head(raw, header, None)
        if rest == TAG_BYTES:
            return _Head(raw, header, raw[header.header_bytes :].hex())
        if rest == 0:
            raise ObjectNotFoundError(f"{key!r}: written in the old layout (no version tag)")
        raise CorruptObjectError(f"{key!r}: striped head carries {rest} bytes after its header")

    def _parts_of(self, key: str, raw: bytes | None) -> list[str]:
        """The part keys of the object whose head value is ``raw`` (nothing for a head that
        is gone, damaged or holds its payload itself)."""
        if raw is None:
            return []
        try:
            header = decode_header(raw, expected_key=key)
        except CorruptObjectError:
            return []
        rest = len(raw) - header.header_bytes
        if header.parts <= 1:
            return []
        if rest == TAG_BYTES:
            tag = raw[header.header_bytes :].hex()
            return [self._part_name(key, tag, i) for i in range(header.parts)]
        if rest == 0:
            return [self._old_part_name(key, i) for i in range(header.parts)]
        return []

    def _delete_names(self, names: Sequence[str]) -> None:
        if not names:
            return
        with translate_valkey_errors("delete parts"):
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.delete(n)
            pipe.execute()

    def _px(self, ttl_s: float | None) -> int | None:
        ttl = ttl_s if ttl_s is not None else self.config.ttl_s
        return max(1, round(ttl * 1000)) if ttl is not None else None

    # -- exists ------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        check_cancel(cancel)
        try:
            with translate_valkey_errors("exists"):
                pipe = self.client.pipeline(transaction=False)
                for k in keys:  # the first bytes: a fill lease's marker is no object
                    pipe.getrange(self.head_key(k), 0, len(LEASE_MAGIC) - 1)
                answers = pipe.execute()
        except StoreError as exc:
            return [OpResult(k, False, exc) for k in keys]
        return [OpResult(k, bool(a) and a != LEASE_MAGIC)
                for k, a in zip(keys, answers, strict=True)]

    # -- get ---------------------------------------------------------------------------------

    def _heads(self, keys: Sequence[str]) -> list[bytes | StoreError | None]:
        try:
            with translate_valkey_errors("get"):
                if len(keys) == 1:
                    return [self.client.get(self.head_key(keys[0]))]
                pipe = self.client.pipeline(transaction=False)
                for k in keys:
                    pipe.get(self.head_key(k))
                return list(pipe.execute())
        except StoreError as exc:
            return [exc] * len(keys)

    def get(
        self,
        keys: Sequence[str],
        *,
        sink: PayloadSink | None = None,
        cancel: CancelToken | None = None,
    ) -> list[GetResult]:
        """Fetch ``keys``: heads in one pipelined round trip, then every part of the striped
        ones. With ``direct_reads``, an object held inline in its head is received straight
        into the sink; with ``get_lanes`` too, the parts of every striped object are read on
        that many connections (the calling thread takes the first), straight into the sink,
        and any object that goes wrong there (a part gone, damaged, a lane's connection
        lost) is read again alone by the checked path (which re-reads a replaced head and
        drops damage)."""
        check_cancel(cancel)
        keep = sink is None
        use = sink if sink is not None else MemorySink()
        out: list[GetResult | bytes | StoreError | None]
        if self.config.direct_reads and not self.config.cluster and keys:
            out = self._heads_direct(keys, use, keep)
            striped = []
            for i, (key, raw) in enumerate(zip(keys, out, strict=True)):
                if isinstance(raw, bytes) and self.config.get_lanes:
                    with contextlib.suppress(StoreError):  # the checked path decides
                        head = self._parse_head(key, raw)
                        if head.tag is not None:
                            striped.append((i, head))
            if striped:
                for i, result in self._fetch_striped(striped, use, keep, cancel).items():
                    out[i] = result
        else:
            out = list(self._heads(keys))
        rest = [(i, k, h) for i, (k, h) in enumerate(zip(keys, out, strict=True))
                if not isinstance(h, GetResult)]
        if len(rest) == 1:
            i, k, h = rest[0]
            out[i] = self._get_one(k, h, use, keep, cancel)
        elif rest:
            futures = [(i, self._keys.submit(partial(self._get_one, k, h, use, keep, cancel)))
                       for i, k, h in rest]
            for i, f in futures:
                out[i] = f.result()
        return [self._stats.count_get(r) for r in out]  # type: ignore[arg-type]

    def _fetch_striped(self, heads: list[tuple[int, _Head]], sink: PayloadSink, keep: bool,
                       cancel: CancelToken | None) -> dict[int, GetResult]:
        """The parts of every object in ``heads`` (``(index, head)``) over up to
        ``get_lanes`` lanes (this thread takes the first), each lane one ``GET`` at a time,
        each part received straight into its object's writer and verified. Returns the
        result of every object read whole or whose writer could not open; the others'
        writers are aborted and they are left out (for the checked path).

        One GET at a time: sending a lane's GETs all at once made Valkey queue the replies
        in its output buffers, ~3x its CPU per GiB (0.94-1.01 against 0.31-0.35 s, loads of
        32 x 4 MiB through the LMCache adapter)."""
        out: dict[int, GetResult] = {}
        writers: dict[int, Any] = {}
        for i, head in heads:
            try:
                writers[i] = sink.open(head.header)
            except StoreError as exc:
                out[i] = GetResult(head.header.key, header=head.header, error=exc)
        if not writers:
            return out
        by_index = dict(heads)
        jobs = [(i, j) for i in writers for j in range(by_index[i].header.parts)]
        failed: set[int] = set()

        def lane(chunk: list[tuple[int, int]]) -> None:
            at = 0
            try:
                with translate_valkey_errors("get part"), self._bulk.connection() as conn:
                    for i, j in chunk:
                        check_cancel(cancel)
                        head = by_index[i]
                        conn.send_gets([self._part_name(head.header.key, head.tag or "", j)])
                        if not self._receive_part(conn, head.header, j, writers[i]):
                            failed.add(i)
                        at += 1
            except StoreError:
                failed.update(i for i, _ in chunk[at:])

        lanes = max(1, min(self.config.get_lanes, len(jobs)))
        chunks = [jobs[n::lanes] for n in range(lanes)]
        futures = [self._parts.submit(partial(lane, c)) for c in chunks[1:]]
        try:
            lane(chunks[0])
        finally:
            wait(futures)  # nothing may write into the writers after this returns
        for f in futures:
            f.result()
        for i, writer in writers.items():
            header = by_index[i].header
            if i in failed:
                writer.abort()
                continue
            try:
                writer.commit()
            except StoreError as exc:
                writer.abort()
                out[i] = GetResult(header.key, header=header, error=exc)
                continue
            data = memoryview(writer.buffer) if keep and hasattr(writer, "buffer") else None
            out[i] = GetResult(header.key, header=header, data=data, source=self.name)
        return out

    @staticmethod
    def _receive(conn: _BulkConnection, writer: Any, start: int, size: int,
                 verify: Callable[[memoryview], None]
                 ) -> tuple[bytes, CorruptObjectError] | None:
        """Receive the next ``size`` bytes of ``conn``'s current bulk reply (and its CRLF)
        into ``writer`` at ``start`` (straight into its memory where it offers a target),
        checked by ``verify``. None: written; else the bytes and what ``verify`` raised
        (nothing was written)."""
        view = writer.target(start, size) if size else None
        data = view if view is not None else memoryview(bytearray(size))
        try:
            conn.read_into(data)
            conn.skip(2)
            try:
                verify(data)
            except CorruptObjectError as exc:
                return bytes(data), exc
            if view is None:
                if size:
                    writer.write_at(start, data)
            else:
                writer.written(start, size)
        finally:
            if view is not None:
                view.release()
        return None

    def _receive_part(self, conn: _BulkConnection, header: ObjectHeader, index: int,
                      writer: Any) -> bool:
        """Receive the next reply of ``conn``, part ``index`` of ``header``'s object, into
        ``writer``; False (the bytes read and dropped) when it is gone, of another size or
        damaged."""
        start, end = header.part_range(index)
        n = conn.reply_size()
        if n != end - start:
            if n >= 0:
                conn.skip(n + 2)
            return False
        return self._receive(conn, writer, start, n, partial(header.verify_part, index)) is None

    def _heads_direct(self, keys: Sequence[str], sink: PayloadSink, keep: bool
                      ) -> list[GetResult | bytes | StoreError | None]:
        """Every head, ``GET`` pipelined on one bulk connection. An inline object is
        received straight into its writer and comes back as its :class:`GetResult`; any
        other head comes back as its value (None: absent; a :class:`StoreError`: the
        connection failed before it) for :meth:`_get_one`. One connection, not lanes: the
        heads of striped objects are small, and lanes for them queued behind the part
        fetches (4 MiB loads 1,618 against 1,926 MiB/s median, two consecutive runs of
        ``kvprefetch bench lmcache``); callers that read many inline objects at once split
        their keys (the LMCache adapter's ``load_batch_keys``)."""
        out: list[GetResult | bytes | StoreError | None] = [None] * len(keys)
        done = 0
        try:
            with translate_valkey_errors("get"), self._bulk.connection() as conn:
                conn.send_gets([self.head_key(k) for k in keys])
                for i, key in enumerate(keys):
                    out[i] = self._read_head(conn, key, sink, keep)
                    done += 1
        except StoreError as exc:
            out[done:] = [exc] * (len(keys) - done)
        return out

    def _read_head(self, conn: _BulkConnection, key: str, sink: PayloadSink, keep: bool
                   ) -> GetResult | bytes | None:
        """Read the next reply of ``conn``, the head of ``key``: an inline object goes
        straight into its writer (verified); a striped head or one that does not decode
        comes back as bytes, whole."""
        n = conn.reply_size()
        if n < 0:
            return None
        head = bytearray(min(n, PREFIX_BYTES))
        conn.read_into(memoryview(head))
        header = None
        try:
            length = min(n, header_length(head))
            head += bytes(length - len(head))
            conn.read_into(memoryview(head)[PREFIX_BYTES:])
            header = decode_header(head, expected_key=key)
        except CorruptObjectError:
            pass
        if header is None or header.parts > 1 or n != len(head) + header.payload_bytes:
            rest = bytearray(n - len(head))
            conn.read_into(memoryview(rest))
            conn.skip(2)
            return bytes(head + rest)
        try:
            writer = sink.open(header)
        except StoreError as exc:
            conn.skip(header.payload_bytes + 2)
            return GetResult(key, header=header, error=exc)
        try:
            damaged = self._receive(conn, writer, 0, header.payload_bytes,
                                    header.verify_payload)
            if damaged is not None:
                bad, error = damaged
                writer.abort()
                self._drop_if_unchanged(key, bytes(head) + bad, None, error)
                return GetResult(key, header=header, error=error)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        data = memoryview(writer.buffer) if keep and hasattr(writer, "buffer") else None
        return GetResult(key, header=header, data=data, source=self.name)

    def _get_one(
        self,
        key: str,
        raw: bytes | StoreError | None,
        sink: PayloadSink,
        keep: bool,
        cancel: CancelToken | None,
    ) -> GetResult:
        result = self._read_version(key, raw, sink, keep, cancel)
        if isinstance(result, GetResult):
            return result
        # A part vanished because a writer replaced the head meanwhile: read the new one.
        try:
            with translate_valkey_errors("get"):
                raw = self.client.get(self.head_key(key))
        except StoreError as exc:
            raw = exc
        again = self._read_version(key, raw, sink, keep, cancel)
        return again if isinstance(again, GetResult) else GetResult(key, error=again)

    def _read_version(
        self,
        key: str,
        raw: bytes | StoreError | None,
        sink: PayloadSink,
        keep: bool,
        cancel: CancelToken | None,
    ) -> GetResult | ObjectNotFoundError:
        """Read the version whose head is ``raw``; an :class:`ObjectNotFoundError` returned
        (not in a result) means a part was gone and the head had changed since it was read:
        the caller may read the new head."""
        if isinstance(raw, StoreError):
            return GetResult(key, error=raw)
        if raw is None:
            return GetResult(key, error=ObjectNotFoundError(f"{key!r} not in {self.name}"))
        try:
            head = self._parse_head(key, raw)
        except CorruptObjectError as exc:
            self._drop_if_unchanged(key, raw, None, exc)
            return GetResult(key, error=exc)
        except ObjectNotFoundError as exc:  # the old layout: a miss, left alone
            return GetResult(key, error=exc)
        header = head.header
        try:
            writer = sink.open(header)
        except StoreError as exc:
            return GetResult(key, header=header, error=exc)
        try:
            if header.parts <= 1:
                inline = memoryview(raw)[header.header_bytes :]
                header.verify_payload(inline)
                if header.parts:
                    writer.write_at(0, inline)
            else:
                self._fetch_parts(head, writer, cancel)
            writer.commit()
        except CorruptObjectError as exc:
            writer.abort()
            self._drop_if_unchanged(key, raw, head, exc)
            return GetResult(key, header=header, error=exc)
        except ObjectNotFoundError as exc:
            writer.abort()
            if self._drop_if_unchanged(key, raw, head, exc) is False:
                return exc  # replaced while read: not broken, just gone
            return GetResult(key, header=header, error=exc)
        except StoreError as exc:
            writer.abort()
            return GetResult(key, header=header, error=exc)
        except BaseException:
            writer.abort()
            raise
        data = None
        if keep:
            data = memoryview(writer.buffer) if hasattr(writer, "buffer") else None
        return GetResult(key, header=header, data=data, source=self.name)

    def _fetch_parts(self, head: _Head, writer: Any, cancel: CancelToken | None) -> None:
        client = self.client
        header, tag = head.header, head.tag
        assert tag is not None  # a striped head always has one (see _parse_head)

        direct = self.config.direct_reads and not self.config.cluster

        def fetch(index: int) -> None:
            check_cancel(cancel)
            start, end = header.part_range(index)
            name = self._part_name(header.key, tag, index)
            view = writer.target(start, end - start) if direct else None
            if view is not None:
                try:
                    with translate_valkey_errors("get part"), self._bulk.connection() as conn:
                        found = conn.get_into(name, view)
                    if not found:
                        raise ObjectNotFoundError(f"{header.key!r}: part {index} is gone")
                    header.verify_part(index, view)
                finally:
                    view.release()
                writer.written(start, end - start)
                return
            with translate_valkey_errors("get part"):
                value = client.get(name)
            if value is None:
                raise ObjectNotFoundError(f"{header.key!r}: part {index} is gone")
            header.verify_part(index, value)
            writer.write_at(start, value)

        # Lanes: the calling thread and up to ``connections - 1`` pool threads each take the
        # next part until none is left, so a chunk costs at most that many thread hand-offs
        # (not one per part) and the caller fetches instead of waiting.
        next_part = itertools.count()
        failed = threading.Event()

        def lane() -> None:
            try:
                while not failed.is_set():
                    i = next(next_part)
                    if i >= header.parts:
                        return
                    fetch(i)
            except BaseException:
                failed.set()  # the other lanes stop after the part they are on
                raise

        helpers = min(self.config.connections, header.parts) - 1
        futures: list[Future[None]] = [self._parts.submit(lane) for _ in range(helpers)]
        try:
            lane()
        finally:
            if failed.is_set():
                for f in futures:
                    f.cancel()
            wait(futures)  # nothing may write into the destination after this returns
        for f in futures:
            if not f.cancelled():
                f.result()

    def _drop_if_unchanged(self, key: str, raw: bytes, head: _Head | None,
                           exc: StoreError) -> bool | None:
        """Delete a broken object, but only if its head is still ``raw`` (compare-and-delete),
        then its parts. True: dropped; False: the head had changed (a newer version, never
        touched); None: the check itself failed (nothing deleted)."""
        try:
            with translate_valkey_errors("drop broken object"):
                dropped = bool(self._delete_if_unchanged(keys=[self.head_key(key)], args=[raw]))
            if dropped and head is not None and head.tag is not None:
                self._delete_names([self._part_name(key, head.tag, i)
                                    for i in range(head.header.parts)])
        except StoreError as err:
            log.warning("%s: broken object %r not dropped (%s): %s", self.name, key, err, exc)
            return None
        if dropped:
            log.warning("%s: broken object %r dropped: %s", self.name, key, exc)
        return dropped

    # -- put ---------------------------------------------------------------------------------

    def put(
        self,
        items: Sequence[tuple[str, Buffer]],
        *,
        ttl_s: float | None = None,
        cancel: CancelToken | None = None,
    ) -> list[OpResult]:
        """Store each ``(key, payload)``; raises :class:`ObjectTooLargeError` before writing
        anything if any payload exceeds ``max_object_bytes``."""
        limit = self.config.max_object_bytes
        for key, payload in items:
            validate_key(key)
            if len(payload) > limit:
                raise ObjectTooLargeError(
                    f"{key!r}: {len(payload)} bytes exceed max_object_bytes={limit}"
                )
        check_cancel(cancel)
        px = self._px(ttl_s)
        if not self.config.cluster:
            return self._put_pipelined(items, px, cancel)
        return self._keys.map(lambda item: self._put_one(item[0], item[1], px, cancel), items)

    def repair(self, items: Sequence[tuple[str, Buffer]], *, ttl_s: float | None = None
               ) -> list[OpResult]:
        """Write good copies (from another tier) of objects found broken here, each only
        where the key holds nothing now (the broken head was dropped): a version written
        meanwhile is never replaced (``ok`` False then)."""
        px = self._px(ttl_s)
        for key, _ in items:
            validate_key(key)
        return self._keys.map(lambda it: self._put_one(it[0], it[1], px, None, absent=True),
                              items)

    def lease(self, keys: Sequence[str], *, ttl_s: float) -> list[bytes | None]:
        """Take a fill lease on each key that holds nothing (one pipelined round trip):
        its marker, to pass to :meth:`fill`, or None (the key holds an object or another
        reader's lease, or Valkey failed). Called by a tiered store for the keys a read
        missed, before it reads them from the durable tier. The marker answers as a miss
        and expires after ``ttl_s``; a put or delete of the key replaces it."""
        if not keys:
            return []
        markers = [LEASE_MAGIC + os.urandom(LEASE_TOKEN_BYTES) for _ in keys]
        px = self._px(ttl_s)
        try:
            with translate_valkey_errors("lease"):
                pipe = self.client.pipeline(transaction=False)
                for k, marker in zip(keys, markers, strict=True):
                    pipe.set(self.head_key(k), marker, px=px, nx=True)
                taken = pipe.execute()
        except StoreError as exc:
            log.debug("%s: no fill leases for %d keys: %s", self.name, len(keys), exc)
            return [None] * len(keys)
        return [m if ok else None for m, ok in zip(markers, taken, strict=True)]

    def fill(self, items: Sequence[tuple[str, Buffer, bytes]], *, ttl_s: float | None = None
             ) -> list[OpResult]:
        """Publish copies read from the durable tier, ``(key, payload, lease marker)`` each,
        only where the key still holds that marker (see :meth:`lease`): ``ok`` False, and
        nothing left behind, when a put, a delete, an expiry or an eviction came first.
        Called from a tiered store's background threads; not idempotent (the lease is used
        up by a successful fill)."""
        px = self._px(ttl_s)
        for key, _, _ in items:
            validate_key(key)
        return self._keys.map(
            lambda it: self._put_one(it[0], it[1], px, None, lease=it[2]), items)

    @staticmethod
    def _new_version(header: ObjectHeader, view: memoryview) -> tuple[bytes, str | None]:
        """The head value of a new version and the tag of its parts (None: no parts)."""
        if header.parts <= 1:
            return header.encode() + bytes(view), None
        tag = os.urandom(TAG_BYTES)
        return header.encode() + tag, tag.hex()

    def _drop_replaced(self, replaced: Sequence[tuple[str, bytes | None]]) -> None:
        """Delete the parts of the versions new heads replaced (their readers miss cleanly),
        ``(key, old head)`` each, all in one pipelined round trip."""
        names = [n for key, old in replaced for n in self._parts_of(key, old)]
        try:
            self._delete_names(names)
        except StoreError as exc:
            log.warning("%s: parts of %d replaced versions (e.g. of %r) not dropped: %s",
                        self.name, len(replaced), replaced[0][0], exc)

    def _put_pipelined(self, items: Sequence[tuple[str, Buffer]], px: int | None,
                       cancel: CancelToken | None) -> list[OpResult]:
        """A batch in a few round trips: every part of every striped object and every
        inline object (its header, then its payload: one value) spread over ``connections``
        lanes, each lane one pipeline written straight from the payloads' memory; then the
        striped objects' heads in one pipeline (heads last as always). Every head is swapped
        in with :meth:`_BulkConnection.swap_many`, which hands back what it replaced.

        Each lane hashes a part or an inline payload just before it sends it (the bytes are
        then in cache for the send), so the first bytes go out at once and the hashing is
        spread over the lanes; the striped headers are built from those digests once every
        part is written. (Hashing whole objects first kept every lane waiting: ~10% of a
        32 x 4 MiB task, py-spy. Inline heads built as one ``bytes`` and sent on one valkey-py
        pipeline copied each payload twice and used one connection: 512 KiB objects were
        stored 4x slower than a plain pipelined SET.)"""
        part_bytes = self.config.part_bytes
        views = [memoryview(payload).cast("B") for _, payload in items]
        counts = [part_count(len(view), part_bytes) for view in views]
        tags = [os.urandom(TAG_BYTES).hex() if n > 1 else None for n in counts]
        digests: list[list[int]] = [[0] * n if n > 1 else [] for n in counts]
        headers: list[ObjectHeader | None] = [None] * len(items)
        olds: dict[int, bytes | None] = {}
        failed: dict[int, StoreError] = {}
        # Object-major, so that lanes finish objects in the order they were given; part -1
        # is an inline object (its head holds the payload).
        jobs = [(i, j) for i, n in enumerate(counts) for j in (range(n) if n > 1 else (-1,))]

        def lane(chunk: list[tuple[int, int]]) -> list[tuple[int, StoreError]]:
            def parts() -> Iterator[tuple[bytes, Sequence[memoryview]]]:
                for i, j in chunk:
                    if j >= 0:
                        start = j * part_bytes
                        part = views[i][start : start + part_bytes]
                        digests[i][j] = part_digest(part)
                        yield self._part_name(items[i][0], tags[i] or "", j).encode(), (part,)

            inline = [i for i, j in chunk if j < 0]

            def heads() -> Iterator[tuple[bytes, Sequence[memoryview]]]:
                for i in inline:
                    header = headers[i] = make_header(items[i][0], views[i], part_bytes)
                    yield (self.head_key(items[i][0]).encode(),
                           (memoryview(header.encode()), views[i]))
            try:
                check_cancel(cancel)
                with translate_valkey_errors("put"), self._bulk.connection() as conn:
                    if len(inline) < len(chunk):
                        conn.set_many(parts(), px)
                    if inline:
                        olds.update(zip(inline, conn.swap_many(heads(), px, self._peek),
                                        strict=True))
            except StoreError as exc:
                return [(i, exc) for i, _ in chunk]
            return []

        if jobs:
            lanes = min(self.config.connections, len(jobs))
            chunks = [jobs[n::lanes] for n in range(lanes)]
            futures = [self._parts.submit(partial(lane, c)) for c in chunks[1:]]
            try:
                errors = lane(chunks[0])
            finally:
                wait(futures)  # every lane is done with the payloads' memory
            for f in futures:
                errors += f.result()
            for i, exc in errors:
                failed.setdefault(i, exc)
        striped = [i for i, n in enumerate(counts) if n > 1 and i not in failed]
        for i in striped:
            headers[i] = ObjectHeader(key=items[i][0], payload_bytes=len(views[i]),
                                      part_bytes=part_bytes, digests=tuple(digests[i]))

        def striped_heads() -> Iterator[tuple[bytes, Sequence[memoryview]]]:
            for i in striped:
                head, tag = headers[i], tags[i]
                assert head is not None and tag is not None
                yield (self.head_key(head.key).encode(),
                       (memoryview(head.encode() + bytes.fromhex(tag)),))
        try:
            check_cancel(cancel)
            if striped:
                with translate_valkey_errors("put"), self._bulk.connection() as conn:
                    olds.update(zip(striped, conn.swap_many(striped_heads(), px, self._peek),
                                    strict=True))
        except StoreError as exc:
            for i in striped:
                failed[i] = exc
        # One round trip for every replaced version of the batch (it was one per key: ~15%
        # of a 32 x 4 MiB store task that overwrote, in py-spy samples of the task threads).
        self._drop_replaced([(items[i][0], old) for i, old in olds.items() if i not in failed])
        # A failed item's own parts go (never a head: that may be another writer's version).
        self._drop_own_parts([(ObjectHeader(key=items[i][0], payload_bytes=len(views[i]),
                                            part_bytes=part_bytes, digests=tuple(digests[i])),
                               tags[i]) for i in failed if tags[i] is not None])
        out = []
        for i, (key, _) in enumerate(items):
            if i in failed:
                self._stats.add(errors=1)
                out.append(OpResult(key, False, failed[i]))
            else:
                self._stats.add(puts=1, bytes_written=len(views[i]))
                out.append(OpResult(key, True))
        return out

    def _drop_own_parts(self, versions: Sequence[tuple[ObjectHeader, str | None]]) -> None:
        names = [self._part_name(h.key, tag, j)
                 for h, tag in versions if tag is not None for j in range(h.parts)]
        with contextlib.suppress(StoreError):
            self._delete_names(names)

    def _put_one(self, key: str, payload: Buffer, px: int | None, cancel: CancelToken | None,
                 *, absent: bool = False, lease: bytes | None = None) -> OpResult:
        view = memoryview(payload).cast("B")
        header = make_header(key, view, self.config.part_bytes)
        value, tag = self._new_version(header, view)
        try:
            if tag is not None:
                self._put_parts(header, tag, view, px, cancel)
            try:
                check_cancel(cancel)
                with translate_valkey_errors("put"):
                    if lease is not None:  # published only over the reader's own lease
                        old = None
                        args = [lease, value, "" if px is None else str(px)]
                        if not self._fill_if_leased(keys=[self.head_key(key)], args=args):
                            self._drop_own_parts([(header, tag)])
                            return OpResult(key, False)
                    elif absent:  # SET NX: published only where nothing is
                        old = None
                        if not self.client.set(self.head_key(key), value, px=px, nx=True):
                            self._drop_own_parts([(header, tag)])
                            return OpResult(key, False)
                    else:
                        # SET ... GET: the head is swapped and the replaced one read in
                        # one round trip (its parts are then dropped).
                        old = self.client.set(self.head_key(key), value, px=px, get=True)
            except BaseException:
                self._drop_own_parts([(header, tag)])
                raise
        except StoreError as exc:
            self._stats.add(errors=1)
            return OpResult(key, False, exc)
        self._drop_replaced([(key, old)])
        self._stats.add(puts=1, bytes_written=len(view))
        return OpResult(key, True)

    def _put_parts(self, header: ObjectHeader, tag: str, view: memoryview, px: int | None,
                   cancel: CancelToken | None) -> None:
        client = self.client

        def put(index: int) -> None:
            check_cancel(cancel)
            start, end = header.part_range(index)
            with translate_valkey_errors("put part"):
                client.set(self._part_name(header.key, tag, index), view[start:end], px=px)

        futures = [self._parts.submit(partial(put, i)) for i in range(header.parts)]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)
            self._drop_own_parts([(header, tag)])
            raise

    # -- delete ------------------------------------------------------------------------------

    def delete(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        """Delete ``keys``: each head taken with ``GETDEL`` (one pipelined round trip), so
        that exactly one caller deletes the parts of the version it took."""
        check_cancel(cancel)
        try:
            with translate_valkey_errors("delete"):
                pipe = self.client.pipeline(transaction=False)
                for k in keys:
                    pipe.getdel(self.head_key(k))
                olds = pipe.execute()
        except StoreError as exc:
            return [OpResult(k, False, exc) for k in keys]
        names = [n for k, old in zip(keys, olds, strict=True) for n in self._parts_of(k, old)]
        try:
            self._delete_names(names)
        except StoreError as exc:  # the heads are gone: the objects are, too
            log.warning("%s: parts of deleted objects not dropped: %s", self.name, exc)
        out = []
        for k, old in zip(keys, olds, strict=True):
            found = old is not None and old[: len(LEASE_MAGIC)] != LEASE_MAGIC
            if found:
                self._stats.add(deletes=1)
            out.append(OpResult(k, found))
        return out
