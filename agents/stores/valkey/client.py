"""The connections of one Valkey store: the valkey-py client (standalone or cluster, TLS,
AUTH), the pool of bulk RESP connections beside it, and the server-side scripts the
store's versioning relies on."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from typing import Any

from kvprefetch.agents.stores.errors import StoreConfigError
from kvprefetch.agents.stores.valkey.config import ValkeyStoreConfig, translate_valkey_errors
from kvprefetch.agents.stores.valkey.resp import BulkPool

log = logging.getLogger(__name__)

#: Publish a fill: set KEYS[1] to ARGV[2] (PX ARGV[3] unless empty) only if it still holds
#: the lease marker ARGV[1]; 1 if set.
_FILL_IF_LEASED = """
if redis.call('STRLEN', KEYS[1]) ~= string.len(ARGV[1])
    or redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 1
"""

#: Compare-and-delete: delete KEYS[1] only if it still holds ARGV[1]; 1 if deleted.
_EXPIRE_IF_UNCHANGED = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_DELETE_IF_UNCHANGED = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


class ValkeyClient:
    """Owns one store's connections. ``start`` connects (I/O); the constructor does none.
    Thread-safe: valkey-py's pool and :class:`BulkPool` hand each thread its own
    connection."""

    def __init__(self, config: ValkeyStoreConfig, name: str) -> None:
        self.config = config
        self.name = name
        self._client: Any = None
        #: Bulk RESP connections (one per part-fetching thread, standalone mode).
        self.bulk = BulkPool(config)
        self._delete_if_unchanged: Any = None
        self._fill_if_leased: Any = None
        self._expire_if_unchanged: Any = None

    def _client_kwargs(self) -> dict[str, Any]:
        c = self.config
        kw: dict[str, Any] = {
            "username": c.username,
            "password": c.password.get_secret_value() if c.password else None,
            "socket_connect_timeout": c.connect_timeout_s,
            "socket_timeout": c.socket_timeout_s,
            "socket_keepalive": True,
        }
        if c.tls:
            kw.update(
                ssl=True,
                ssl_ca_certs=c.tls_ca_file,
                ssl_certfile=c.tls_cert_file,
                ssl_keyfile=c.tls_key_file,
                ssl_cert_reqs=ssl.CERT_REQUIRED if c.tls_verify else ssl.CERT_NONE,
            )
        return kw

    def start(self) -> None:
        """Connect and check the server answers (and that the credentials are right).

        Raises :class:`StoreConfigError` (bad credentials, bad TLS files) or
        :class:`StoreConnectionError` (nothing listening at the endpoint).
        """
        import valkey
        from valkey.cluster import ClusterNode, ValkeyCluster

        c = self.config
        kw = self._client_kwargs()
        where = f"{c.host}:{c.port}"
        with translate_valkey_errors(f"connect to {where}"):
            if c.cluster:
                nodes = [n.rsplit(":", 1) for n in (c.startup_nodes or (where,))]
                client: Any = ValkeyCluster(
                    startup_nodes=[ClusterNode(h, int(p)) for h, p in nodes],
                    max_connections=c.connections + 4,
                    **kw,
                )
            else:
                if c.tls:
                    kw.pop("ssl")
                    kw["connection_class"] = valkey.SSLConnection
                pool = valkey.BlockingConnectionPool(
                    host=c.host, port=c.port, db=c.db, max_connections=c.connections + 4,
                    timeout=c.socket_timeout_s, **kw,
                )
                client = valkey.Valkey(connection_pool=pool)
            try:
                client.ping()
            except Exception:
                client.close()
                raise
        self._client = client
        # Registered here (no I/O: loaded on first use, re-sent after NOSCRIPT).
        self._delete_if_unchanged = client.register_script(_DELETE_IF_UNCHANGED)
        self._fill_if_leased = client.register_script(_FILL_IF_LEASED)
        self._expire_if_unchanged = client.register_script(_EXPIRE_IF_UNCHANGED)
        log.info("valkey store %s connected to %s", self.name, where)

    def close(self) -> None:
        self.bulk.close()
        client, self._client = self._client, None
        if client is not None:
            client.close()

    @property
    def client(self) -> Any:
        """The valkey-py client; raises :class:`StoreConfigError` before ``start``."""
        if self._client is None:
            raise StoreConfigError(f"store {self.name!r} is not started")
        return self._client

    def px(self, ttl_s: float | None) -> int | None:
        """The ``PX`` (milliseconds, at least 1) of ``ttl_s``, else of the configured
        ``ttl_s``; None: no expiry."""
        ttl = ttl_s if ttl_s is not None else self.config.ttl_s
        return max(1, round(ttl * 1000)) if ttl is not None else None

    def delete_names(self, names: Sequence[str]) -> None:
        """Delete Valkey keys, one pipelined round trip (nothing to do for none)."""
        if not names:
            return
        with translate_valkey_errors("delete parts"):
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.delete(n)
            pipe.execute()

    def delete_if_unchanged(self, name: str, raw: bytes) -> bool:
        """Delete ``name`` only if it still holds ``raw`` (one script call); True if deleted.
        The caller translates errors."""
        return bool(self._delete_if_unchanged(keys=[name], args=[raw]))

    def expire_if_unchanged(self, name: str, raw: bytes, px: int) -> bool:
        """Give ``name`` an expiry of ``px`` ms only if it still holds ``raw`` (one script
        call); True if set. The caller translates errors."""
        return bool(self._expire_if_unchanged(keys=[name], args=[raw, str(px)]))

    def fill_if_leased(self, name: str, marker: bytes, value: bytes, px: int | None) -> bool:
        """Set ``name`` to ``value`` only if it still holds the lease ``marker`` (one script
        call); True if set. The caller translates errors."""
        args = [marker, value, "" if px is None else str(px)]
        return bool(self._fill_if_leased(keys=[name], args=args))
