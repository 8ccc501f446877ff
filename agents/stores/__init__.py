"""Token stores: the batched protocol, Valkey, S3, the tiered store and node-local tiers."""

from kvprefetch.agents.stores.base import (
    CancelToken,
    GetResult,
    MemorySink,
    ObjectStore,
    OpResult,
    PayloadSink,
    PayloadWriter,
    StoreStats,
)
from kvprefetch.agents.stores.errors import (
    CancelledError,
    ColdTierDownError,
    CorruptObjectError,
    HotTierDownError,
    NotDurableError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    PutRefusedError,
    StoreConfigError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    TierFullError,
)
from kvprefetch.agents.stores.eviction import (
    EvictionPolicy,
    LruPolicy,
    PredictedNextUsePolicy,
    TierEntry,
    make_policy,
)
from kvprefetch.agents.stores.format import ObjectHeader, decode_object, encode_object, make_header
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig
from kvprefetch.agents.stores.s3.store import S3Store, S3StoreConfig
from kvprefetch.agents.stores.tiered import TieredStore, TieredStoreConfig
from kvprefetch.agents.stores.valkey.store import ValkeyStore, ValkeyStoreConfig

__all__ = [
    "CancelToken", "CancelledError", "ColdTierDownError", "CorruptObjectError",
    "EvictionPolicy", "GetResult", "HotTierDownError", "LocalTier", "LocalTierConfig",
    "LruPolicy", "MemorySink", "NotDurableError", "ObjectHeader", "ObjectNotFoundError",
    "ObjectStore", "ObjectTooLargeError", "OpResult", "PayloadSink", "PayloadWriter",
    "PredictedNextUsePolicy", "PutRefusedError", "S3Store", "S3StoreConfig", "StoreConfigError",
    "StoreConnectionError", "StoreError", "StoreStats", "StoreTimeoutError",
    "StoreUnavailableError", "TierEntry", "TierFullError", "TieredStore", "TieredStoreConfig",
    "ValkeyStore", "ValkeyStoreConfig", "decode_object", "encode_object", "make_header",
    "make_policy",
]
