"""``kvprefetch serve --check``: is a serve config ready to deploy?

Beyond the validation every start does (:func:`~kvprefetch.controlplane.cli.serve.
load_serve_config`), the check refuses placeholders (a string value containing
``REPLACE_ME``, one finding per field, by its dotted path) and probes what the config
names, each with a short timeout:

- Valkey: connect and ``PING`` (credentials and TLS as configured);
- S3: ``HeadBucket`` on the bucket, at the configured endpoint (AWS when none);
- Ray: a TCP connect to a ``host:port`` or ``ray://host:port`` address (``auto`` and
  ``local`` name no address to probe and are skipped).

Each finding is one line; :func:`check_config` returns them all rather than stopping at
the first, so that one run lists everything left to fix.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvprefetch.controlplane.base.errors import KvPrefetchError

#: The marker the example configs put where a deployment's own value goes.
PLACEHOLDER = "REPLACE_ME"
#: Seconds each probe may take to connect (and, for Valkey and S3, to answer).
PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Finding:
    """One line of the check: what was checked, whether it passed, and why not."""

    ok: bool
    what: str
    detail: str

    def line(self) -> str:
        return f"{'ok' if self.ok else 'FAIL'} {self.what}: {self.detail}"


def placeholders(value: Any, path: str = "") -> Iterator[str]:
    """Dotted paths of the string values under ``value`` that contain :data:`PLACEHOLDER`
    (list items by index: ``tenants.0``)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from placeholders(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from placeholders(item, f"{path}.{i}" if path else str(i))
    elif isinstance(value, str) and PLACEHOLDER in value:
        yield path or "(root)"


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a Ray address to probe; None for ``auto``/``local`` (nothing named).
    Raises ValueError for an address that is neither."""
    if address in ("auto", "local"):
        return None
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not auto, local, host:port or ray://host:port: {address!r}")
    return host.strip("[]"), int(port)


def probe_tcp(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Connect and close; OSError when nothing accepts within ``timeout_s``."""
    with socket.create_connection((host, port), timeout=timeout_s):
        pass


def probe_valkey(config: Any, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """PING the configured Valkey (a :class:`ValkeyStoreConfig`); its address on success."""
    from kvprefetch.agents.stores.valkey.store import ValkeyStore

    store = ValkeyStore(config.model_copy(update={"connect_timeout_s": timeout_s,
                                                  "socket_timeout_s": timeout_s,
                                                  "connections": 1}))
    store.start()  # connects and PINGs
    store.close()
    return f"{config.host}:{config.port}"


def probe_s3(config: Any, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """HeadBucket on the configured bucket (an :class:`S3StoreConfig`, never creating it)."""
    from kvprefetch.agents.stores.s3.store import S3Store

    store = S3Store(config.model_copy(update={"connect_timeout_s": timeout_s,
                                              "read_timeout_s": timeout_s,
                                              "max_attempts": 1, "create_bucket": False}))
    store.start()  # HeadBucket
    store.close()
    return f"bucket {config.bucket!r} at {config.endpoint_url or 'AWS'}"


def _probe(what: str, fn: Any, *args: Any) -> Finding:
    try:
        return Finding(True, what, f"{fn(*args)} answers")
    except KvPrefetchError as exc:
        return Finding(False, what, str(exc))
    except ConnectionError as exc:
        return Finding(False, what, str(exc))
    except Exception as exc:  # a dependency's error, translated here: one line each
        return Finding(False, what, f"{type(exc).__name__}: {exc}")


def check_config(path: str | Path, address: str | None = None) -> list[Finding]:
    """Every finding for the serve config at ``path`` (``address`` overrides
    ``ray.address``). The config's own validation and its secrets come first; the probes
    run only on a config that validates."""
    from kvprefetch.controlplane.cli.serve_config import describe_auth, load_serve_config

    p = Path(path)
    findings: list[Finding] = []
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError):
        raw = None  # load_serve_config says what is wrong
    findings += [Finding(False, field, f"placeholder {PLACEHOLDER} left in {p}: fill it in")
                 for field in placeholders(raw)]
    try:
        cfg = load_serve_config(p)
    except KvPrefetchError as exc:
        return [*findings, Finding(False, "config", str(exc))]
    try:
        findings.append(Finding(True, "config", f"{p} is valid ({describe_auth(cfg.auth())})"))
    except KvPrefetchError as exc:
        findings.append(Finding(False, "credentials", str(exc)))
    if cfg.stores.valkey is not None:
        findings.append(_probe("valkey", probe_valkey, cfg.stores.valkey))
    if cfg.stores.s3 is not None:
        findings.append(_probe("s3", probe_s3, cfg.stores.s3))
    ray_address = address or cfg.ray.address
    try:
        endpoint = ray_endpoint(ray_address)
    except ValueError as exc:
        findings.append(Finding(False, "ray", str(exc)))
    else:
        if endpoint is None:
            findings.append(Finding(True, "ray", f"address {ray_address!r}: nothing to probe"))
        else:
            findings.append(_probe("ray", _probe_ray, *endpoint))
    return findings


def _probe_ray(host: str, port: int) -> str:
    try:
        probe_tcp(host, port)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConnectionError(f"nothing accepts a TCP connection at {host}:{port} "
                              f"({reason})") from None
    return f"{host}:{port} (TCP)"
