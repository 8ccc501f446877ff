"""The messages between the scheduler service, the prefetch agents and the engines.

Plain frozen records (picklable, so they cross Ray actor boundaries unchanged). Times are on
the *service clock* (seconds; see :class:`controlplane.live.service.ServiceClock`), durations
measured by a process on the wall clock carry ``_wall_s`` in their name.

Who sends what
--------------
* scheduler -> agent: :class:`TransferOrder` (prefetch or demand load), cancel by session,
  evict advice (chunk keys);
* agent -> scheduler: :class:`AgentHello` once per (re)start, :class:`TransferReport` once
  per order;
* engine -> scheduler: :meth:`gpu_start` answered by :class:`GpuStartPlan`, then
  :class:`EngineReport` once per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TransferOrder:
    """Move ``keys`` (chunks of one session's KV) into ``node``'s local tier.

    Idempotent per ``order_id``: an agent that sees the same id twice runs it once.
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


@dataclass(frozen=True, slots=True)
class TransferReport:
    """How one order ended (``complete``: every chunk is published in the local tier)."""

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


@dataclass(frozen=True, slots=True)
class AgentHello:
    """An agent (re)started on ``node``: orders sent to an older incarnation are lost."""

    node: int
    incarnation: str
    node_name: str
    #: Chunk keys already published in the node's local tier (it survives an agent restart).
    inventory: tuple[str, ...] = ()
    pid: int = 0


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
