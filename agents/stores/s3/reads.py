"""The S3 store's read path: ranged GETs pinned to one version, received straight into the
caller's sink, each part verified by the thread that received it (see
:mod:`kvprefetch.agents.stores.s3.store` for the read contract)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, wait
from functools import partial
from typing import Any

from kvprefetch.agents.stores.base import (
    CancelToken,
    GetResult,
    KeyPool,
    MemorySink,
    MemoryWriter,
    PayloadSink,
    PayloadWriter,
    check_cancel,
)
from kvprefetch.agents.stores.errors import (
    CorruptObjectError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
)
from kvprefetch.agents.stores.format import (
    PREFIX_BYTES,
    ObjectHeader,
    decode_header,
    header_length,
)
from kvprefetch.agents.stores.s3.config import (
    ObjectChangedError,
    S3StoreConfig,
    translate_boto_errors,
)

log = logging.getLogger(__name__)
#: Reads started again because the object changed under them, before a clean miss.
_RESTARTS = 2
#: Quarantined keys remembered (most recent), for operators and tests.
QUARANTINE_KEEP = 256


class RangeBody:
    """The body of one ranged GET, read to its end or else closed (never reused half-read).

    With ``direct`` on and a plain length-delimited body (no content encoding), bytes are
    received with the HTTP response's own ``readinto``: the kernel's copy is the only one.
    Otherwise botocore's ``read`` is used and copied.
    """

    def __init__(self, key: str, resp: dict[str, Any], *, direct: bool) -> None:
        self.key = key
        self._body = resp["Body"]
        self.length = int(resp.get("ContentLength", -1))
        content_range = str(resp.get("ContentRange") or "")
        self.total = (int(content_range.rsplit("/", 1)[1]) if "/" in content_range
                      else self.length)
        self.etag: str | None = resp.get("ETag")
        self.consumed = 0
        raw: Any = getattr(self._body, "_raw_stream", None)
        fp: Any = getattr(raw, "_fp", None)
        self.direct = (
            direct and self.length >= 0 and fp is not None and hasattr(fp, "readinto")
            and hasattr(raw, "release_conn") and not resp.get("ContentEncoding")
            and type(self._body).__name__ == "StreamingBody"
        )
        self._raw, self._fp = raw, fp
        self._ok = False

    def __enter__(self) -> RangeBody:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None and self.consumed == self.length:
            if self.direct:
                self._raw.release_conn()  # read to its end: the connection is clean
            return
        with contextlib.suppress(Exception):
            self._body.close()

    def readinto(self, view: memoryview) -> None:
        """Fill ``view`` with the next ``len(view)`` bytes of the body."""
        length = len(view)
        if self.consumed + length > self.length:
            raise CorruptObjectError(f"{self.key!r}: response shorter than expected")
        if not self.direct:
            view[:] = self.read_exact(length)
            return
        got = 0
        try:
            while got < length:
                n = self._fp.readinto(view[got:])
                if not n:
                    raise StoreConnectionError(
                        f"s3 get {self.key!r}: connection closed after {self.consumed + got} "
                        f"of {self.length} bytes"
                    )
                got += n
        except TimeoutError as exc:
            raise StoreTimeoutError(f"s3 get {self.key!r}: timed out: {exc}") from exc
        except OSError as exc:
            raise StoreConnectionError(f"s3 get {self.key!r}: {exc}") from exc
        finally:
            self.consumed += got

    def read_exact(self, n: int) -> bytes:
        if n <= 0:
            return b""
        if self.direct:
            buf = bytearray(n)
            self.readinto(memoryview(buf))
            return bytes(buf)
        pieces: list[bytes] = []
        got = 0
        with translate_boto_errors("get"):
            while got < n:
                data = self._body.read(n - got)
                if not data:
                    raise StoreConnectionError(
                        f"s3 get {self.key!r}: response ended after {self.consumed + got} "
                        f"of {self.length} bytes"
                    )
                pieces.append(data)
                got += len(data)
        self.consumed += got
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def read_rest(self) -> bytes:
        """The rest of the body in one plain ``read()``."""
        with translate_boto_errors("get"):
            data = self._body.read()
        self.consumed += len(data)
        if self.length < 0:
            self.length = self.consumed
        elif self.consumed != self.length:
            raise StoreConnectionError(
                f"s3 get {self.key!r}: response ended after {self.consumed} of {self.length} "
                "bytes"
            )
        return bytes(data)

    def drain(self) -> None:
        """Read and drop the rest of the body."""
        left = self.length - self.consumed
        if left <= 0:
            return
        scratch = memoryview(bytearray(min(left, 1 << 20)))
        while left > 0:
            step = min(left, len(scratch))
            if self.direct:
                self.readinto(scratch[:step])
            else:
                self.read_exact(step)
            left -= step


class Quarantine:
    """Keys whose object failed verification twice in a row, with the ETag of that version
    (the last :data:`QUARANTINE_KEEP`). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, str] = OrderedDict()

    def add(self, key: str, etag: str) -> None:
        with self._lock:
            self._keys[key] = etag
            self._keys.move_to_end(key)
            while len(self._keys) > QUARANTINE_KEEP:
                self._keys.popitem(last=False)

    def etag(self, key: str) -> str | None:
        with self._lock:
            return self._keys.get(key)

    def release(self, key: str, etag: str) -> None:
        """Forget ``key`` if it is still quarantined as version ``etag``."""
        with self._lock:
            if self._keys.get(key) == etag:
                del self._keys[key]

    def keys(self) -> list[str]:
        """Most recent first."""
        with self._lock:
            return list(reversed(self._keys))


