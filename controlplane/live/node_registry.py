"""The fleet's nodes as the gateway needs them: which node slots the scheduler routes to,
and where each one's engine answers.

The scheduler keeps its node registry in :class:`~kvprefetch.controlplane.live.membership.
FleetMembership`: a slot joins when its agent says hello (the agent names its engine's
OpenAI base URL, ``AgentConfig.engine_url``), leaves when the deployment reports the node
lost (:meth:`SchedulerService.node_left`), and a new agent of a slot may name a new
address (a pod rescheduled with a new IP). :func:`node_listing` is that registry as one
:class:`NodeListing` (``GET /nodes``, ``Client.nodes``).

:class:`UpstreamDirectory` is the gateway's side: the node -> engine URL map it forwards
by, seeded from its configured upstreams (node ``i`` = the ``i``-th) and then following the
scheduler's listing (:meth:`UpstreamDirectory.follow` polls it every ``interval_s``): a
node that joined gets traffic, a node out of the fleet gets none, a new address is used
from the next request on. A listing that fails to arrive changes nothing (the last one
holds); a node that is in the fleet but names no engine URL keeps its configured upstream.
Thread-safe; I/O only in the source the caller gives :meth:`follow`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

log = logging.getLogger(__name__)


class NodeEntry(BaseModel):
    """One node slot of the fleet."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: int
    name: str
    #: Routed to now (its agent said hello and it was not lost since).
    in_fleet: bool
    #: Its engine's OpenAI base URL as its agent announced it ("" = not announced).
    engine_url: str = ""


class NodeListing(BaseModel):
    """Every node slot of the fleet (``GET /nodes``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: list[NodeEntry]


@runtime_checkable
class NodeRegistryAPI(Protocol):
    """Who answers :meth:`nodes`: the scheduler service, its Ray actor, and each
    client transport (a few times a minute per gateway)."""

    def nodes(self) -> NodeListing:
        """The node registry now. Read-only."""
        ...


def node_listing(names: Sequence[str], out: Iterable[int], engine_urls: Sequence[str]
                 ) -> NodeListing:
    """The registry as a listing: slot ``i`` named ``names[i]``, out of the fleet when in
    ``out``, its engine at ``engine_urls[i]``."""
    gone = set(out)
    return NodeListing(nodes=[NodeEntry(node=i, name=name, in_fleet=i not in gone,
                                        engine_url=engine_urls[i])
                              for i, name in enumerate(names)])


class UpstreamDirectory:
    """The gateway's node -> engine URL map (see the module docstring). ``upstreams``:
    the configured URLs, node ``i`` the ``i``-th; all of them routable until a listing
    says otherwise."""

    def __init__(self, upstreams: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self._urls: dict[int, str] = dict(enumerate(upstreams))
        self._configured = dict(self._urls)
        self._routable: tuple[int, ...] = tuple(sorted(self._urls))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.listings = 0
        self.failures = 0

    def url(self, node: int) -> str | None:
        """The engine URL of ``node`` if it is routed to now, else None."""
        with self._lock:
            return self._urls.get(node) if node in self._routable else None

    def routable(self) -> tuple[int, ...]:
        """The nodes routed to now, in order."""
        with self._lock:
            return self._routable

    def any_url(self) -> str:
        """An engine to ask for what every engine answers alike (tokenize, models)."""
        with self._lock:
            nodes = self._routable or tuple(self._urls)
            return self._urls[nodes[0]]

    def apply(self, listing: NodeListing) -> None:
        """Follow the scheduler's registry: nodes in the fleet with an engine URL (or a
        configured one) are routed to; every other node is not."""
        with self._lock:
            routable = []
            for entry in listing.nodes:
                url = entry.engine_url or self._configured.get(entry.node, "")
                if url:
                    self._urls[entry.node] = url
                if entry.in_fleet and url:
                    routable.append(entry.node)
            changed = tuple(routable) != self._routable
            self._routable = tuple(routable)
            self.listings += 1
        if changed:
            log.info("gateway: routing to nodes %s", ", ".join(
                f"{n} ({self._urls[n]})" for n in routable) or "none")

    def follow(self, source: Callable[[], NodeListing], interval_s: float) -> None:
        """Poll ``source`` (the scheduler's listing) every ``interval_s`` on a thread of
        its own, applying each listing; a failed poll is logged and counted, and the
        last listing holds. Returns at once; :meth:`close` stops it."""
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")

        def loop() -> None:
            while True:
                self.refresh(source)
                if self._stop.wait(interval_s):
                    return

        if self._thread is None:
            self._thread = threading.Thread(target=loop, name="kvp-gateway-nodes", daemon=True)
            self._thread.start()

    def refresh(self, source: Callable[[], NodeListing]) -> bool:
        """One poll; whether a listing came."""
        try:
            listing = source()
        except Exception as exc:  # the scheduler is unreachable: the last listing holds
            self.failures += 1
            log.warning("gateway: the scheduler's node listing failed: %s", exc)
            return False
        self.apply(listing)
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None


__all__ = ["NodeEntry", "NodeListing", "NodeRegistryAPI", "UpstreamDirectory", "node_listing"]
