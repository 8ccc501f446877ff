"""The L2 adapter's ``adapter_params`` (:class:`KvPrefetchL2Params`), their validation,
and the plugin JSON that loads the adapter into LMCache. Imports no LMCache: the harness and
the deployment tools build the JSON without it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvprefetch.agents.stores.errors import StoreConfigError
from kvprefetch.agents.stores.s3.config import S3StoreConfig
from kvprefetch.agents.stores.tiered import TieredStoreConfig
from kvprefetch.agents.stores.valkey.config import ValkeyStoreConfig
from kvprefetch.agents.stores.write_back import WriteBackConfig

MIB: Final = 1 << 20
GIB: Final = 1 << 30
MODULE_PATH: Final = "kvprefetch.agents.lmcache.l2.adapter"
CLASS_NAME: Final = "KvPrefetchL2Adapter"
#: Valkey stripe size for LMCache chunks unless the ``valkey`` section sets ``part_bytes``.
#: A chunk larger than one stripe is fetched straight into the memory object, stripes in
#: parallel; one that fits a stripe travels inline with its header (one GET, one copy).
#: 1 MiB puts a 4 MiB chunk on the direct path (the store's own default, 4 MiB, is sized
#: for 32 MiB chunks).
DEFAULT_VALKEY_PART_BYTES: Final = 1 * MIB
#: The ``valkey`` section's defaults here, where it does not set them: the stripe above, and
#: each load batch's stripes read on the batch's own thread and connection (``get_lanes``
#: 1), where the store's default hands each chunk to a pool thread and its stripes to more
#: (``kvprefetch bench lmcache`` compares the two).
VALKEY_DEFAULTS: Final = {"part_bytes": DEFAULT_VALKEY_PART_BYTES, "get_lanes": 1}
_PREFIX_RE: Final = re.compile(r"[A-Za-z0-9._/:-]+")


class KvPrefetchL2Params(BaseModel):
    """``adapter_params`` of the plugin JSON. At least one of ``valkey`` and ``s3``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The hot tier (see :class:`ValkeyStoreConfig`: host, port, password, tls, key_prefix,
    #: connections, part_bytes ...). ``part_bytes`` defaults to 1 MiB and ``get_lanes`` to 1
    #: here (:data:`VALKEY_DEFAULTS`).
    valkey: ValkeyStoreConfig | None = None
    #: The cold, durable tier (see :class:`S3StoreConfig`: bucket, endpoint_url, region,
    #: access_key_id, secret_access_key, key_prefix, connections ...).
    s3: S3StoreConfig | None = None
    #: How the two tiers cooperate when both are given: ``write_mode`` ``write-back`` (the
    #: default here: a store is acknowledged once Valkey has it, S3 follows through the
    #: ``write_back`` backlog) or ``write-through`` (S3, then Valkey, before the
    #: acknowledgement); promote, hot_ttl_s ...
    tiered: TieredStoreConfig = TieredStoreConfig(write_mode="write-back")
    #: The write-back backlog: bound (back-pressure), uploaders, journal, drain at close.
    write_back: WriteBackConfig = WriteBackConfig()
    #: Answer lookups from the in-memory index (keys it does not know: one pipelined Valkey
    #: round trip per task, never S3). False asks the stores on every lookup instead --
    #: Valkey, then one S3 HEAD per key Valkey lacks (added to the engine's time to first
    #: token) -- for deployments where other
    #: writers put objects into S3 alone and a lookup must see them before the next
    #: reconciliation.
    lookup_index: bool = True
    #: Keys the lookup index holds at most (least recently confirmed dropped beyond).
    index_max_keys: int = Field(2_000_000, ge=1)
    #: Reconcile the lookup index with full listings of S3 and Valkey this often (one at
    #: start, in the background); 0 = only the one at start.
    index_reconcile_s: float = Field(300.0, ge=0)
    #: Namespace of LMCache objects inside the stores (after each tier's own prefix).
    key_prefix: str = "lmcache/"
    #: Threads running submitted tasks (each task is one batched store call; the stores
    #: fan out across keys and stripes on their own bounded pools).
    workers: int = Field(4, ge=1, le=64)
    #: Keys per batched ``get`` when a load task is split (batches run side by side).
    load_batch_keys: int = Field(8, ge=1)
    #: Threads running the extra batches of load tasks.
    load_fanout_threads: int = Field(4, ge=1, le=64)
    #: Keys per batched Valkey ``put`` when a write-back store task is split (batches run
    #: side by side on the load fan-out threads, so one batch's checksums are computed while
    #: another's bytes are on the wire, not all before the first byte is sent); 0 = one
    #: ``put`` for the whole task.
    store_batch_keys: int = Field(8, ge=0)
    #: Capacity reported to LMCache; 0 = unknown (LMCache then never evicts from this L2
    #: by aggregate usage; Valkey's maxmemory policy and S3 lifecycle rules do).
    max_capacity_gb: float = Field(0.0, ge=0)
    #: Emulate the node's ingress link: loads complete no faster than this many MiB/s
    #: (one token bucket per adapter, i.e. per node); 0 = as fast as the stores answer.
    #: For CPU demos where the stores sit on loopback.
    load_bandwidth_mib_s: float = Field(0.0, ge=0)

    @field_validator("valkey", mode="before")
    @classmethod
    def _valkey_defaults(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {**VALKEY_DEFAULTS, **value}
        if isinstance(value, ValkeyStoreConfig):
            given = {name: getattr(value, name) for name in value.model_fields_set}
            return ValkeyStoreConfig(**{**VALKEY_DEFAULTS, **given})
        return value

    @field_validator("tiered", mode="before")
    @classmethod
    def _write_back_default(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and "write_mode" not in value:
            return {**value, "write_mode": "write-back"}
        return value

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if not _PREFIX_RE.fullmatch(value):
            raise ValueError("must be non-empty and use only letters, digits and . _ / : -")
        return value

    @model_validator(mode="after")
    def _need_a_tier(self) -> KvPrefetchL2Params:
        if self.valkey is None and self.s3 is None:
            raise ValueError("give a 'valkey' section, an 's3' section, or both")
        return self

    def describe(self) -> str:
        tiers = [t for t, c in (("valkey", self.valkey), ("s3", self.s3)) if c is not None]
        mode = f" {self.tiered.write_mode}" if len(tiers) == 2 else ""
        return "+".join(tiers) + mode


def _error_text(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"adapter_params.{where}: {err['msg']}")
    return "; ".join(lines)


def load_params(params: KvPrefetchL2Params | Mapping[str, Any] | None) -> KvPrefetchL2Params:
    """Validate ``adapter_params``; :class:`StoreConfigError` names every bad field."""
    if isinstance(params, KvPrefetchL2Params):
        return params
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise StoreConfigError(
            f"adapter_params must be a JSON object, got {type(params).__name__}")
    try:
        return KvPrefetchL2Params.model_validate(dict(params))
    except ValidationError as exc:
        raise StoreConfigError(f"kvprefetch L2 adapter: {_error_text(exc)}") from None


def _plain(value: Any) -> Any:
    """JSON-ready values with secrets revealed (the plugin JSON must carry them)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, BaseModel):
        return _plain({name: getattr(value, name) for name in value.model_fields_set})
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def plugin_adapter_json(params: KvPrefetchL2Params | None = None, **fields: Any
                        ) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON object that loads this adapter, e.g.
    ``plugin_adapter_json(valkey=valkey.store_config(), s3=s3.store_config())``.

    Validates first (a bad field raises :class:`StoreConfigError` here, not in LMCache).
    Only fields that were set are written; secrets are written in clear (it is a config).
    """
    if params is not None and fields:
        raise TypeError("give either params or fields, not both")
    checked = load_params(params if params is not None else fields)
    return {"type": "plugin", "module_path": MODULE_PATH, "class_name": CLASS_NAME,
            "adapter_params": _plain(checked)}

