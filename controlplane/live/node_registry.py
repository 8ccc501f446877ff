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
scheduler's listing (the gateway polls it every ``nodes_refresh_s``, see
:class:`~kvprefetch.controlplane.live.gateway.Gateway`): a node that joined gets traffic
once its engine answers, a node out of the fleet gets none, a new address is used from the
next request on. A node the listing newly routes to (joined, back, or at a new address) is
:meth:`UpstreamDirectory.pending` until the caller has seen its engine answer: an agent says
hello as soon as its node is up, minutes before a large model is loaded, and a request
routed to an engine that is not listening yet fails. A listing that fails to arrive changes
nothing (the last one holds); a node that is in the fleet but names no engine URL keeps its
configured upstream. Thread-safe; no I/O.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
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
        #: Nodes in the fleet whose engine has not answered yet, with the URL asked.
        self._waiting: dict[int, str] = {}
        self.listings = 0
        self.failures = 0

    def url(self, node: int) -> str | None:
        """The engine URL of ``node`` if it is routed to now, else None."""
        with self._lock:
            return self._urls.get(node) if node in self._routable else None

    def last_url(self, node: int) -> str | None:
        """The engine URL ``node`` had last, routed to now or not (a request routed there
        just before a listing took the node out still goes there); None if never known."""
        with self._lock:
            return self._urls.get(node)

    def routable(self) -> tuple[int, ...]:
        """The nodes routed to now, in order."""
        with self._lock:
            return self._routable

    def states(self) -> dict[int, bool]:
        """Every node with a known engine URL -> whether it is routed to now."""
        with self._lock:
            return {n: n in self._routable for n in self._urls}

    def any_url(self) -> str:
        """An engine to ask for what every engine answers alike (tokenize, models)."""
        with self._lock:
            nodes = self._routable or tuple(self._urls)
            return self._urls[nodes[0]]

    def _wanted(self, listing: NodeListing) -> list[tuple[int, str]]:
        """The nodes the listing routes to (in the fleet, an engine URL known), with URLs."""
        wanted = []
        for entry in listing.nodes:
            url = entry.engine_url or self._configured.get(entry.node, "")
            if entry.in_fleet and url:
                wanted.append((entry.node, url))
        return wanted

    def pending(self, listing: NodeListing) -> list[tuple[int, str]]:
        """The nodes ``listing`` would newly route to (not routed to now, or at another
        URL), with their engine URLs: the caller asks each engine before :meth:`apply`."""
        with self._lock:
            return [(n, url) for n, url in self._wanted(listing)
                    if n not in self._routable or self._urls.get(n) != url]

    def apply(self, listing: NodeListing, unready: Collection[int] = ()) -> None:
        """Follow the scheduler's registry: nodes in the fleet with an engine URL (or a
        configured one) are routed to, except those in ``unready`` (a node of
        :meth:`pending` whose engine did not answer: asked again at the next listing);
        every other node is not."""
        with self._lock:
            routable = []
            for entry in listing.nodes:
                url = entry.engine_url or self._configured.get(entry.node, "")
                if url and entry.node not in unready:
                    self._urls[entry.node] = url
            for node, url in self._wanted(listing):
                if node in unready:
                    if self._waiting.get(node) != url:
                        log.info("gateway: node %d is in the fleet; its engine at %s does "
                                 "not answer yet", node, url)
                    self._waiting[node] = url
                    continue
                self._waiting.pop(node, None)
                routable.append(node)
            changed = tuple(routable) != self._routable
            self._routable = tuple(routable)
            self.listings += 1
        if changed:
            log.info("gateway: routing to nodes %s", ", ".join(
                f"{n} ({self._urls[n]})" for n in routable) or "none")

    def refresh(self, source: Callable[[], NodeListing]) -> bool:
        """One poll of ``source`` applied as it is (no engine asked); whether a listing
        came. A failed poll is logged and counted, and the last listing holds."""
        try:
            listing = source()
        except Exception as exc:  # the scheduler is unreachable: the last listing holds
            self.failed(exc)
            return False
        self.apply(listing)
        return True

    def failed(self, exc: BaseException) -> None:
        """A listing that did not arrive: counted and logged; the last one holds."""
        self.failures += 1
        log.warning("gateway: the scheduler's node listing failed: %s", exc)


__all__ = ["NodeEntry", "NodeListing", "NodeRegistryAPI", "UpstreamDirectory", "node_listing"]
