"""The real engine's HBM in the scheduler's books: vLLM's CPU build publishing its KV events
(``--kv-events-config``, ZMQ, with a replay socket), our gateway in front (it names each
request's session for vLLM), the node's prefetch agent following the events
(``vllm.kv_events: required``) and the scheduler service in process, fed by the agent's
reports as its Ray actor feeds it (:meth:`PrefetchAgent.take_hbm` ->
``hbm_changed``).

vLLM's prefix cache is cut to a few blocks (``--num-gpu-blocks-override``), so that the
sessions served after the first make vLLM evict the first one's blocks on its own; the
scheduler's HBM mirror of the node must drop it within a second of the request that
made room.

Needs ``make setup-vllm`` (``make test-vllm`` runs it in its own venv). Without vLLM the
test fails, it does not skip.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvprefetch.agents.embedded import EmbeddedValkey, free_port
from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.types import SessionKey

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.vllm]

TENANT = "acme"
PROMPT_TOKENS = 1000
#: vLLM's CPU block size (its default there) and the blocks its KV cache gets: room for
#: about three sessions' prompts.
BLOCK = 128
BLOCKS = 24
GIB = 1 << 30


def _require_vllm() -> None:
    from kvprefetch.agents.vllm.check_install import problems

    found = problems()
    if found:
        pytest.fail("vLLM's CPU build is not usable here (make setup-vllm): "
                    + "; ".join(found), pytrace=False)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(PROMPT_TOKENS)]


def _pump(agent, svc, stop: threading.Event) -> None:  # type: ignore[no-untyped-def]
    """What the agent's Ray actor does with its HBM reports (agents/ray_entry.py)."""
    while not stop.is_set():
        agent.take_evictions(0.1)
        report = agent.take_hbm()
        if report is not None:
            svc.hbm_changed(report)


@contextlib.contextmanager
def _node(tmp_path: Path, valkey: EmbeddedValkey) -> Iterator[tuple[object, object, str]]:
    """vLLM publishing its KV events, the agent following them, the scheduler, the
    gateway: yields (service, agent, gateway URL)."""
    from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
    from kvprefetch.agents.stores.local import LocalTierConfig
    from kvprefetch.agents.vllm.kv_events import VLLMEventsConfig
    from kvprefetch.agents.vllm.server import VLLMServer
    from kvprefetch.agents.vllm.tiny_model import generate
    from kvprefetch.controlplane.live.config import ServiceConfig
    from kvprefetch.controlplane.live.connect import connect
    from kvprefetch.controlplane.live.gateway import Gateway, GatewayConfig, serve_in_thread
    from kvprefetch.controlplane.live.service import SchedulerService

    model = generate(tmp_path / "tiny-llama")
    events, replay = free_port(), free_port()
    # vLLM binds a wildcard endpoint (a host address would make its PUB socket connect)
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    fleet = fleet_from_dict({"nodes": 1, "node": {"hbm_kv_bytes": 4 * GIB,
                                                  "dram_tier_bytes": 16 * GIB}})
    with contextlib.ExitStack() as stack:
        vllm = VLLMServer(model, max_model_len=2048, extra_args=(
            "--kv-events-config", json.dumps(kv_events),
            "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(BLOCKS)))
        try:
            stack.enter_context(vllm)
        except Exception:
            print(vllm.log_tail())
            raise
        svc = stack.enter_context(SchedulerService(ServiceConfig(
            fleet=fleet, engine="vllm-lmcache-lazy")).start())
        agent = stack.enter_context(PrefetchAgent(AgentConfig(
            node=0, remote=RemoteStoreConfig(valkey=valkey.store_config(key_prefix="hbm:")),
            dram=LocalTierConfig(path=str(tmp_path / "tier"), capacity_bytes=1 << 26),
            vllm=VLLMEventsConfig(kv_events="required", endpoint=f"tcp://127.0.0.1:{events}",
                                  replay_endpoint=kv_events["replay_endpoint"]),
            status_interval_s=0)))
        svc.agent_hello(agent.hello())
        stop = threading.Event()
        pump = threading.Thread(target=_pump, args=(agent, svc, stop), daemon=True)
        pump.start()
        stack.callback(pump.join, 5)
        stack.callback(stop.set)
        gateway = Gateway(GatewayConfig(upstreams=[vllm.url], tenant=TENANT,
                                        route_deadline_s=2.0),
                          scheduler=connect(service=svc, tenant=TENANT))
        url = stack.enter_context(serve_in_thread(gateway))
        yield svc, agent, url


def _complete(url: str, session: str, seed: int) -> None:
    import httpx

    response = httpx.post(f"{url}/v1/completions", timeout=120.0,
                          headers={"X-Session-ID": session},
                          json={"model": "tiny-llama", "prompt": _prompt(seed),
                                "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text


def _until(check, timeout_s: float) -> float | None:  # type: ignore[no-untyped-def]
    """Seconds until ``check()`` held, or None after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return time.monotonic() - start
        time.sleep(0.01)
    return None


def test_an_hbm_eviction_vllm_makes_on_its_own_reaches_the_books_within_a_second(
        tmp_path: Path, valkey_server: EmbeddedValkey) -> None:
    _require_vllm()
    with _node(tmp_path, valkey_server) as (svc, agent, url):
        fleet, core = svc.fleet, svc.driver.core  # type: ignore[attr-defined]
        first = SessionKey(TENANT, "s0").wire
        _complete(url, "s0", 0)
        # its full blocks (7 of 128 tokens) are in HBM, and the books know it
        held = _until(lambda: fleet.hbm_tokens(0, first) > 0, 1.0)
        assert held is not None, (agent.vllm_events(), fleet.nodes[0].hbm)
        assert fleet.nodes[0].hbm[first] == PROMPT_TOKENS // BLOCK * BLOCK
        evicted_at: float | None = None
        for i in range(1, 6):  # each new session needs room: vLLM evicts the oldest
            _complete(url, f"s{i}", i)
            evicted_at = _until(lambda: fleet.nodes[0].hbm.get(first, 0)
                                < PROMPT_TOKENS // BLOCK * BLOCK, 1.0)
            if evicted_at is not None:
                break
        stats = agent.vllm_events()
        assert evicted_at is not None, (stats, fleet.nodes[0].hbm)
        print(f"\nHBM eviction in the books {evicted_at * 1000:.0f} ms after the response "
              f"that made room ({stats})")
        assert stats is not None and stats.removed_events > 0
        assert stats.errors == 0 and sum(stats.resyncs.values()) == 0
        assert svc.summary()["hbm_evictions"] >= 1  # type: ignore[attr-defined]
        assert fleet.nodes[0].hbm_block_tokens == BLOCK  # vLLM's, as its events say
        assert core.local_tokens(0, first) > 0  # the DRAM tier's copy stays in the books
