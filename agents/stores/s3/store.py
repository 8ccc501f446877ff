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

The store is a facade over :class:`~kvprefetch.agents.stores.s3.reads.S3Reader` (ranged,
pinned, verified reads and the quarantine) and
:class:`~kvprefetch.agents.stores.s3.writes.S3Writer` (PUT, multipart upload, repair).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvprefetch.agents.stores.base import (
    Buffer,
    CancelToken,
    GetResult,
    KeyPool,
    OpResult,
    PayloadSink,
    StatsCounter,
    StoreLifecycle,
    check_cancel,
)
from kvprefetch.agents.stores.errors import ObjectNotFoundError, StoreConfigError, StoreError
from kvprefetch.agents.stores.s3.config import (
    ObjectChangedError,
    S3StoreConfig,
    translate_boto_errors,
)
from kvprefetch.agents.stores.s3.reads import Quarantine, S3Reader
from kvprefetch.agents.stores.s3.writes import S3Writer

log = logging.getLogger(__name__)


class S3Store(StoreLifecycle):
    """The S3 cold tier (see the module docstring). Thread-safe; the constructor does no
    I/O, :meth:`start` connects."""

    def __init__(self, config: S3StoreConfig, *, name: str = "s3") -> None:
        self.config = config
        self.name = name
        self._client: Any = None
        self._requests = KeyPool(config.connections, f"{name}-req")
        self._keys = KeyPool(max(2, config.connections // 4), f"{name}-key")
        self._stats = StatsCounter()
        self._quarantine = Quarantine()
        self._reads = S3Reader(config, name, lambda: self.client, self._quarantine,
                               requests=self._requests)
        self._writes = S3Writer(config, name, lambda: self.client, self._quarantine,
                                self._stats, requests=self._requests, keys=self._keys)

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
        return self.config.object_key(key)
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

    def get(
        self,
        keys: Sequence[str],
        *,
        sink: PayloadSink | None = None,
        cancel: CancelToken | None = None,
    ) -> list[GetResult]:
        check_cancel(cancel)
        results = self._keys.map(lambda k: self._reads.get_one(k, sink, cancel), keys)
        return [self._stats.count_get(r) for r in results]

    def quarantined(self) -> list[str]:
        """Keys whose object failed verification twice in a row, most recent first (the
        last 256); they are left in the bucket, answered as misses until overwritten."""
        return self._quarantine.keys()

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
        return self._writes.put(items, ttl_s=ttl_s, cancel=cancel)

    def repair(self, items: Sequence[tuple[str, Buffer]], *, ttl_s: float | None = None
               ) -> list[OpResult]:
        """Replace quarantined objects with good copies (from another tier), each only if it
        is still the very version that failed verification (``If-Match`` on its ETag): a
        version written since is never replaced. A key not quarantined is left alone
        (``ok`` False). ``ttl_s`` is ignored, as in :meth:`put`."""
        return self._writes.repair(items, ttl_s=ttl_s)

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


__all__ = ["ObjectChangedError", "S3Store", "S3StoreConfig", "translate_boto_errors"]
