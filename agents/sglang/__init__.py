"""SGLang integration: HiCache's page keys and an L3 storage backend over our store (the
``sglang`` node backend, :mod:`kvprefetch.agents.backends.sglang`, warms the node-local tier
that storage backend reads first).

Importing this package does not import SGLang (nor torch): :mod:`kvprefetch.agents.sglang.backend`
subclasses SGLang's ``HiCacheStorage`` and is imported by name only (by SGLang's storage
factory, ``--hicache-storage-backend dynamic``).
"""

from kvprefetch.agents.sglang.keys import OBJECT_PREFIX, PageKeyScheme, namespace_seed, page_hashes

__all__ = ["OBJECT_PREFIX", "PageKeyScheme", "namespace_seed", "page_hashes"]
