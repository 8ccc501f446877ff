"""S3 as the cold, durable tier: multipart upload, parallel ranged GETs, a bounded pool.

One object per key at ``<key_prefix><key>``, in the shared object format. A read first
fetches one range from offset 0 (the header and the first parts; the response's
Content-Range gives the object's size), then every other range in parallel, each verified
by the thread that received it. Objects over ``multipart_threshold_bytes`` are uploaded in
parallel parts; a failed upload is aborted so that nothing half-written remains.

Reads never destroy. Every later range of one read is pinned to the version the first
range came from (``If-Match`` with its ETag, and the ETag of each answer checked too): when
the object is overwritten mid-read, S3 answers 412 and the read starts again from the
first range (twice at most, then a clean miss), so ranges of two versions are never mixed.
A checksum failure is fetched once more (in case it was torn by a server that ignores
``If-Match``); if it fails again the object is *quarantined*: counted (``corrupt``), logged,
remembered in :meth:`S3Store.quarantined` and answered as a miss, but never deleted: it
may be the last durable copy, and a tiered store repairs it from the hot tier.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from kvprefetch.agents.stores.base import (
    Buffer,
    CancelToken,
    GetResult,
    KeyPool,
    MemorySink,
    MemoryWriter,
    OpResult,
    PayloadSink,
    PayloadWriter,
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
)
from kvprefetch.agents.stores.format import (
    PREFIX_BYTES,
    ObjectHeader,
    decode_header,
    header_length,
    make_header,
)

log = logging.getLogger(__name__)
MIB = 1 << 20
#: Reads started again because the object changed under them, before a clean miss.
_RESTARTS = 2
#: Quarantined keys remembered (most recent), for operators and tests.
_QUARANTINE_KEEP = 256


class ObjectChangedError(ObjectNotFoundError):
    """The object was replaced while it was being read (412 on a pinned range): a miss."""


class S3StoreConfig(BaseModel):
    """Where the S3 bucket is. Credentials come from the standard boto3 chain unless given."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket: str
    endpoint_url: str | None = None
    region: str | None = None
    path_style: bool = True
    access_key_id: str | None = None
    secret_access_key: SecretStr | None = None
    key_prefix: str = "kvp/"
    #: Checksummed part size; ranged GETs are whole multiples of it.
    part_bytes: int = Field(4 * MIB, ge=4096)
    #: Bytes per ranged GET. 8 MiB is what AWS recommends for byte-range fetches.
    range_bytes: int = Field(8 * MIB, ge=4096)
    #: Objects larger than this are uploaded in parts of ``multipart_part_bytes``
    #: (S3 requires at least 5 MiB per part but the last).
    multipart_threshold_bytes: int = Field(16 * MIB, ge=5 * MIB)
    multipart_part_bytes: int = Field(8 * MIB, ge=5 * MIB)
    #: Parallel requests (and pooled HTTP connections).
    connections: int = Field(16, ge=1, le=512)
    max_object_bytes: int = Field(8 << 30, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    read_timeout_s: float = Field(10.0, gt=0)
    #: botocore retry attempts (standard mode) for throttling and transient errors.
    max_attempts: int = Field(2, ge=1)
    create_bucket: bool = False
    #: Receive ranged GET bodies straight into the destination when it offers memory
    #: (``PayloadWriter.target``), skipping the copies of the HTTP stack and of ``write_at``;
    #: falls back to a plain read when the response is not a plain length-delimited body.
    direct_reads: bool = True


_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_BAD_CONFIG = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "NoSuchBucket",
    "AuthorizationHeaderMalformed", "InvalidBucketName", "403", "PermanentRedirect",
}


@contextmanager
def translate_boto_errors(what: str) -> Iterator[None]:
    """Translate botocore exceptions into :mod:`kvprefetch.agents.stores.errors` (the store
    edge)."""
    import botocore.exceptions as bex

    try:
        yield
    except StoreError:
        raise
    except bex.ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in _NOT_FOUND:
            raise ObjectNotFoundError(f"s3 {what}: not found") from exc
        if code in ("PreconditionFailed", "412"):
            raise ObjectChangedError(f"s3 {what}: the object changed") from exc
        if code in _BAD_CONFIG:
            raise StoreConfigError(f"s3 {what}: {code}: {exc}") from exc
        if code == "EntityTooLarge":
            raise ObjectTooLargeError(f"s3 {what}: {exc}") from exc
        raise StoreError(f"s3 {what}: {code}: {exc}") from exc
    except (bex.ReadTimeoutError, bex.ConnectTimeoutError) as exc:
        raise StoreTimeoutError(f"s3 {what}: timed out: {exc}") from exc
    except (bex.EndpointConnectionError, bex.ConnectionClosedError) as exc:
        raise StoreConnectionError(f"s3 {what}: {exc}") from exc
    except (bex.NoCredentialsError, bex.PartialCredentialsError, bex.ParamValidationError) as exc:
        raise StoreConfigError(f"s3 {what}: {exc}") from exc
    except bex.BotoCoreError as exc:
        raise StoreConnectionError(f"s3 {what}: {exc}") from exc
    except OSError as exc:
        raise StoreConnectionError(f"s3 {what}: {exc}") from exc


