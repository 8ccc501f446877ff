"""vLLM's KV events, decoded and mapped to sessions (pure), and followed over ZMQ from a
publisher that speaks vLLM's wire protocol (``ZmqEventPublisher``: topic, 8-byte sequence,
msgpack ``KVEventBatch``; a ROUTER replay socket answering from a sequence number with the
batches it buffers and an end marker): the stream's continuity (gaps replayed or resynced,
an engine restart, a dropped connection) and a sink that fails. The real engine publishing
them is tests/agents/test_vllm_hbm_events.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgpack
import pytest
import zmq

from kvprefetch.agents.vllm.hbm_residency import HbmResidency
from kvprefetch.agents.vllm.kv_events import (
    Cleared,
    KVEventDecodeError,
    Removed,
    Stored,
    VLLMEventSubscriber,
    continuity,
    decode_batch,
)

BS = 16  # vLLM's block size in these events


def _stored(hashes: list[Any], parent: Any = None, session: str | None = "t/a",
            **kw: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": list(range(BS * len(hashes))), "block_size": BS, "lora_id": None,
            "medium": "GPU", "lora_name": None, "session_id": session, **kw}


def _removed(hashes: list[Any], **kw: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **kw}


def _batch(*events: dict[str, Any]) -> bytes:
    """A batch as vLLM's msgspec encoder writes it (array-like batch, tagged maps)."""
    return msgpack.packb([time.time(), list(events), 0], use_bin_type=True)


# -- decoding ------------------------------------------------------------------------------

def test_a_batch_decodes_to_the_hbm_events_in_order() -> None:
    payload = _batch(_stored([b"\x01" * 32, 7], parent=None), _removed([7]),
                     {"type": "AllBlocksCleared"},
                     _stored([9], medium="CPU"), _removed([9], group_idx=1),
                     {"type": "SomethingNewer", "x": 1})
    assert decode_batch(payload) == [Stored("t/a", None, (b"\x01" * 32, 7), BS),
                                      Removed((7,)), Cleared()]


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"ts": 1}),
                                     msgpack.packb([1.0, [3]])])
def test_a_payload_that_is_no_batch_is_a_typed_error(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


@pytest.mark.parametrize(("expected", "seq", "verdict"), [
    (None, 0, ("next", 0)), (None, 5, ("gap", 0)), (3, 3, ("next", 3)),
    (3, 7, ("gap", 3)), (9, 0, ("restart", 0)), (9, 4, ("restart", 0))])
def test_continuity(expected: int | None, seq: int, verdict: tuple[str, int]) -> None:
    assert continuity(expected, seq) == verdict


# -- blocks to sessions --------------------------------------------------------------------

def test_stores_build_a_session_s_prefix_and_a_removal_cuts_it() -> None:
    hbm = HbmResidency()
    assert hbm.stored("t/a", None, [1, 2], BS) == {"t/a": 2 * BS}
    assert hbm.stored("t/a", 2, [3], BS) == {"t/a": 3 * BS}
    # a shared prefix reused by another session (the full report mode names it again)
    assert hbm.stored("t/b", None, [1, 2], BS) == {"t/b": 2 * BS}
    assert hbm.removed([2]) == {"t/a": BS, "t/b": BS}  # the lookup stops at block 1
    assert hbm.removed([1]) == {"t/a": 0, "t/b": 0}
    assert len(hbm) == 0 and hbm.stats().blocks == 0


def test_a_turn_that_diverges_keeps_only_the_shared_prefix() -> None:
    hbm = HbmResidency()
    hbm.stored("t/a", None, [1, 2, 3], BS)
    hbm.stored("t/a", None, [1, 2], BS)  # the next turn reuses two blocks ...
    assert hbm.stored("t/a", 2, [8, 9], BS) == {"t/a": 4 * BS}  # ... and goes on elsewhere
    assert hbm.removed([3]) == {}  # not the session's any more


def test_stores_that_cannot_be_placed_are_ignored_and_counted() -> None:
    hbm = HbmResidency()
    assert hbm.stored(None, None, [1], BS) == {}  # no session named
    assert hbm.stored("t/a", 42, [5], BS) == {}  # its parent is not the session's
    assert hbm.stats().unplaced == 2 and len(hbm) == 0


def test_the_bound_drops_the_session_stored_longest_ago() -> None:
    hbm = HbmResidency(max_blocks=4)
    hbm.stored("t/a", None, [1, 2], BS)
    hbm.stored("t/b", None, [3, 4], BS)
    assert hbm.stored("t/c", None, [5], BS) == {"t/c": BS, "t/a": 0}
    assert hbm.listing() == {"t/b": 2 * BS, "t/c": BS}
    assert hbm.stats().dropped_sessions == 1


# -- the stream ----------------------------------------------------------------------------

class Publisher:
    """vLLM's ``ZmqEventPublisher`` protocol on loopback: PUB (topic, seq, payload) and a
    ROUTER replay socket; ``buffer`` batches kept for replay."""

    def __init__(self, *, replay: bool = True, buffer: int = 100) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = ""
        self.buffer: list[tuple[int, bytes]] = []
        self.keep = buffer
        self.seq = 0
        self._stop = threading.Event()
        self._replay: Any = None
        if replay:
            self._replay = self.ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            rport = self._replay.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def publish(self, payload: bytes, *, send: bool = True) -> None:
        """Batch number ``seq`` into the replay buffer, and on the wire unless ``send``
        is false (a batch the subscriber misses)."""
        seq, self.seq = self.seq, self.seq + 1
        self.buffer = [*self.buffer, (seq, payload)][-self.keep:]
        if send:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._replay.poll(50):
                continue
            client, _, start = self._replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", b"", seq.to_bytes(8, "big"),
                                                 payload))
            self._replay.send_multipart((client, b"", b"", (-1).to_bytes(8, "big",
                                                                         signed=True), b""))

    def close(self) -> None:
        self._stop.set()
        if self._replay is not None:
            self._thread.join(2)
            self._replay.close(0)
        self.pub.close(0)
        self.ctx.term()