class S3Reader:
    """Reads objects for one :class:`~kvprefetch.agents.stores.s3.store.S3Store`.
    Thread-safe; ``requests`` is the store's pool of ranged GETs, ``client`` hands out its
    boto3 client."""

    def __init__(self, config: S3StoreConfig, name: str, client: Callable[[], Any],
                 quarantine: Quarantine, *, requests: KeyPool) -> None:
        self.config = config
        self.name = name
        self._client = client
        self._quarantine = quarantine
        self._requests = requests

    def _get_range(self, key: str, start: int, end: int, etag: str | None) -> dict[str, Any]:
        """Start a GET of bytes ``[start, end)``, pinned to version ``etag`` when given
        (``If-Match``; the answer's ETag is checked too, for servers that ignore it)."""
        extra = {"IfMatch": etag} if etag else {}
        with translate_boto_errors("get"):
            resp: dict[str, Any] = self._client().get_object(
                Bucket=self.config.bucket, Key=self.config.object_key(key),
                Range=f"bytes={start}-{end - 1}", **extra,
            )
        if etag and resp.get("ETag") not in (None, etag):
            with contextlib.suppress(Exception):
                resp["Body"].close()
            raise ObjectChangedError(f"s3 get {key!r}: the object changed")
        return resp

    def _range(self, key: str, start: int, end: int, etag: str | None = None
               ) -> tuple[bytes, int]:
        """Bytes ``[start, end)`` of the object (version ``etag``) and the object's size."""
        resp = self._get_range(key, start, end, etag)
        with translate_boto_errors("get"):
            body = resp["Body"]
            try:
                data = body.read()
            finally:
                body.close()
        content_range = resp.get("ContentRange") or ""
        total = int(content_range.rsplit("/", 1)[1]) if "/" in content_range else len(data)
        return data, total

    def _open_range(self, key: str, start: int, end: int, etag: str | None = None) -> RangeBody:
        """Start a ranged GET of bytes ``[start, end)`` (clipped to the object's end)."""
        return RangeBody(key, self._get_range(key, start, end, etag),
                     direct=self.config.direct_reads)

    def _range_into(self, key: str, start: int, view: memoryview, etag: str | None) -> None:
        """Bytes ``[start, start + len(view))`` of the object, received into ``view``."""
        body = self._open_range(key, start, start + len(view), etag)
        with body:
            if body.length != len(view):
                raise CorruptObjectError(
                    f"{key!r}: range of {body.length} bytes, expected {len(view)}"
                )
            body.readinto(view)

    def get_one(self, key: str, sink: PayloadSink | None, cancel: CancelToken | None
                 ) -> GetResult:
        """One object: started again when it changes mid-read, fetched again once when it
        fails verification; never deleted."""
        restarts = refetched = 0
        while True:
            result, etag = self._read_once(key, sink, cancel)
            err = result.error
            if isinstance(err, ObjectChangedError) and restarts < _RESTARTS:
                restarts += 1
                continue
            if isinstance(err, CorruptObjectError) and not refetched:
                refetched = 1
                continue
            if isinstance(err, CorruptObjectError):
                self._quarantine.add(key, etag or "")
                log.warning("%s: object %r failed verification twice; quarantined (kept, "
                            "answered as a miss): %s", self.name, key, err)
            return result

    def _read_once(self, key: str, sink: PayloadSink | None, cancel: CancelToken | None
                   ) -> tuple[GetResult, str | None]:
        """One attempt, and the ETag of the version it read (None if it got none)."""
        c = self.config
        header: ObjectHeader | None = None
        writer: PayloadWriter | None = None
        etag: str | None = None
        try:
            check_cancel(cancel)
            # The first range carries the header and the first parts. Its body is read as a
            # stream: the header first, then the whole parts it holds straight into the
            # writer's memory (when the writer offers it), then the rest is drained. Its
            # ETag pins every later range to the same version.
            body = self._open_range(key, 0, c.range_bytes)
            etag = body.etag
            with body:
                first = b""
                if body.direct:
                    prefix = body.read_exact(min(PREFIX_BYTES, body.length))
                    hlen = header_length(prefix)
                    head = prefix + body.read_exact(min(hlen, body.length) - len(prefix))
                else:  # one plain read of the whole range
                    first = body.read_rest()
                    hlen = header_length(first)
                    head = first[:hlen]
                if hlen > len(head):  # a header longer than one range: fetch the rest of it
                    more, _ = self._range(key, len(head), hlen, etag)
                    head += more
                header = decode_header(head, expected_key=key)
                if header.total_bytes != body.total:
                    raise CorruptObjectError(
                        f"{key!r}: object has {body.total} bytes, header says "
                        f"{header.total_bytes}"
                    )
                writer = (sink or MemorySink()).open(header)
                if body.direct:
                    done_parts = self._first_parts(header, body, writer)
                else:
                    done_parts = self._head_parts(header, memoryview(first)[hlen:], writer)
            self._fetch_payload(header, writer, cancel, done_parts, etag)
            writer.commit()
        except StoreError as exc:
            if writer is not None:
                writer.abort()
            return GetResult(key, header=header, error=exc), etag
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        data = memoryview(writer.buffer) if isinstance(writer, MemoryWriter) else None
        return GetResult(key, header=header, data=data, source=self.name), etag

    @staticmethod
    def _head_parts(header: ObjectHeader, head_payload: memoryview, writer: PayloadWriter
                    ) -> int:
        """Verify and write the whole parts read with the header; returns how many."""
        done = 0
        while done < header.parts and header.part_range(done)[1] <= len(head_payload):
            header.verify_part(done, head_payload[slice(*header.part_range(done))])
            done += 1
        if done:
            writer.write_at(0, head_payload[: header.part_range(done - 1)[1]])
        return done

    @staticmethod
    def _first_parts(header: ObjectHeader, body: RangeBody, writer: PayloadWriter) -> int:
        """Receive and verify the whole parts that follow the header in the first range;
        drain the rest of it (a part cut by the range's end is fetched again whole).
        Returns how many parts arrived."""
        have = body.length - body.consumed
        done = 0
        while done < header.parts and header.part_range(done)[1] <= have:
            done += 1
        end = header.part_range(done - 1)[1] if done else 0
        if end:
            target = writer.target(0, end) if body.direct else None
            if target is not None:
                try:
                    body.readinto(target)
                    for i in range(done):
                        header.verify_part(i, target[slice(*header.part_range(i))])
                finally:
                    target.release()
                writer.written(0, end)
            else:
                data = memoryview(body.read_exact(end))
                for i in range(done):
                    header.verify_part(i, data[slice(*header.part_range(i))])
                writer.write_at(0, data)
        body.drain()
        return done

    def _fetch_payload(
        self,
        header: ObjectHeader,
        writer: PayloadWriter,
        cancel: CancelToken | None,
        done_parts: int,
        etag: str | None = None,
    ) -> None:
        """Fetch the parts from ``done_parts`` on in ranges (whole parts each), in parallel,
        each verified by the thread that received it, each pinned to version ``etag``."""
        hlen, part = header.header_bytes, header.part_bytes
        per_range = max(1, self.config.range_bytes // part)
        ranges = [
            (i, min(i + per_range, header.parts))
            for i in range(done_parts, header.parts, per_range)
        ]

        def fetch(first_part: int, end_part: int) -> None:
            check_cancel(cancel)
            start = header.part_range(first_part)[0]
            end = header.part_range(end_part - 1)[1]
            target = writer.target(start, end - start) if self.config.direct_reads else None
            if target is not None:
                try:
                    self._range_into(header.key, hlen + start, target, etag)
                    for i in range(first_part, end_part):
                        s, e = header.part_range(i)
                        header.verify_part(i, target[s - start : e - start])
                finally:
                    target.release()
                writer.written(start, end - start)
                return
            data, _ = self._range(header.key, hlen + start, hlen + end, etag)
            view = memoryview(data)
            for i in range(first_part, end_part):
                s, e = header.part_range(i)
                header.verify_part(i, view[s - start : e - start])
            writer.write_at(start, view)

        futures: list[Future[None]] = [
            self._requests.submit(partial(fetch, *r)) for r in ranges
        ]
        try:
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()
            wait(futures)
