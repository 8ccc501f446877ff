"""Request routing by load *and* data locality.

For every node the router estimates the request's TTFT there: the queue wait, plus the time
to bring the reusable KV that is not yet in HBM (from the DRAM tier over the host link,
or from the remote store over the NIC, if the policy may), plus the prefill of the rest.
The session's home node (where its KV was last written) wins unless another node is better
by more than ``affinity_margin_s``. Nodes within ``tie_share`` of the best estimate are
tied; a tie goes to the first tied node in the session's own order of the nodes (a
rendezvous hash of session id and node), so that sessions no node holds spread over equal
nodes and a session tied again lands where it landed before. Pure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.records import quick_init


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the router knows about one node for one request."""

    node: int
    queue_wait_s: float
    hbm_tokens: int
    #: Tokens in the DRAM tier, ready or arriving; ``dram_wait_s`` until they are usable.
    dram_tokens: int
    dram_wait_s: float = 0.0
    #: Seconds of transfers already queued on the node's link before a new one would start.
    link_backlog_s: float = 0.0


@quick_init
@dataclass(frozen=True, slots=True)
class RouteRequest:
    session_id: str
    input_tokens: int
    reused_tokens: int
    home_node: int | None
    #: Tokens of the session held by the remote store (0 when the policy has none).
    remote_tokens: int
    #: Seconds to pull one byte from the remote store (inverse throughput) and first byte.
    remote_s_per_byte: float
    remote_latency_s: float


@quick_init
@dataclass(frozen=True, slots=True)
class RouteDecision:
    node: int
    estimated_ttft_s: float
    estimates_s: tuple[float, ...]


def route(req: RouteRequest, views: list[NodeView], fleet: FleetConfig) -> RouteDecision:
    """Pick the node with the lowest estimated TTFT, with affinity to the home node."""
    return Router(fleet).decide(req, [_numbers(v) for v in views])


#: One node as :meth:`Router.decide` reads it: the fields of :class:`NodeView`, in order.
NodeNumbers = tuple[int, float, int, int, float, float]


def _numbers(view: NodeView) -> NodeNumbers:
    return (view.node, view.queue_wait_s, view.hbm_tokens, view.dram_tokens,
            view.dram_wait_s, view.link_backlog_s)


class Router:
    """:func:`route` for one fleet, its constants read once, each node a plain tuple: the
    scheduler routes every request through one (``kvprefetch bench control-plane`` times
    the scheduler per event). The same float operations in the same order as the formula
    in the module doc, so the same estimates bit for bit."""

    __slots__ = ("_bpt", "_decode_s", "_fleet", "_h2d", "_margin", "_salt", "_tie")

    def __init__(self, fleet: FleetConfig) -> None:
        self._fleet = fleet
        self._bpt = fleet.model.kv_bytes_per_token
        self._h2d = fleet.node.h2d_gbyte_s * 1e9
        self._decode_s = fleet.model.decode_s_per_token
        self._margin = fleet.router.affinity_margin_s
        self._tie = 1.0 + fleet.router.tie_share
        self._salt = fleet.router.tie_salt

    def estimates(self, req: RouteRequest, nodes: Sequence[NodeNumbers]) -> list[float]:
        """Estimated TTFT of ``req`` on each node."""
        bpt, h2d, decode_s = self._bpt, self._h2d, self._decode_s
        reuse = req.reused_tokens
        held = min(reuse, req.remote_tokens)
        prefill: dict[int, float] = {}  # by the tokens reused from anywhere
        out = []
        for _, queue_wait_s, hbm_tokens, dram_tokens, dram_wait_s, backlog_s in nodes:
            hbm = min(hbm_tokens, reuse)
            dram = max(min(dram_tokens, reuse), hbm)
            remote = max(held, dram)
            load_s = (dram - hbm) * bpt / h2d
            if dram > hbm:
                load_s += dram_wait_s
            if remote > dram:
                load_s = max(load_s, backlog_s + req.remote_latency_s
                             + (remote - dram) * bpt * req.remote_s_per_byte)
            prefill_s = prefill.get(remote)
            if prefill_s is None:
                prefill_s = prefill[remote] = self._fleet.prefill_s(req.input_tokens - remote,
                                                                    remote)
            out.append(queue_wait_s + load_s + prefill_s + decode_s)
        return out

    def decide(self, req: RouteRequest, nodes: Sequence[NodeNumbers]) -> RouteDecision:
        """The node with the lowest estimated TTFT (ties: the session's own order of the
        nodes, :func:`session_rank`), unless the session's home node is within the
        affinity margin of it."""
        estimates = self.estimates(req, nodes)
        if not nodes:
            raise ValueError("no node to route to")
        low = min(estimates)
        bound = low * self._tie
        tied = [i for i, e in enumerate(estimates) if e <= bound]
        if len(tied) == 1:
            best = tied[0]
        else:
            sid, salt = req.session_id, self._salt
            best = max(tied, key=lambda i: (session_rank(sid, nodes[i][0], salt),
                                            -nodes[i][0]))
        if req.home_node is not None:
            for i, numbers in enumerate(nodes):
                if numbers[0] == req.home_node:
                    if estimates[i] <= estimates[best] + self._margin:
                        best = i
                    break
        return RouteDecision(nodes[best][0], estimates[best], tuple(estimates))


def session_rank(session_id: str, node: int, salt: str = "") -> int:
    """The session's preference for ``node`` among tied nodes (higher first): a 64-bit
    BLAKE2b hash of both (and of ``salt``, ``router.tie_salt``, when given), the same in
    every process (unlike :func:`hash` of a string) and, unlike a CRC, with no linear
    relation between two nodes' ranks."""
    key = f"{node}:{session_id}" if not salt else f"{salt}:{node}:{session_id}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
