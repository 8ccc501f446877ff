"""Request routing by load *and* data locality.

For every node the router estimates the request's TTFT there: the queue wait, plus the time
to bring the reusable KV that is not yet in HBM (from the DRAM tier over the host link,
or from the remote store over the NIC, if the policy may), plus the prefill of the rest.
The session's home node (where its KV was last written) wins unless another node is better
by more than ``affinity_margin_s``. Pure: no clock, no I/O; ties break on the node index.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.base.config import FleetConfig


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


@dataclass(frozen=True, slots=True)
class RouteDecision:
    node: int
    estimated_ttft_s: float
    estimates_s: tuple[float, ...]


def estimate_ttft(req: RouteRequest, view: NodeView, fleet: FleetConfig) -> float:
    """Estimated time to first token of ``req`` on the node described by ``view``."""
    bpt = fleet.model.kv_bytes_per_token
    reuse = req.reused_tokens
    hbm = min(reuse, view.hbm_tokens)
    dram = max(hbm, min(reuse, view.dram_tokens))
    remote = max(dram, min(reuse, req.remote_tokens))
    h2d = fleet.node.h2d_gbyte_s * 1e9
    load_s = (dram - hbm) * bpt / h2d
    if dram > hbm:
        load_s += view.dram_wait_s
    if remote > dram:
        load_s = max(load_s, view.link_backlog_s + req.remote_latency_s
                     + (remote - dram) * bpt * req.remote_s_per_byte)
    prefill_s = fleet.prefill_s(req.input_tokens - remote, remote)
    decode_s = fleet.model.decode_s_per_token
    return view.queue_wait_s + load_s + prefill_s + decode_s


def route(req: RouteRequest, views: list[NodeView], fleet: FleetConfig) -> RouteDecision:
    """Pick the node with the lowest estimated TTFT, with affinity to the home node."""
    estimates = tuple(estimate_ttft(req, v, fleet) for v in views)
    best = min(range(len(views)), key=lambda i: (estimates[i], views[i].node))
    if req.home_node is not None:
        home_idx = next((i for i, v in enumerate(views) if v.node == req.home_node), None)
        if home_idx is not None and (
            estimates[home_idx] <= estimates[best] + fleet.router.affinity_margin_s
        ):
            best = home_idx
    return RouteDecision(views[best].node, estimates[best], estimates)
