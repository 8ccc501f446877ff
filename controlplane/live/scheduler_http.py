"""The HTTP API served in the scheduler actor's own process (``http.front_end:
scheduler`` in ``kvprefetch serve``'s config).

The front end of :mod:`kvprefetch.controlplane.live.http_api` normally runs in the
``serve`` process and reaches the scheduler actor over Ray: every route pays a Ray round
trip on top of its HTTP one. Here the same app (same endpoints, auth, limits, metrics and
health) runs on a uvicorn thread inside the actor that holds the
:class:`~kvprefetch.controlplane.live.service.SchedulerService`, and calls the service in
process, its calls batched
(:class:`~kvprefetch.controlplane.live.local_batching.LocalBatchingTransport`: applied on
the server's event loop while the service is free, else on a worker thread; each call
bounded by ``call_timeout_s``). The service's lock orders the API's calls with the
actor's Ray calls (agents, engines, Python clients) and its control loop.

The server starts when the actor does and, as the actor is restarted by Ray with the
arguments it was created with, comes back on the same address with each new
incarnation. One scheduler shard only: a front end in one shard's process could not
answer for the sessions of another without a Ray hop again (:class:`HttpFrontEnd`
refuses ``shards`` > 1 at start-up).

Called by :class:`~kvprefetch.controlplane.live.ray_app.SchedulerActor` once, in its
constructor (:func:`serve_scheduler`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.live.limits import RequestLimits
from kvprefetch.controlplane.live.tenants import TenantAuth

if TYPE_CHECKING:
    from kvprefetch.controlplane.live.http_api import HttpServer
    from kvprefetch.controlplane.live.service import SchedulerService

__all__ = ["HttpFrontEnd", "serve_scheduler"]


@dataclass(frozen=True)
class HttpFrontEnd:
    """Where and how the scheduler actor serves the HTTP API (picklable: it travels to
    the actor; ``auth`` as its tokens' digests). ``port`` 0: a free port, read back with
    the actor's ``http_url``; a fixed port is bound again by a restarted actor."""

    host: str = "127.0.0.1"
    port: int = 0
    auth: TenantAuth = field(default_factory=TenantAuth)
    limits: RequestLimits = field(default_factory=RequestLimits)
    #: Seconds the API waits for the service per call (then "no prefetch").
    call_timeout_s: float = 2.0
    metrics_tenant_names: bool = False
    access_log: bool = False
    log_level: str = "warning"

    def check(self, shards: int) -> None:
        """ConfigError unless one shard serves (see the module docstring)."""
        if shards != 1:
            raise ConfigError(f"http.front_end: scheduler serves the API in the one "
                              f"scheduler's process; service.shards is {shards} (set "
                              "http.front_end: serve, or one shard)")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"http.port: {self.port} is not a TCP port")


def serve_scheduler(svc: SchedulerService, front: HttpFrontEnd,
                    metrics: Callable[[], bytes]) -> HttpServer:
    """Start the HTTP API in this process in front of ``svc``; ``metrics`` renders the
    scheduler's own Prometheus text (the API adds its call counts). Raises
    :class:`ConfigError` when the address cannot be bound."""
    from kvprefetch.controlplane.live.http_api import HttpServer, create_app
    from kvprefetch.controlplane.live.local_batching import LocalBatchingTransport

    front.check(svc.config.shards)
    transport = LocalBatchingTransport(svc, timeout_s=front.call_timeout_s)
    app = create_app(transport, auth=front.auth, limits=front.limits,
                     chunk_tokens=svc.config.chunk_tokens, metrics_registry=metrics,
                     call_timeout_s=front.call_timeout_s, health_check=svc.check_health,
                     metrics_tenant_names=front.metrics_tenant_names)
    return HttpServer(app, front.host, front.port, access_log=front.access_log,
                      log_level=front.log_level).start()
