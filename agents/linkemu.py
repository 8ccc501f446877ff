"""A link emulator: an asyncio TCP proxy that adds a first-byte delay and caps each
connection's bandwidth (the kernel here has no ``netem``).

Requests (client to server) go through a delay line: every byte reaches the server
``latency_s`` after it reached the proxy, without serialising requests behind each other.
Responses (server to client) are paced per connection at ``bandwidth_mib_s``. Each accepted
connection gets its own upstream connection, so N parallel connections get N times the
bandwidth, as with S3 and with several Valkey connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)
MIB = 1 << 20
_READ_BYTES = 256 * 1024


class LinkProfile(BaseModel):
    """One emulated link."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    latency_s: float = Field(ge=0)
    bandwidth_mib_s: float = Field(gt=0)


#: Scaled from a datacenter Valkey link (0.5 ms, 200 MB/s per connection) and S3 (15 ms
#: first byte, 50 MB/s per connection): bandwidths halved so that the CPU of the one machine
#: that runs servers, proxy and client at once is not what limits the parallel case.
VALKEY_LINK = LinkProfile(latency_s=0.0005, bandwidth_mib_s=100.0)
S3_LINK = LinkProfile(latency_s=0.015, bandwidth_mib_s=25.0)


@dataclass(frozen=True, slots=True)
class LinkStats:
    connections: int
    bytes_down: int
    bytes_up: int


class LinkEmulator:
    """Proxy ``127.0.0.1:<port>`` → ``upstream_host:upstream_port`` through ``profile``.

    ``start`` runs the proxy on its own event-loop thread and returns once it listens;
    ``stop`` closes every connection.
    """

    def __init__(self, upstream_host: str, upstream_port: int, profile: LinkProfile,
                 *, name: str = "link") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.profile = profile
        self.name = name
        self.host = "127.0.0.1"
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._connections = 0
        self._down = 0
        self._up = 0
        self._error: BaseException | None = None

    def start(self) -> LinkEmulator:
        self._thread = threading.Thread(target=self._run, name=f"linkemu-{self.name}",
                                        daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._handle, self.host, 0)
            )
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(self) -> None:
        loop, server = self._loop, self._server
        if loop is None or server is None:
            return

        async def shutdown() -> None:
            server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = self._server = None

    def __enter__(self) -> LinkEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> LinkStats:
        return LinkStats(self._connections, self._down, self._up)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        tasks = [
            asyncio.ensure_future(self._delay_line(reader, up_writer)),
            asyncio.ensure_future(self._paced(up_reader, writer)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # the emulator is stopping
        finally:
            for t in tasks:
                t.cancel()
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()

    async def _delay_line(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        delay = self.profile.latency_s
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def forward() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    writer.write_eof()
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        fwd = asyncio.ensure_future(forward())
        try:
            while True:
                data = await reader.read(_READ_BYTES)
                self._up += len(data)
                await queue.put((time.monotonic() + delay, data))
                if not data:
                    break
            await fwd
        finally:
            fwd.cancel()

    async def _paced(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rate = self.profile.bandwidth_mib_s * MIB
        next_free = time.monotonic()
        while True:
            data = await reader.read(_READ_BYTES)
            if not data:
                writer.close()
                return
            now = time.monotonic()
            next_free = max(now, next_free) + len(data) / rate
            if next_free - now > 0.001:
                await asyncio.sleep(next_free - now)
            writer.write(data)
            self._down += len(data)
            await writer.drain()
