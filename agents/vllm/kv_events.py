"""vLLM's own account of its GPU prefix cache (HBM): its KV events, followed over ZMQ.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`` publishes, once per
engine step with changes, a ``KVEventBatch`` (``vllm/distributed/kv_events.py``) on a PUB
socket as three frames: the topic, an 8-byte big-endian sequence number (0, 1, 2 ... from
the publisher's start) and the batch in msgpack, ``[ts, events, data_parallel_rank]``,
each event a map tagged by ``type``: ``BlockStored`` (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``medium``, ``group_idx``,
``session_id`` ...), ``BlockRemoved`` (``block_hashes``, ``medium``, ``group_idx``) and
``AllBlocksCleared``. Its ROUTER replay socket answers a request for the batches from a
sequence number on with those it still buffers (``buffer_steps``), then an end marker
(sequence -1).

:class:`VLLMEventSubscriber` follows one engine's stream and keeps an
:class:`~kvprefetch.agents.vllm.hbm_residency.HbmResidency`; after each batch it hands the
sessions whose HBM prefix changed to an :class:`HbmSink`. Continuity
(:func:`continuity`):

* the next sequence number: applied;
* a jump (batches lost: the subscription dropped and came back, or the socket's
  high-water mark overflowed): the missing batches are asked of the replay socket and
  applied in order; if there is no replay socket, it does not answer within
  ``timeout_s`` or no longer holds the first missing batch, what HBM holds is unknown:
  every session is withdrawn and reported at 0 tokens in a full listing (``resync``),
  and the events from there on rebuild it;
* a smaller number than expected: the engine restarted (its HBM is empty): every session
  is withdrawn, then the batches from 0 are asked for as for a jump;
* a first batch other than number 0 (the subscriber started after the engine): the
  earlier batches are asked for as for a jump.
* the connection to the publisher drops (the engine stopped): every session is withdrawn
  at once; ZMQ reconnects on its own and the sequence check decides on the next batch.

The first delivery after :meth:`VLLMEventSubscriber.start` (once the first batch and what
replay could bring back are applied) is a full listing, so that the owner's readers drop
whatever an earlier subscriber told them; every later one names the sessions that changed.

Only the GPU medium (``medium`` ``GPU`` or none) of the first KV cache group counts. The
subscriber never raises into its owner: decoding errors and sink errors are logged and
counted, and the loop goes on. pyzmq and msgpack are imported in :meth:`start`; the
constructor does no I/O.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.vllm.hbm_residency import MAX_BLOCKS, BlockHash, HbmResidency, HbmStats

log = logging.getLogger(__name__)

#: The verdict on a batch's sequence number (:func:`continuity`).
Continuity = Literal["next", "gap", "restart"]
ResyncReason = Literal["events_lost", "engine_restart", "disconnected"]
SubscriptionState = Literal["new", "connecting", "subscribed", "closed"]

#: The replay socket's end-of-replay marker (sequence -1, signed).
END_SEQ = -1
#: The poll period of the subscriber's loop (seconds): how soon ``close`` is noticed.
POLL_S = 0.1


#: Whether the agent follows the engine's KV events: see ``VLLMEventsConfig.kv_events``.
KVEventsMode = Literal["auto", "required", "off"]


class VLLMEventsConfig(BaseModel):
    """Where the node's vLLM publishes its KV events (its ``--kv-events-config``), as the
    agent on the node reaches them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Follow them, so that what vLLM's HBM stores and evicts on its own reaches the
    #: scheduler's books of the node: ``auto`` = follow, and warn at start when the
    #: publisher is not reachable within ``connect_timeout_s`` (the agent starts anyway
    #: and keeps trying); ``required`` = refuse to start then; ``off`` = never (the
    #: scheduler then knows nothing of the node's HBM).
    kv_events: KVEventsMode = "auto"
    #: The publisher (``endpoint`` of vLLM's ``--kv-events-config``, e.g.
    #: ``tcp://127.0.0.1:5557``).
    endpoint: str = Field("tcp://127.0.0.1:5557", min_length=1)
    #: Its replay socket (``replay_endpoint``; "" = none: a gap in the events then
    #: withdraws every session from the node's HBM mirror until new events rebuild it).
    replay_endpoint: str = ""
    #: The publisher's ``topic``.
    topic: str = ""
    #: The agent binds ``endpoint`` and vLLM's publisher connects to it (vLLM's
    #: ``endpoint`` names this host's address: several nodes on one machine, each on its
    #: own address). False: vLLM binds (``tcp://*:PORT``) and the agent connects.
    bind: bool = False
    #: Longest wait for the publisher at start, and for one replay (seconds).
    connect_timeout_s: float = Field(5.0, gt=0)
    #: (session, block) entries kept to map vLLM's blocks to sessions; past it the
    #: sessions stored longest ago are reported out of HBM.
    max_tracked_blocks: int = Field(MAX_BLOCKS, ge=1)


