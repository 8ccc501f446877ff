"""Where the Valkey hot tier is and how to talk to it, and the translation of valkey-py's
exceptions into the store errors (the store edge)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvprefetch.agents.stores.errors import (
    StoreConfigError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
    TierFullError,
)

MIB = 1 << 20


class ValkeyStoreConfig(BaseModel):
    """Where the Valkey hot tier is and how to talk to it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(6379, gt=0, lt=65536)
    #: Cluster mode: ``startup_nodes`` as ``host:port``; defaults to ``host:port``.
    cluster: bool = False
    startup_nodes: tuple[str, ...] = ()
    db: int = Field(0, ge=0)
    username: str | None = None
    password: SecretStr | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    key_prefix: str = "kvp:"
    #: Expire every key written after this long; None keeps them until evicted.
    ttl_s: float | None = Field(None, gt=0)
    #: Stripe size: objects larger than this are split into parts fetched in parallel.
    #: 4 MiB: large enough that per-request overhead is small, small enough to keep the
    #: client parser's buffers cheap (its reads slow down with very large values).
    part_bytes: int = Field(4 * MIB, ge=4096, le=512 * MIB)
    #: Connections (and part-fetching threads) to the server.
    connections: int = Field(4, ge=1, le=256)
    max_object_bytes: int = Field(8 << 30, gt=0)
    #: Receive stripes straight into the destination (standalone mode only); see
    #: :class:`~kvprefetch.agents.stores.valkey.resp.BulkConnection`. Off = every value
    #: goes through valkey-py.
    direct_reads: bool = True
    #: With ``direct_reads``: read the parts of all of a ``get``'s striped objects on this
    #: many connections, one thread each (the calling thread takes the first); 0 = object
    #: by object on the ``connections`` pool, each object's parts on up to ``connections``
    #: lanes (for a few large objects). 1 suits many small striped objects: no thread
    #: hand-off per object or part (the LMCache adapter's default).
    get_lanes: int = Field(0, ge=0, le=256)
    connect_timeout_s: float = Field(1.0, gt=0)
    socket_timeout_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _check_tls(self) -> ValkeyStoreConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        return self


@contextmanager
def translate_valkey_errors(what: str) -> Iterator[None]:
    """Translate valkey-py exceptions into :mod:`kvprefetch.agents.stores.errors` (the store
    edge)."""
    import valkey.exceptions as vex

    try:
        yield
    except StoreError:
        raise
    except vex.AuthenticationError as exc:
        raise StoreConfigError(f"valkey {what}: authentication failed: {exc}") from exc
    except vex.TimeoutError as exc:
        raise StoreTimeoutError(f"valkey {what}: timed out: {exc}") from exc
    except vex.ConnectionError as exc:
        raise StoreConnectionError(f"valkey {what}: connection failed: {exc}") from exc
    except vex.ResponseError as exc:
        msg = str(exc)
        if msg.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            raise StoreConfigError(f"valkey {what}: {msg}") from exc
        if msg.startswith("OOM"):
            raise TierFullError(f"valkey {what}: server out of memory: {msg}") from exc
        raise StoreError(f"valkey {what}: {msg}") from exc
    except vex.ValkeyError as exc:
        raise StoreConnectionError(f"valkey {what}: {exc}") from exc
    except OSError as exc:
        raise StoreConnectionError(f"valkey {what}: {exc}") from exc
