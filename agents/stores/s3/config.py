"""Where the S3 cold tier is, and the translation of botocore's exceptions into the store
errors (the store edge)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from kvprefetch.agents.stores.errors import (
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreConfigError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
)

MIB = 1 << 20


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

    def object_key(self, key: str) -> str:
        """The S3 key of the object stored under ``key``."""
        return f"{self.key_prefix}{key}"


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
