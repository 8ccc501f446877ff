"""LMCache integration: the ``lmcache server`` launcher, our L2 adapter plugin, the
``lmcache-mp`` agent backend and the engine emulator's LMCache client.

Importing this package does not import LMCache; the modules that need it import it lazily.
"""

from agents.lmcache.server import LMCacheServer, find_lmcache

__all__ = ["LMCacheServer", "find_lmcache"]