@dataclass(frozen=True, slots=True)
class Stored:
    """``BlockStored``: blocks cached (or, under the full report mode, reused) for one
    request of ``session``, after block ``parent``."""

    session: str | None
    parent: BlockHash | None
    hashes: tuple[BlockHash, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    """``BlockRemoved``: blocks evicted from the prefix cache."""

    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    """``AllBlocksCleared``: the prefix cache was reset."""


Event = Stored | Removed | Cleared


class KVEventDecodeError(ValueError):
    """A payload that is not a vLLM ``KVEventBatch``."""


def _counts(event: Mapping[str, Any]) -> bool:
    """Whether an event is about HBM (the GPU medium) of the first KV cache group."""
    medium = event.get("medium")
    return (medium is None or str(medium).upper() == "GPU") and event.get("group_idx") in (
        None, 0)


def decode_batch(payload: bytes) -> list[Event]:
    """The HBM events of one published batch (msgpack ``[ts, events, dp_rank]``), in
    order. Raises :class:`KVEventDecodeError` for anything else."""
    import msgpack

    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise KVEventDecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise KVEventDecodeError(f"not a KVEventBatch: {type(batch).__name__}")
    out: list[Event] = []
    for raw in batch[1]:
        if not isinstance(raw, dict):
            raise KVEventDecodeError(f"an event is a {type(raw).__name__}, not a map")
        kind = raw.get("type")
        if kind == "AllBlocksCleared":
            out.append(Cleared())
        elif kind in ("BlockStored", "BlockRemoved"):
            if not _counts(raw):
                continue
            hashes = tuple(raw.get("block_hashes") or ())
            if kind == "BlockRemoved":
                out.append(Removed(hashes))
                continue
            session = raw.get("session_id")
            out.append(Stored(session if isinstance(session, str) else None,
                              raw.get("parent_block_hash"), hashes,
                              int(raw.get("block_size") or 0)))
        # other event kinds (a newer vLLM's) say nothing about HBM residency
    return out


def continuity(expected: int | None, seq: int) -> tuple[Continuity, int]:
    """The verdict on batch ``seq`` arriving on the live stream when ``expected`` is the
    number expected next (None before the first batch), and the first batch missing
    before it (``seq`` itself when none is): see the module docstring."""
    if expected is None:
        return ("next", seq) if seq == 0 else ("gap", 0)
    if seq == expected:
        return "next", seq
    if seq > expected:
        return "gap", expected
    return "restart", 0


class HbmSink(Protocol):
    """Where a :class:`VLLMEventSubscriber` delivers. Called on its thread, one call at a
    time; an exception is logged and counted, and the stream goes on."""

    def hbm_changed(self, tokens: Mapping[str, int], *, full: bool) -> None:
        """Sessions whose HBM prefix changed, with their tokens there now (0: none);
        ``full``: a listing of every session believed in HBM (any other is not)."""


@dataclass(frozen=True, slots=True)
class VLLMEventStats:
    """A snapshot of one subscription."""

    state: SubscriptionState
    #: The sequence number expected next (-1 before the first batch).
    expected: int
    batches: int
    stored_events: int
    removed_events: int
    #: Batches asked of the replay socket and applied.
    replayed: int
    #: Resyncs, by :data:`ResyncReason`.
    resyncs: dict[str, int]
    disconnects: int
    #: Undecodable batches and sink errors; the last one's text.
    errors: int
    last_error: str
    hbm: HbmStats


class VLLMEventSubscriber:
    """Follows one vLLM engine's KV events (see the module docstring). ``endpoint`` is
    the publisher's address as a client reaches it (``tcp://host:port``),
    ``replay_endpoint`` its replay socket ("" = none); ``timeout_s`` bounds
    :meth:`start`'s wait for the connection and each replay.

    Who calls what: its owner (the prefetch agent) calls :meth:`start` once and
    :meth:`close` once; monitoring calls :meth:`stats` (any thread). Its thread calls the
    sink.
    """

    def __init__(self, endpoint: str, sink: HbmSink, *, replay_endpoint: str = "",
                 topic: str = "", timeout_s: float = 5.0, residency: HbmResidency | None = None,
                 bind: bool = False, name: str = "vllm-events") -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.timeout_s = timeout_s
        self.bind = bind
        self.name = name
        self.residency = residency if residency is not None else HbmResidency()
        self._sink = sink
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread: threading.Thread | None = None
        self._context: Any = None
        self._state: SubscriptionState = "new"
        self._expected: int | None = None
        #: Whether a full listing was delivered (the first delivery is one).
        self._listed = False
        self._batches = self._stored = self._removed = self._replayed = 0
        self._disconnects = self._errors = 0
        self._last_error = ""
        self._resyncs: dict[str, int] = {"events_lost": 0, "engine_restart": 0,
                                         "disconnected": 0}

    # -- lifecycle -------------------------------------------------------------------

    def start(self, wait_s: float | None = None) -> bool:
        """Connect (in the background) and wait up to ``wait_s`` (default ``timeout_s``)
        for the connection to the publisher. Returns whether it came; if not, the
        subscriber goes on trying.

        Raises:
            ImportError: pyzmq or msgpack is not installed.
        """
        import msgpack  # noqa: F401  (fail here, not on the first batch)
        import zmq

        with self._lock:
            if self._thread is None:
                self._context = zmq.Context()
                self._state = "connecting"
                self._thread = threading.Thread(target=self._run, name=self.name,
                                                daemon=True)
                self._thread.start()
        return self._connected.wait(self.timeout_s if wait_s is None else wait_s)

    def close(self) -> None:
        """Stop following and close the sockets. Idempotent."""
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
            self._state = "closed"
        if thread is not None:
            thread.join(self.timeout_s + 2.0)
        context, self._context = self._context, None
        if context is not None:
            context.term()

    def stats(self) -> VLLMEventStats:
        with self._lock:
            return VLLMEventStats(
                self._state, -1 if self._expected is None else self._expected,
                self._batches, self._stored, self._removed, self._replayed,
                dict(self._resyncs), self._disconnects, self._errors, self._last_error,
                self.residency.stats())

    # -- the stream ------------------------------------------------------------------

    def _run(self) -> None:
        import zmq

        ctx = self._context
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED
                                         | zmq.EVENT_DISCONNECTED)
        if self.bind:  # vLLM's publisher connects to us
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    ready = dict(poller.poll(int(POLL_S * 1000)))
                    if monitor in ready:
                        self._on_monitor(monitor)
                    if sub in ready:
                        self._on_batch(sub.recv_multipart())
                except zmq.ContextTerminated:
                    return
                except Exception as exc:  # never let one bad batch end the stream
                    self._count_error(f"{type(exc).__name__}: {exc}")
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    def _on_monitor(self, monitor: Any) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor)["event"]
        if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
            with self._lock:
                if self._state == "connecting":
                    self._state = "subscribed"
            self._connected.set()
        elif event == zmq.EVENT_DISCONNECTED:
            with self._lock:
                self._disconnects += 1
                self._state = "connecting"
            log.warning("%s: the connection to vLLM's KV events at %s dropped; HBM is "
                        "unknown until its events resume", self.name, self.endpoint)
            self._resync("disconnected")

    def _on_batch(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3:
            raise KVEventDecodeError(f"{len(frames)} frames, not (topic, seq, payload)")
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        with self._lock:
            expected = self._expected
            self._expected = seq + 1
        verdict, first = continuity(expected, seq)
        if verdict == "restart":
            log.warning("%s: vLLM's KV events restarted at batch %d (expected %s): the "
                        "engine restarted", self.name, seq, expected)
            self._resync("engine_restart")
        if verdict != "next" and not self._replay(first, seq):
            log.warning("%s: vLLM's KV events %d..%d are lost (no replay): HBM is unknown "
                        "until new events rebuild it", self.name, first, seq - 1)
            self._resync("events_lost")
        self._apply(decode_batch(payload))

    def _replay(self, first: int, upto: int) -> bool:
        """Batches ``first`` .. ``upto - 1`` from the replay socket, applied in order;
        whether all of them came (nothing to fetch: True)."""
        if first >= upto:
            return True
        if not self.replay_endpoint:
            return False
        import zmq

        req = self._context.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        try:
            req.connect(self.replay_endpoint)
            req.send_multipart((b"", first.to_bytes(8, "big")))
            batches: list[tuple[int, bytes]] = []
            while True:
                if not req.poll(int(self.timeout_s * 1000)):
                    self._count_error(f"replay from {self.replay_endpoint}: no answer "
                                      f"within {self.timeout_s:g} s")
                    return False
                frames = req.recv_multipart()
                if len(frames) != 4:
                    raise KVEventDecodeError(f"a replay answer of {len(frames)} frames")
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                if first <= seq < upto:
                    batches.append((seq, frames[3]))
        finally:
            req.close(0)
        batches.sort()
        if [s for s, _ in batches] != list(range(first, upto)):
            return False  # the buffer no longer reaches back to ``first``
        events = [e for _, payload in batches for e in decode_batch(payload)]
        with self._lock:
            self._replayed += len(batches)
        self._apply(events)
        return True

    def _apply(self, events: Sequence[Event]) -> None:
        """Events to the residency, the changed sessions to the sink."""
        residency = self.residency
        changed: dict[str, int] = {}
        stored = removed = 0
        for event in events:
            if isinstance(event, Stored):
                stored += 1
                changed.update(residency.stored(event.session, event.parent, event.hashes,
                                                event.block_size))
            elif isinstance(event, Removed):
                removed += 1
                changed.update(residency.removed(event.hashes))
            else:
                changed.update(residency.withdraw_all())
        with self._lock:
            self._batches += 1
            self._stored += stored
            self._removed += removed
            if self._state == "connecting":
                self._state = "subscribed"
        self._connected.set()
        if not self._listed:
            self._listed = True
            self._deliver(self._sink.hbm_changed, residency.listing(), True)
        elif changed:
            self._deliver(self._sink.hbm_changed, changed, False)

    def _resync(self, reason: ResyncReason) -> None:
        self.residency.withdraw_all()
        with self._lock:
            self._resyncs[reason] += 1
        self._listed = True
        self._deliver(self._sink.hbm_changed, {}, True)

    def _deliver(self, call: Callable[..., None], tokens: Mapping[str, int],
                 full: bool) -> None:
        try:
            call(tokens, full=full)
        except Exception as exc:  # the sink's bug must not end the stream
            log.exception("%s: HBM sink failed", self.name)
            self._count_error(f"sink: {type(exc).__name__}: {exc}", warn=False)

    def _count_error(self, text: str, *, warn: bool = True) -> None:
        with self._lock:
            self._errors += 1
            self._last_error = text
        if warn and not self._stop.is_set():
            log.warning("%s: %s", self.name, text)


__all__ = [
    "Cleared",
    "HbmSink",
    "KVEventDecodeError",
    "Removed",
    "Stored",
    "VLLMEventStats",
    "VLLMEventSubscriber",
    "VLLMEventsConfig",
    "continuity",
    "decode_batch",
]