class Sink:
    def __init__(self, fail_first: bool = False) -> None:
        self.calls: list[tuple[dict[str, int], bool]] = []
        self._fail = fail_first
        self.lock = threading.Lock()

    def hbm_changed(self, tokens: Mapping[str, int], *, full: bool) -> None:
        if self._fail:
            self._fail = False
            raise RuntimeError("a sink bug")
        with self.lock:
            self.calls.append((dict(tokens), full))


def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    p = Publisher()
    yield p
    p.close()


def _follow(pub: Publisher, sink: Sink, *, replay: bool = True) -> VLLMEventSubscriber:
    events = VLLMEventSubscriber(pub.endpoint, sink,
                                 replay_endpoint=pub.replay_endpoint if replay else "",
                                 timeout_s=2.0)
    assert events.start()
    time.sleep(0.5)  # a SUB socket's subscription reaches the publisher after it connects
    return events


def test_events_in_order_reach_the_sink(publisher: Publisher) -> None:
    sink = Sink()
    events = _follow(publisher, sink)
    try:
        publisher.publish(_batch(_stored([1, 2])))
        publisher.publish(_batch(_removed([2])))
        assert _until(lambda: len(sink.calls) == 2), sink.calls
        # the first delivery lists every session (readers drop an earlier subscriber's)
        assert sink.calls == [({"t/a": 2 * BS}, True), ({"t/a": BS}, False)]
        stats = events.stats()
        assert stats.state == "subscribed" and stats.expected == 2 and stats.replayed == 0
    finally:
        events.close()


def test_a_gap_is_replayed_from_the_engine_s_buffer(publisher: Publisher) -> None:
    sink = Sink()
    events = _follow(publisher, sink)
    try:
        publisher.publish(_batch(_stored([1, 2])))
        publisher.publish(_batch(_stored([3], parent=2)), send=False)  # lost on the way
        publisher.publish(_batch(_removed([3])))
        assert _until(lambda: events.stats().batches == 3), events.stats()
        assert events.stats().replayed == 1 and sum(events.stats().resyncs.values()) == 0
        assert events.residency.listing() == {"t/a": 2 * BS}
        assert sink.calls[0] == ({"t/a": 2 * BS}, True)
        assert all(not full for _, full in sink.calls[1:])
    finally:
        events.close()


