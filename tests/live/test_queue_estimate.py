"""A node's modelled queue under engines that report no GPU start (vLLM, SGLang behind the
gateway: route, then request_finished): a routed request's estimate counts while it is in
flight and leaves the queue when it ends, so an idle node's queue is empty and a hinted
session's warm is not taken for one the queue would hide. In process, with the scheduler's
orders recorded (no agents)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
from kvptest.live_fleet import RecordingPort

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.wire import AgentHello
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.service import SchedulerService

CHUNK = 256
PROMPT = 2048
#: The tiny Llama of the local-cluster test: 1 KiB of KV per token, a node's DRAM tier one
#: context and half a chunk, HBM half a context.
FLEET = fleet_from_dict({
    "nodes": 2,
    "model": {"name": "tiny", "layers": 2, "parameters": 1.3e6, "kv_heads": 2, "head_dim": 64,
              "d_model": 256, "dtype_bytes": 2, "decode_s_per_token": 0.005,
              "max_context_tokens": 4096},
    "node": {"hbm_kv_bytes": PROMPT // 2 * 1024, "dram_tier_bytes": (PROMPT + CHUNK // 2) * 1024},
    "planner": {"prefetch_min_win_share": 0.0}})


@pytest.fixture
def service() -> Iterator[tuple[SchedulerService, dict[int, RecordingPort]]]:
    ports = {0: RecordingPort(), 1: RecordingPort()}
    svc = SchedulerService(ServiceConfig(fleet=FLEET, chunk_tokens=CHUNK,
                                         engine="vllm-lmcache"), agents=ports).start()
    for node in ports:
        svc.agent_hello(AgentHello(node, f"agent-{node}", f"gpu-{node}"))
    try:
        yield svc, ports
    finally:
        svc.close()


def _route(svc: SchedulerService, sid: str, tokens: list[int]) -> int:
    node = svc.route({"tenant": "t", "session_id": sid, "token_ids": tokens}).node
    assert node is not None
    return node


def _finish(svc: SchedulerService, sid: str, node: int, tokens: int) -> None:
    svc.request_finished({"tenant": "t", "session_id": sid, "node": node,
                          "input_tokens": tokens, "output_tokens": 1})


def test_a_request_s_estimate_leaves_the_queue_when_it_ends(
        service: tuple[SchedulerService, dict[int, RecordingPort]]) -> None:
    svc, _ = service
    rng = random.Random(3)
    routed = {}
    for sid in ("a", "b", "c"):
        routed[sid] = _route(svc, sid, [rng.randrange(256) for _ in range(PROMPT)])
    now = svc.clock.now_s()
    assert sum(svc.fleet.queue_wait_s(n, now) for n in (0, 1)) > 0  # in flight: queued
    for sid, node in routed.items():
        _finish(svc, sid, node, PROMPT)
    now = svc.clock.now_s()
    assert [svc.fleet.queue_wait_s(n, now) for n in (0, 1)] == [0.0, 0.0]


def test_a_hinted_session_is_warmed_back_on_an_idle_node(
        service: tuple[SchedulerService, dict[int, RecordingPort]]) -> None:
    """The local-cluster scenario: s1 is evicted from its node's tier by another
    session's turn there; a tool_running hint with a short ETA orders its warm back."""
    svc, ports = service
    rng = random.Random(7)
    s1 = [rng.randrange(256) for _ in range(PROMPT)]
    node = _route(svc, "s1", s1)
    _finish(svc, "s1", node, PROMPT)
    svc.hint({"tenant": "t", "session_id": "s1",
              "hint": {"kind": "tool_running", "eta_s": 600}})
    for i in range(8):
        other = f"other{i}"
        tokens = [rng.randrange(256) for _ in range(PROMPT - CHUNK // 4)]
        served = _route(svc, other, tokens)
        _finish(svc, other, served, len(tokens))
        if served == node:
            break
    else:
        pytest.fail(f"no other session was routed to node {node}")
    svc.hint({"tenant": "t", "session_id": other, "hint": {"kind": "user_typing"}})
    assert not ports[node].orders
    svc.hint({"tenant": "t", "session_id": "s1", "hint": {"kind": "tool_running", "eta_s": 2}})
    deadline = time.monotonic() + 10
    while not ports[node].orders and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(o.session_id, o.prefetch) for o in ports[node].orders] == [("t/s1", True)]
    assert svc.core.stats.prefetches_hidden_by_queue == 0
