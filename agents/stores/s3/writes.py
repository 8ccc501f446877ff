"""The S3 store's write path: one PUT per small object, a parallel multipart upload per
large one (aborted on failure, so nothing half-written remains), and the conditional
repair of quarantined objects."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from functools import partial
from typing import Any

from kvprefetch.agents.stores.base import (
    Buffer,
    CancelToken,
    KeyPool,
    OpResult,
    StatsCounter,
    check_cancel,
)
from kvprefetch.agents.stores.errors import ObjectTooLargeError, StoreError
from kvprefetch.agents.stores.format import make_header
from kvprefetch.agents.stores.s3.config import (
    ObjectChangedError,
    S3StoreConfig,
    translate_boto_errors,
)
from kvprefetch.agents.stores.s3.reads import Quarantine

log = logging.getLogger(__name__)


class S3Writer:
    """Writes objects for one :class:`~kvprefetch.agents.stores.s3.store.S3Store`.
    Thread-safe; the pools (``requests``: upload parts, ``keys``: one object each) and the
    counters are the store's."""

    def __init__(self, config: S3StoreConfig, name: str, client: Callable[[], Any],
                 quarantine: Quarantine, stats: StatsCounter, *, requests: KeyPool,
                 keys: KeyPool) -> None:
        self.config = config
        self.name = name
        self._client = client
        self._quarantine = quarantine
        self._stats = stats
        self._requests = requests
        self._keys = keys

    def put(
        self,
        items: Sequence[tuple[str, Buffer]],
        *,
        ttl_s: float | None = None,
        cancel: CancelToken | None = None,
    ) -> list[OpResult]:
        """The work of :meth:`S3Store.put` (its docstring holds the contract)."""
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
        """The work of :meth:`S3Store.repair` (its docstring holds the contract)."""

        def one(key: str, payload: Buffer) -> OpResult:
            etag = self._quarantine.etag(key)
            if not etag:
                return OpResult(key, False)
            result = self._put_one(key, payload, None, if_match=etag)
            if result.ok or isinstance(result.error, ObjectChangedError):
                self._quarantine.release(key, etag)
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
                    self._client().put_object(
                        Bucket=self.config.bucket, Key=self.config.object_key(key),
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
        okey = self.config.object_key(key)
        total = len(encoded) + len(view)
        size = c.multipart_part_bytes
        with translate_boto_errors("create multipart upload"):
            created = self._client().create_multipart_upload(Bucket=c.bucket, Key=okey)
        upload_id = created["UploadId"]

        def body(start: int, end: int) -> bytes:
            # The header goes into the first part; later parts are payload slices.
            if start == 0:
                return encoded + bytes(view[: end - len(encoded)])
            return bytes(view[start - len(encoded) : end - len(encoded)])

        def upload(number: int, start: int, end: int) -> dict[str, Any]:
            check_cancel(cancel)
            with translate_boto_errors(f"upload part {number}"):
                resp = self._client().upload_part(
                    Bucket=c.bucket, Key=okey, UploadId=upload_id, PartNumber=number,
                    Body=body(start, end),
                )
            return {"PartNumber": number, "ETag": resp["ETag"]}

        bounds = [(i + 1, s, min(s + size, total)) for i, s in enumerate(range(0, total, size))]
        futures = [self._requests.submit(partial(upload, *b)) for b in bounds]
        try:
            parts = [f.result() for f in futures]
            with translate_boto_errors("complete multipart upload"):
                self._client().complete_multipart_upload(
                    Bucket=c.bucket, Key=okey, UploadId=upload_id,
                    MultipartUpload={"Parts": parts}, **(cond or {}),
                )
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)
            try:
                with translate_boto_errors("abort multipart upload"):
                    self._client().abort_multipart_upload(
                        Bucket=c.bucket, Key=okey, UploadId=upload_id
                    )
            except StoreError:
                log.warning("%s: could not abort multipart upload of %r", self.name, key)
            raise
