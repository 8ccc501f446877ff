"""``connect(address=...)``: a :class:`~kvprefetch.controlplane.live.client.Client` of the
scheduler, its transport chosen by the address.

``address="inproc"`` with ``service=`` (a
:class:`~kvprefetch.controlplane.live.service.SchedulerService` in this process: tests,
embedding) or ``service=`` alone: the in-process transport; an HTTP URL
(``http://host:8000``): :class:`~kvprefetch.controlplane.live.client.HttpTransport`; any other
address is Ray's (``"auto"``, ``"ray://host:10001"``, ``"127.0.0.2:6379"``): the named
scheduler actor, or all of its shards
(:func:`~kvprefetch.controlplane.live.sharded.open_ray`). This module imports both the client
and the sharded transport; neither of them imports it.
"""

from __future__ import annotations

from kvprefetch.controlplane.base.errors import ConfigError, InvalidRequestError
from kvprefetch.controlplane.live.client import (
    DEFAULT_TIMEOUT_S,
    Client,
    EventBatching,
    HttpTransport,
)
from kvprefetch.controlplane.live.protocol import GatewayAPI
from kvprefetch.controlplane.live.sharded import open_ray

__all__ = ["connect"]


def connect(address: str = "auto", *, tenant: str | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S, service: GatewayAPI | None = None,
            token: str | None = None, namespace: str = "kvprefetch",
            batching: EventBatching | None = None) -> Client:
    """A client of the scheduler at ``address`` (see the module docstring);
    ``batching``: queue fire-and-forget events to a Ray scheduler
    (:class:`~kvprefetch.controlplane.live.client.EventBatching`; ignored by the other
    transports)."""
    if timeout_s <= 0:
        raise InvalidRequestError("timeout_s must be positive")
    target: GatewayAPI
    if service is not None or address == "inproc":
        if service is None:
            raise InvalidRequestError("address 'inproc' needs service=")
        target = service
    elif address.startswith(("http://", "https://")):
        target = HttpTransport(address, token, timeout_s=timeout_s)
    else:
        try:
            target = open_ray(address, namespace, timeout_s=timeout_s, batching=batching)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "ray":
                raise
            raise ConfigError(f"connect({address!r}): a Ray address needs the 'serve' extra "
                              "(pip install 'kvprefetch[serve]'); or connect to the HTTP "
                              "API, connect('http://host:8000')") from None
    return Client(target, tenant=tenant, timeout_s=timeout_s)
