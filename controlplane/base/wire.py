"""The messages between the scheduler service, the prefetch agents and the engines.

Plain frozen records (picklable, so they cross Ray actor boundaries unchanged). Times are on
the *service clock* (seconds; see :class:`kvprefetch.controlplane.live.config.ServiceClock`);
durations measured by a process on the wall clock carry ``_wall_s`` in their name.

Who sends what
--------------
* scheduler -> agent: :class:`TransferOrder` (prefetch or demand load), cancel by session,
  evict advice (chunk keys);
* agent -> scheduler: :class:`AgentHello` once per (re)start, :class:`TransferReport` once
  per order, :class:`AgentStatus` periodically, :class:`TierEvictions` as the tier evicts,
  :class:`HbmReport` as the engine's KV events change its HBM;
* engine -> scheduler: ``gpu_start`` answered by :class:`GpuStartPlan`, then
  :class:`EngineReport` once per request.

The calls that carry them are those of
:class:`~kvprefetch.controlplane.base.scheduler_api.NodeAPI`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# Order ids: (scheduler epoch, sequence number) in one int.
# ---------------------------------------------------------------------------------------------

#: Low bits of an order id: the order's number within its scheduler incarnation.
ORDER_SEQ_BITS = 32
_SEQ_MASK = (1 << ORDER_SEQ_BITS) - 1


def make_order_id(epoch: int, seq: int) -> int:
    """The id of order ``seq`` (1, 2, ...) of the scheduler incarnation ``epoch``.

    Order ids stay plain ints on the wire (engines wait on them, Ray passes them), but every
    id carries its scheduler's epoch in its high bits, so a restarted scheduler never
    reuses an id of its predecessor: agents' de-duplication and reports cannot confuse
    the two. Ids of one epoch are ordered by ``seq``; ids of a later epoch are larger.
    """
    if epoch < 0 or not 0 < seq <= _SEQ_MASK:
        raise ValueError(f"order id out of range: epoch {epoch}, seq {seq}")
    return (epoch << ORDER_SEQ_BITS) | seq


def order_epoch(order_id: int) -> int:
    """The scheduler epoch an order id was issued in (0: an id made without one)."""
    return order_id >> ORDER_SEQ_BITS


def format_order_id(order_id: int) -> str:
    """``epoch.seq``, for logs."""
    return f"{order_epoch(order_id)}.{order_id & _SEQ_MASK}"


def keys_digest(keys: Iterable[str]) -> str:
    """A short digest of an order's chunk keys, in order: the agent echoes it in its report
    so that the scheduler can check the report is about the keys it ordered."""
    h = hashlib.blake2b(digest_size=8)
    for key in keys:
        h.update(key.encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class TransferOrder:
    """Move ``keys`` (chunks of one session's KV) into ``node``'s local tier.

    Idempotent per ``order_id``: an agent that sees the same id twice runs it once. The id
    carries the scheduler's epoch (:func:`make_order_id`): an agent that sees an order of a
    newer epoch forgets the older epochs' de-duplication state and reports.
    ``tokens``/``nbytes`` are the *modelled* size (the books); the agent moves whatever
    the keys hold (the scaled, real bytes).
    """

    order_id: int
    session_id: str
    node: int
    keys: tuple[str, ...]
    tokens: int
    nbytes: int
    prefetch: bool
    deadline_s: float
    #: Higher runs first on the node's transfer engine (demand loads outrank prefetches).
    priority: float = 0.0
    #: Wall seconds from when the scheduler sent the order to ``deadline_s`` (negative: past
    #: it). Relative, so that the agent's clock need not agree with the scheduler's: the
    #: agent counts it from the order's arrival. None: no deadline on the node's clock.
    due_in_wall_s: float | None = None

    @property
    def epoch(self) -> int:
        """The scheduler incarnation that issued the order."""
        return order_epoch(self.order_id)


@dataclass(frozen=True, slots=True)
class TransferReport:
    """How one order ended (``complete``: every chunk is published in the local tier).

    The scheduler books a report only when it matches its order: same epoch, session, node
    and kind, key counts within the order's keys and, when the agent sent it,
    ``keys_digest`` equal to :func:`keys_digest` of the order's keys.
    """

    order_id: int
    session_id: str
    node: int
    prefetch: bool
    complete: bool
    cancelled: bool
    bytes_moved: int
    keys_moved: int
    keys_present: int
    keys_missed: int
    keys_failed: int
    ttlb_wall_s: float
    incarnation: str = ""
    error: str = ""
    #: When the order ended (``time.time()`` on the agent's node; 0 = unknown). The node's
    #: engine emulator, on the same node, uses it to place the transfer on its GPU timeline.
    done_wall_s: float = 0.0
    #: :func:`keys_digest` of the order's keys ("" = not sent).
    keys_digest: str = ""

    @property
    def epoch(self) -> int:
        return order_epoch(self.order_id)


@dataclass(frozen=True, slots=True)
class TierEvictions:
    """Sessions whose chunks ``node``'s tier evicted by its own order (to fit a write), as
    wire names (``tenant/session``): each one's books entry on the node is stale."""

    node: int
    incarnation: str
    sessions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HbmReport:
    """What ``node``'s engine holds in its GPU prefix cache (HBM), as its KV events tell:
    per session (wire name), the tokens of its prefix there now (0: none). ``full``: a
    listing of every session the agent believes in HBM; a session it does not name holds
    none (after a gap in the events it names none at all)."""

    node: int
    incarnation: str
    sessions: tuple[tuple[str, int], ...]
    full: bool = False
    #: The engine's block size (tokens): it caches whole blocks only, so a session whose
    #: tokens here reach within a block of its context holds all of it the engine keeps.
    #: 0 = unknown.
    block_tokens: int = 0


@dataclass(frozen=True, slots=True)
class AgentHello:
    """An agent (re)started on ``node``: orders sent to an older incarnation are lost."""

    node: int
    incarnation: str
    node_name: str
    #: Chunk keys already published in the node's local tier (it survives an agent restart).
    inventory: tuple[str, ...] = ()
    pid: int = 0
    #: The node's engine's OpenAI base URL as the gateway reaches it ("" = not known): the
    #: gateway forwards the node's requests there (the scheduler's node registry).
    engine_url: str = ""


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """A snapshot of one agent: occupancy of its tier and counters since start."""

    node: int
    node_name: str
    incarnation: str
    pid: int
    used_bytes: int
    capacity_bytes: int
    keys: int
    orders_in_flight: int
    orders_done: int
    orders_failed: int
    bytes_moved: int
    evicted_keys: int
    #: Orders refused because a newer scheduler epoch had been seen.
    stale_orders: int = 0
    #: Real bytes per byte the scheduler books (``AgentConfig.kv_scale``; 1 on a real node).
    kv_scale: float = 1.0
    #: Prefetch orders held at least once while the engine was busy (``AgentConfig.warming``).
    orders_deferred: int = 0
    #: Prefetch orders dropped, never started, past their deadline plus the grace: reported
    #: not done (cancelled), so that the scheduler books nothing of them.
    orders_dropped_late: int = 0

    @property
    def booked_capacity_bytes(self) -> int:
        """The tier's capacity in the scheduler's bytes."""
        return int(self.capacity_bytes / self.kv_scale)


@dataclass(frozen=True, slots=True)
class GpuStartPlan:
    """The scheduler's answer when an engine's GPU picks a request up.

    ``wait_order_id``: an order (a demand load just dispatched, or a prefetch already
    heading to this node) whose completion the engine must wait for before it reads the
    local tier; None = read what is there now.
    """

    wait_order_id: int | None = None
    wait_nbytes: int = 0
    #: True when ``wait_order_id`` is a demand load dispatched by this very call (it starts
    #: when the GPU picks the request up); False for an order already under way.
    dispatched: bool = False


@dataclass(frozen=True, slots=True)
class EngineReport:
    """What an engine did for one request (the FleetView's HBM mirror, the metrics)."""

    session_id: str
    node: int
    context_tokens: int
    local_tokens: int
    reused_tokens: int
    #: Sessions dropped from the engine's HBM prefix cache while serving this request.
    hbm_evicted: tuple[str, ...] = field(default_factory=tuple)
    kv_written_bytes: int = 0
    kv_read_local_bytes: int = 0
