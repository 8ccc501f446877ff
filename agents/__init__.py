"""Per-node execution: prefetch agents, token stores, transfer engine, embedded servers.

Importing this package imports neither valkey nor boto3: the stores import them in
``start``.
"""

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.linkemu import LinkEmulator, LinkProfile
from kvprefetch.agents.stores import (
    CancelToken,
    GetResult,
    LocalTier,
    LocalTierConfig,
    ObjectStore,
    OpResult,
    PredictedNextUsePolicy,
    S3Store,
    S3StoreConfig,
    StoreError,
    TieredStore,
    TieredStoreConfig,
    ValkeyStore,
    ValkeyStoreConfig,
)
from kvprefetch.agents.transfer import (
    TokenBucket,
    TransferConfig,
    TransferEngine,
    TransferHandle,
    TransferProgress,
    TransferResult,
)

__all__ = [
    "CancelToken", "EmbeddedS3", "EmbeddedValkey", "GetResult", "LinkEmulator", "LinkProfile",
    "LocalTier", "LocalTierConfig", "ObjectStore", "OpResult", "PredictedNextUsePolicy",
    "S3Store", "S3StoreConfig", "StoreError", "TieredStore", "TieredStoreConfig", "TokenBucket",
    "TransferConfig", "TransferEngine", "TransferHandle", "TransferProgress", "TransferResult",
    "ValkeyStore", "ValkeyStoreConfig",
]
