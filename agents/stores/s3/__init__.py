"""S3 as the cold, durable tier: the store (:mod:`.store`, whose docstring holds the read
contract), its config and error translation (:mod:`.config`), and the read and write paths
(:mod:`.reads`, :mod:`.writes`)."""

from kvprefetch.agents.stores.s3.config import (
    ObjectChangedError,
    S3StoreConfig,
    translate_boto_errors,
)
from kvprefetch.agents.stores.s3.store import S3Store

__all__ = ["ObjectChangedError", "S3Store", "S3StoreConfig", "translate_boto_errors"]