class _Body:
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

    def __enter__(self) -> _Body:
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


class S3Store(StoreLifecycle):
    """The S3 cold tier (see the module docstring)."""

    def __init__(self, config: S3StoreConfig, *, name: str = "s3") -> None:
        self.config = config
        self.name = name
        self._client: Any = None
        self._requests = KeyPool(config.connections, f"{name}-req")
        self._keys = KeyPool(max(2, config.connections // 4), f"{name}-key")
        self._stats = StatsCounter()
        self._lock = threading.Lock()
        self._quarantined: OrderedDict[str, str] = OrderedDict()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Build the client and check the bucket is reachable with these credentials.

        Raises :class:`StoreConfigError` (bad credentials, no such bucket) or
        :class:`StoreConnectionError` (nothing at the endpoint).
        """
        import boto3
        from botocore.config import Config

        c = self.config
        session = boto3.session.Session(
            aws_access_key_id=c.access_key_id,
            aws_secret_access_key=(
                c.secret_access_key.get_secret_value() if c.secret_access_key else None
            ),
            region_name=c.region or "us-east-1",
        )
        cfg = Config(
            max_pool_connections=c.connections + 4,
            connect_timeout=c.connect_timeout_s,
            read_timeout=c.read_timeout_s,
            retries={"max_attempts": c.max_attempts, "mode": "standard"},
            s3={"addressing_style": "path" if c.path_style else "auto"},
            tcp_keepalive=True,
        )
        where = c.endpoint_url or "AWS"
        try:
            client = self._connect(session, cfg, where)
        except ObjectNotFoundError as exc:  # HeadBucket answers 404 for a missing bucket
            raise StoreConfigError(f"s3 {where}: no bucket {c.bucket!r}") from exc
        self._client = client
        log.info("s3 store %s connected to %s bucket %s", self.name, where, c.bucket)

    def _connect(self, session: Any, cfg: Any, where: str) -> Any:
        c = self.config
        with translate_boto_errors(f"connect to {where} bucket {c.bucket!r}"):
            client = session.client("s3", endpoint_url=c.endpoint_url, config=cfg)
            if c.create_bucket:
                import botocore.exceptions as bex

                try:
                    client.create_bucket(Bucket=c.bucket)
                except bex.ClientError as exc:
                    code = exc.response.get("Error", {}).get("Code", "")
                    if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
            try:
                client.head_bucket(Bucket=c.bucket)
            except Exception:
                client.close()
                raise
        return client

    def close(self) -> None:
        self._requests.close()
        self._keys.close()
        client, self._client = self._client, None
        if client is not None:
            client.close()

    @property
    def client(self) -> Any:
        if self._client is None:
            raise StoreConfigError(f"store {self.name!r} is not started")
        return self._client

    def object_key(self, key: str) -> str:
        return f"{self.config.key_prefix}{key}"

    # -- exists ------------------------------------------------------------------------------

    def _exists_one(self, key: str) -> OpResult:
        try:
            with translate_boto_errors("head"):
                self.client.head_object(Bucket=self.config.bucket, Key=self.object_key(key))
        except ObjectNotFoundError:
            return OpResult(key, False)
        except StoreError as exc:
            return OpResult(key, False, exc)
        return OpResult(key, True)

    def exists(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        check_cancel(cancel)
        return self._requests.map(self._exists_one, keys)

    # -- get ---------------------------------------------------------------------------------

    def _get_range(self, key: str, start: int, end: int, etag: str | None) -> dict[str, Any]:
        """Start a GET of bytes ``[start, end)``, pinned to version ``etag`` when given
        (``If-Match``; the answer's ETag is checked too, for servers that ignore it)."""
        extra = {"IfMatch": etag} if etag else {}
        with translate_boto_errors("get"):
            resp: dict[str, Any] = self.client.get_object(
                Bucket=self.config.bucket, Key=self.object_key(key),
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

    def _open_range(self, key: str, start: int, end: int, etag: str | None = None) -> _Body:
        """Start a ranged GET of bytes ``[start, end)`` (clipped to the object's end)."""
        return _Body(key, self._get_range(key, start, end, etag),
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

    def get(
        self,
        keys: Sequence[str],
        *,
        sink: PayloadSink | None = None,
        cancel: CancelToken | None = None,
    ) -> list[GetResult]:
        check_cancel(cancel)
        results = self._keys.map(lambda k: self._get_one(k, sink, cancel), keys)
        return [self._stats.count_get(r) for r in results]

    def quarantined(self) -> list[str]:
        """Keys whose object failed verification twice in a row, most recent first (the
        last 256); they are left in the bucket, answered as misses until overwritten."""
        with self._lock:
            return list(reversed(self._quarantined))

    def _get_one(self, key: str, sink: PayloadSink | None, cancel: CancelToken | None
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
                with self._lock:
                    self._quarantined[key] = etag or ""
                    self._quarantined.move_to_end(key)
                    while len(self._quarantined) > _QUARANTINE_KEEP:
                        self._quarantined.popitem(last=False)
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
    def _first_parts(header: ObjectHeader, body: _Body, writer: PayloadWriter) -> int:
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

    # -- put ---------------------------------------------------------------------------------

    def put(
        self,
        items: Sequence[tuple[str, Buffer]],
        *,
        ttl_s: float | None = None,
        cancel: CancelToken | None = None,
    ) -> list[OpResult]:
        """Store each object (``ttl_s`` is ignored: S3 is the durable tier; use bucket
        lifecycle rules to expire). Raises :class:`ObjectTooLargeError` before writing."""
        limit = self.config.max_object_bytes
        for key, payload in items:
            if len(payload) > limit:
                raise ObjectTooLargeError(
                    f"{key!r}: {len(payload)} bytes exceed max_object_bytes={limit}"
                )
        check_cancel(cancel)
        return self._keys.map(lambda it: self._put_one(it[0], it[1], cancel), items)

    def repair(self, items: Sequence[tuple[str, Buffer]], *, ttl_s: float | None = None
               ) -> list[OpResult]:
        """Replace quarantined objects with good copies (from another tier), each only if it
        is still the very version that failed verification (``If-Match`` on its ETag): a
        version written since is never replaced. A key not quarantined is left alone
        (``ok`` False). ``ttl_s`` is ignored, as in :meth:`put`."""

        def one(key: str, payload: Buffer) -> OpResult:
            with self._lock:
                etag = self._quarantined.get(key)
            if not etag:
                return OpResult(key, False)
            result = self._put_one(key, payload, None, if_match=etag)
            if result.ok or isinstance(result.error, ObjectChangedError):
                with self._lock:
                    if self._quarantined.get(key) == etag:
                        del self._quarantined[key]
            return result

        return self._keys.map(lambda it: one(it[0], it[1]), items)

    def _put_one(self, key: str, payload: Buffer, cancel: CancelToken | None,
                 if_match: str | None = None) -> OpResult:
        view = memoryview(payload).cast("B")
        header = make_header(key, view, self.config.part_bytes)
        encoded = header.encode()
        cond = {"IfMatch": if_match} if if_match else {}
        try:
            if header.total_bytes <= self.config.multipart_threshold_bytes:
                with translate_boto_errors("put"):
                    self.client.put_object(
                        Bucket=self.config.bucket, Key=self.object_key(key),
                        Body=encoded + bytes(view), **cond,
                    )
            else:
                self._multipart(key, encoded, view, cancel, cond)
        except StoreError as exc:
            self._stats.add(errors=1)
            return OpResult(key, False, exc)
        self._stats.add(puts=1, bytes_written=len(view))
        return OpResult(key, True)

    def _multipart(
        self, key: str, encoded: bytes, view: memoryview, cancel: CancelToken | None,
        cond: dict[str, str] | None = None,
    ) -> None:
        c = self.config
        okey = self.object_key(key)
        total = len(encoded) + len(view)
        size = c.multipart_part_bytes
        with translate_boto_errors("create multipart upload"):
            upload_id = self.client.create_multipart_upload(Bucket=c.bucket, Key=okey)["UploadId"]

        def body(start: int, end: int) -> bytes:
            # The header goes into the first part; later parts are payload slices.
            if start == 0:
                return encoded + bytes(view[: end - len(encoded)])
            return bytes(view[start - len(encoded) : end - len(encoded)])

        def upload(number: int, start: int, end: int) -> dict[str, Any]:
            check_cancel(cancel)
            with translate_boto_errors(f"upload part {number}"):
                resp = self.client.upload_part(
                    Bucket=c.bucket, Key=okey, UploadId=upload_id, PartNumber=number,
                    Body=body(start, end),
                )
            return {"PartNumber": number, "ETag": resp["ETag"]}

        bounds = [(i + 1, s, min(s + size, total)) for i, s in enumerate(range(0, total, size))]
        futures = [self._requests.submit(partial(upload, *b)) for b in bounds]
        try:
            parts = [f.result() for f in futures]
            with translate_boto_errors("complete multipart upload"):
                self.client.complete_multipart_upload(
                    Bucket=c.bucket, Key=okey, UploadId=upload_id,
                    MultipartUpload={"Parts": parts}, **(cond or {}),
                )
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)
            try:
                with translate_boto_errors("abort multipart upload"):
                    self.client.abort_multipart_upload(
                        Bucket=c.bucket, Key=okey, UploadId=upload_id
                    )
            except StoreError:
                log.warning("%s: could not abort multipart upload of %r", self.name, key)
            raise

    # -- delete ------------------------------------------------------------------------------

    def _delete_one(self, key: str) -> OpResult:
        existed = self._exists_one(key)
        if existed.error is not None:
            return existed
        try:
            with translate_boto_errors("delete"):
                self.client.delete_object(Bucket=self.config.bucket, Key=self.object_key(key))
        except StoreError as exc:
            return OpResult(key, False, exc)
        if existed.ok:
            self._stats.add(deletes=1)
        return OpResult(key, existed.ok)

    def delete(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        check_cancel(cancel)
        return self._requests.map(self._delete_one, keys)
