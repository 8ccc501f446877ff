"""Node backends: where a node's prefetch agent lands the scheduler's orders and where its
engine finds KV. One protocol (:class:`~kvprefetch.agents.backends.base.NodeBackend`), one
registry by name (:mod:`kvprefetch.agents.backends.registry`), one folder per backend:

* ``local`` (:mod:`kvprefetch.agents.backends.local`): the project's own DRAM/disk tier,
  filled by the transfer engine; engines that read it themselves map its files.
* ``lmcache-mp`` (:mod:`kvprefetch.agents.backends.lmcache`): the node's LMCache MP
  server's L1, warmed through its HTTP API.
* ``sglang`` (:mod:`kvprefetch.agents.backends.sglang`): the local tier filled with SGLang's
  page objects, which kvprefetch's SGLang HiCache backend reads first.

What they share lives here, not in any one of them: the order pool and warm handle
(:mod:`~kvprefetch.agents.backends.common`) and the token store
(:mod:`~kvprefetch.agents.backends.tokens`). No backend imports another (an import-linter
contract). Importing this package imports no backend: the registry loads one by name.
"""

from kvprefetch.agents.backends.base import BackendContext, NodeBackend, OrderGuard
from kvprefetch.agents.backends.registry import (
    BACKENDS,
    DEFAULT_BACKEND,
    BackendName,
    BackendSpec,
    NodeServer,
    backend_spec,
    require_settings,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "BackendContext",
    "BackendName",
    "BackendSpec",
    "NodeBackend",
    "NodeServer",
    "OrderGuard",
    "backend_spec",
    "require_settings",
]
