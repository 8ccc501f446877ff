"""The ``lmcache-mp`` node backend: the node's LMCache MP server's L1."""
