"""Valkey (or Redis) as the hot tier: the store (:mod:`.store`, whose docstring holds the key
layout), its config and error translation (:mod:`.config`), key names (:mod:`.layout`), the
connections and server-side scripts (:mod:`.client`, :mod:`.resp`), and the read and write
paths (:mod:`.reads`, :mod:`.writes`)."""

from kvprefetch.agents.stores.valkey.config import ValkeyStoreConfig, translate_valkey_errors
from kvprefetch.agents.stores.valkey.layout import LEASE_MAGIC, LEASE_TOKEN_BYTES, TAG_BYTES
from kvprefetch.agents.stores.valkey.store import ValkeyStore

__all__ = [
    "LEASE_MAGIC",
    "LEASE_TOKEN_BYTES",
    "TAG_BYTES",
    "ValkeyStore",
    "ValkeyStoreConfig",
    "translate_valkey_errors",
]
