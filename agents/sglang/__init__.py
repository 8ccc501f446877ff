"""SGLang integration: HiCache's page keys, an L3 storage backend over our store, and the
agent backend that warms the node-local tier that backend reads first.

Importing this package does not import SGLang (nor torch): :mod:`kvprefetch.agents.sglang.backend`
subclasses SGLang's ``HiCacheStorage`` and is imported by name only (by SGLang's storage
factory, ``--hicache-storage-backend dynamic``).
"""

from kvprefetch.agents.sglang.keys import OBJECT_PREFIX, PageKeyScheme, namespace_seed, page_hashes

__all__ = ["OBJECT_PREFIX", "PageKeyScheme", "namespace_seed", "page_hashes"]