def test_a_gap_beyond_the_replay_buffer_resyncs(publisher: Publisher) -> None:
    publisher.keep = 1
    sink = Sink()
    events = _follow(publisher, sink)
    try:
        publisher.publish(_batch(_stored([1, 2])))
        publisher.publish(_batch(_stored([3], parent=2)), send=False)
        publisher.publish(_batch(_stored([4])), send=False)
        publisher.publish(_batch(_stored([5], session="t/b")))
        assert _until(lambda: events.stats().resyncs["events_lost"] == 1), events.stats()
        assert _until(lambda: ({"t/b": BS}, False) in sink.calls), sink.calls
        # a full listing naming nobody (HBM unknown), then what the new events say
        assert ({}, True) in sink.calls
        assert events.residency.listing() == {"t/b": BS}
    finally:
        events.close()


def test_without_a_replay_socket_a_missed_first_batch_resyncs(publisher: Publisher) -> None:
    publisher.publish(_batch(_stored([1])))  # before anyone listens
    sink = Sink()
    events = _follow(publisher, sink, replay=False)
    try:
        publisher.publish(_batch(_stored([7], session="t/b")))
        assert _until(lambda: len(sink.calls) == 2), sink.calls
        assert sink.calls == [({}, True), ({"t/b": BS}, False)]
    finally:
        events.close()


def test_an_engine_restart_withdraws_every_session(publisher: Publisher) -> None:
    sink = Sink()
    events = _follow(publisher, sink)
    try:
        publisher.publish(_batch(_stored([1, 2])))
        publisher.publish(_batch(_stored([3], session="t/b")))
        assert _until(lambda: events.stats().batches == 2)
        publisher.seq, publisher.buffer = 0, []  # a new engine: its sequence starts again
        publisher.publish(_batch(_stored([4], session="t/c")))
        assert _until(lambda: events.stats().resyncs["engine_restart"] == 1), events.stats()
        assert _until(lambda: events.residency.listing() == {"t/c": BS})
        assert ({}, True) in sink.calls
    finally:
        events.close()


def test_a_dropped_connection_withdraws_every_session_and_the_stream_resumes() -> None:
    pub = Publisher(replay=False)
    sink = Sink()
    events = _follow(pub, sink, replay=False)
    try:
        pub.publish(_batch(_stored([1, 2])))
        assert _until(lambda: events.residency.listing() == {"t/a": 2 * BS})
        endpoint = pub.endpoint
        pub.close()  # the engine stops
        assert _until(lambda: events.stats().disconnects >= 1), events.stats()
        assert _until(lambda: events.residency.listing() == {}
                      and sink.calls[-1] == ({}, True)), sink.calls
        again = Publisher(replay=False)  # ... and comes back on its port
        again.pub.close(0)
        again.pub = again.ctx.socket(zmq.PUB)
        again.pub.bind(endpoint)
        try:
            assert _until(lambda: events.stats().state == "subscribed", 10.0)
            time.sleep(0.3)
            again.publish(_batch(_stored([5], session="t/b")))
            assert _until(lambda: events.residency.listing() == {"t/b": BS}), events.stats()
        finally:
            again.close()
    finally:
        events.close()


def test_a_sink_that_fails_and_a_garbled_batch_do_not_end_the_stream(
        publisher: Publisher) -> None:
    sink = Sink(fail_first=True)
    events = _follow(publisher, sink)
    try:
        publisher.publish(_batch(_stored([1])))  # the sink raises
        publisher.pub.send_multipart((b"", (1).to_bytes(8, "big"), b"\xc1"))  # garbled
        publisher.seq = 2
        publisher.publish(_batch(_stored([2], session="t/b")))
        assert _until(lambda: sink.calls == [({"t/b": BS}, False)]), sink.calls
        assert events.stats().errors == 2
    finally:
        events.close()


