"""The gateway's command-line options (``kvprefetch gateway`` and ``python -m
kvprefetch.controlplane.live.gateway``), and the token store they name. Imports only the
standard library at module level, so that ``kvprefetch gateway --help`` works without the
``serve`` extra.

The token store is the ``stores`` section of the serve config (``--config``, the file
``kvprefetch serve`` reads), validated by the model serve validates it with
(:class:`~kvprefetch.agents.agent.RemoteStoreConfig`): Valkey's host, port, password, TLS
and key prefix, S3's bucket, endpoint and key prefix are the agents' by construction, so
the gateway writes each session's token ids under the keys the agents read.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

#: The environment variable the gateway reads the scheduler's API token from.
TOKEN_ENV = "KVPREFETCH_API_TOKEN"


class _NoValkeyFlag(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error("--valkey: give --config SERVE_YAML, the serve config whose stores "
                     "section (host, port, password, TLS, key_prefix) the agents use")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's options."""
    parser.add_argument("--upstream", action="append", required=True,
                        help="a node's vLLM base URL, in node order (repeat per node)")
    parser.add_argument("--scheduler", help="the scheduler (http://... or a Ray address); "
                        "without it, requests are routed by load")
    parser.add_argument("--tenant")
    parser.add_argument("--token-file", metavar="PATH",
                        help=f"file holding the scheduler's API token (mode 0600 or 0400); "
                        f"default: the {TOKEN_ENV} environment variable")
    parser.add_argument("--cache-salt-env", metavar="NAME",
                        help="environment variable holding the base of the tenants' cache "
                        "salts (the agents' lmcache.cache_salt)")
    parser.add_argument("--config", metavar="SERVE_YAML",
                        help="the serve config: the token store is its stores section (the "
                        "agents' Valkey, or S3 without one: address, password, TLS, "
                        "key_prefix), where the gateway puts each session's token ids")
    parser.add_argument("--valkey", nargs="?", action=_NoValkeyFlag, help=argparse.SUPPRESS)
    parser.add_argument("--nodes-refresh-s", type=float, default=5.0,
                        help="follow the scheduler's node registry, read this often "
                        "(seconds): joined nodes get requests, lost ones none; 0 = the "
                        "--upstream list only")
    parser.add_argument("--route-deadline-s", type=float, default=0.005, metavar="S",
                        help="longest wait for the scheduler's route; past it the request "
                        "runs on the least-loaded node without prefetch (default "
                        "%(default)g)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)


def stores_of_serve_config(path: str | Path) -> Any:
    """The ``stores`` section of the serve config at ``path`` as a
    :class:`~kvprefetch.agents.agent.RemoteStoreConfig`; ConfigError naming the file and
    the field."""
    import yaml
    from pydantic import ValidationError

    from kvprefetch.agents.agent import RemoteStoreConfig
    from kvprefetch.controlplane.base.errors import ConfigError

    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the serve config: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    stores = raw.get("stores") if isinstance(raw, dict) else None
    if not isinstance(stores, dict):
        raise ConfigError(f"{p}: field 'stores': missing (the agents' token store)")
    try:
        cfg = RemoteStoreConfig.model_validate(stores)
    except ValidationError as exc:
        fields = "; ".join(f"field 'stores.{'.'.join(str(x) for x in e['loc'])}': {e['msg']}"
                           for e in exc.errors())
        raise ConfigError(f"{p}: {fields}") from None
    if cfg.valkey is None and cfg.s3 is None:
        raise ConfigError(f"{p}: field 'stores': configure valkey, s3 or both")
    return cfg


def token_store(stores: Any) -> Any:
    """The store the gateway writes token ids to (not started): the agents' Valkey, where
    they look first, or their S3 when there is no Valkey; same key prefixes."""
    from kvprefetch.agents.agent import RemoteStoreConfig

    hot = RemoteStoreConfig(valkey=stores.valkey) if stores.valkey is not None else \
        RemoteStoreConfig(s3=stores.s3)
    return hot.build()