def test_bound_the_subscriber_takes_a_publisher_that_connects_to_it() -> None:
    """``bind``: vLLM's endpoint names the agent's address and its PUB connects (several
    nodes on one machine, each on its own address)."""
    ctx = zmq.Context()
    port = _free_port()
    sink = Sink()
    events = VLLMEventSubscriber(f"tcp://127.0.0.1:{port}", sink, bind=True, timeout_s=2.0)
    pub = ctx.socket(zmq.PUB)
    try:
        assert events.start(wait_s=0.2) is False  # nobody connected yet
        pub.connect(f"tcp://127.0.0.1:{port}")
        assert _until(lambda: events.stats().state == "subscribed")
        time.sleep(0.5)
        pub.send_multipart((b"", (0).to_bytes(8, "big"), _batch(_stored([1]))))
        assert _until(lambda: sink.calls == [({"t/a": BS}, True)]), sink.calls
    finally:
        pub.close(0)
        events.close()
        ctx.term()


def _free_port() -> int:
    from kvprefetch.agents.embedded import free_port

    return free_port()


def test_a_publisher_that_is_not_there_is_reported_by_start() -> None:
    events = VLLMEventSubscriber("tcp://127.0.0.1:9", Sink(), timeout_s=0.3)
    try:
        assert events.start() is False
        assert events.stats().state == "connecting"
    finally:
        events.close()


# -- the agent's knob: agent.vllm.kv_events --------------------------------------------------

def _agent(tmp_path: Any, valkey: Any, endpoint: str, mode: str, replay: str = "") -> Any:
    from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
    from kvprefetch.agents.stores.local import LocalTierConfig
    from kvprefetch.agents.vllm.kv_events import VLLMEventsConfig

    return PrefetchAgent(AgentConfig(
        node=0, remote=RemoteStoreConfig(valkey=valkey.store_config(key_prefix="ev:")),
        dram=LocalTierConfig(path=str(tmp_path / "tier"), capacity_bytes=1 << 20),
        vllm=VLLMEventsConfig(kv_events=mode, endpoint=endpoint, replay_endpoint=replay,
                              connect_timeout_s=0.5),
        status_interval_s=0))


@pytest.mark.servers
def test_kv_events_auto_reports_hbm_changes_through_the_agent(
        tmp_path: Any, valkey_server: Any, publisher: Publisher) -> None:
    with _agent(tmp_path, valkey_server, publisher.endpoint, "auto",
                publisher.replay_endpoint) as agent:
        time.sleep(0.3)
        publisher.publish(_batch(_stored([1, 2])))
        assert _until(lambda: agent.vllm_events().batches == 1), agent.vllm_events()
        agent.take_evictions(0.5)  # wakes for HBM changes too
        report = agent.take_hbm()
        assert report is not None and report.node == 0 and report.full  # the first: a listing
        assert report.sessions == (("t/a", 2 * BS),) and report.incarnation == agent.incarnation
        assert report.block_tokens == BS
        assert agent.take_hbm() is None
        agent.relist_hbm()  # a scheduler that restarted gets the whole listing again
        again = agent.take_hbm()
        assert again is not None and again.full and again.sessions == report.sessions


@pytest.mark.servers
def test_kv_events_required_refuses_to_start_without_the_publisher(
        tmp_path: Any, valkey_server: Any) -> None:
    from kvprefetch.controlplane.base.errors import ConfigError

    agent = _agent(tmp_path, valkey_server, "tcp://127.0.0.1:9", "required")
    with pytest.raises(ConfigError, match="--kv-events-config"):
        agent.start()


@pytest.mark.servers
def test_kv_events_auto_starts_without_the_publisher_and_off_never_follows(
        tmp_path: Any, valkey_server: Any, publisher: Publisher) -> None:
    with _agent(tmp_path, valkey_server, "tcp://127.0.0.1:9", "auto") as agent:
        stats = agent.vllm_events()
        assert stats is not None and stats.state == "connecting"
    with _agent(tmp_path, valkey_server, publisher.endpoint, "off") as agent:
        time.sleep(0.3)
        publisher.publish(_batch(_stored([1])))
        time.sleep(0.3)
        assert agent.vllm_events() is None and agent.take_hbm() is None
