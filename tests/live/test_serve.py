"""``kvprefetch serve``: config validation (errors name the field), node matching for
placement, and a real run on a local one-node Ray runtime: agents placed, HTTP API up,
a round trip through it, clean shutdown on SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("ray")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from raycluster import _end, _pids_under  # noqa: E402

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey, free_port  # noqa: E402
from kvprefetch.controlplane.base.errors import ConfigError  # noqa: E402
from kvprefetch.controlplane.base.shards import ShardRing  # noqa: E402
from kvprefetch.controlplane.cli import main  # noqa: E402
from kvprefetch.controlplane.cli.serve_config import load_serve_config  # noqa: E402
from kvprefetch.controlplane.live.connect import connect  # noqa: E402
from kvprefetch.controlplane.live.ray_app import gpu_node_placements, matching_nodes  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def _minimal(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"stores": {"valkey": {"host": "127.0.0.1", "port": 6379}},
                           "agent": {"tier_capacity_bytes": 64 * MIB}}
    cfg.update(over)
    return cfg


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_example_config_is_valid(monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVPREFETCH_API_TOKEN", "secret-of-the-default-tenant")
    cfg = load_serve_config(ROOT / "examples" / "serve.yaml")
    assert cfg.placement.resource == "GPU" and cfg.http.token() is None  # tenant tokens
    assert cfg.auth().authenticate("secret-of-the-default-tenant").tenant == "default"
    assert cfg.stores.valkey is not None and cfg.stores.s3 is not None
    assert cfg.service_config(["a", "b", "c"]).fleet.nodes == 3
    # --check refuses the placeholders left in it (tests/deploy/test_serve_check.py)
    assert main(["serve", "--config", str(ROOT / "examples" / "serve.yaml"), "--check"]) == 2
    assert "ok config" in capsys.readouterr().out


@pytest.mark.parametrize(("cfg", "field"), [
    (_minimal(http={"port": 70000}), "http.port"),
    (_minimal(http={"bearer_token": "a", "bearer_token_env": "B"}), "http"),
    (_minimal(stores={"valkey": {"port": "x"}}), "stores.valkey.port"),
    (_minimal(stores={}), "stores"),
    (_minimal(agent={}), "agent.tier_capacity_bytes"),
    (_minimal(agent={"tier_capacity_bytes": 1, "tier_path": "/dev/shm/{nod}"}), "agent"),
    (_minimal(placement={"min_nodes": 0}), "placement.min_nodes"),
    (_minimal(placement={"min_nodes": 3, "max_nodes": 2}), "placement"),
    (_minimal(fleet={"nodes": 4}), "fleet.nodes"),
    (_minimal(fleet={"node": {"nic_gbps": -1}}), "node.nic_gbps"),
    (_minimal(service={"policy": "nope"}), "unknown policy 'nope'"),
    (_minimal(service={"policy": "perfect"}), "simulator only"),
    (_minimal(service={"predictor": "zzz"}), "service.predictor"),
    (_minimal(service={"loop_interval_s": 0}), "service.loop_interval_s"),
    (_minimal(service={"fleet": {}}), "service.fleet"),
    (_minimal(colour="red"), "colour"),
    (_minimal(http={"front_end": "scheduler"}, service={"shards": 2}), "http.front_end"),
    (_minimal(http={"front_end": "actor"}), "http.front_end"),
    (_minimal(agent={"tier_capacity_bytes": 1, "tier_eviction": "mru"}),
     "agent.tier_eviction"),
    (_minimal(agent={"tier_capacity_bytes": 1, "backend": "sglang"}), "agent.sglang section"),
    (_minimal(agent={"backend": "sglang", "sglang": {"model_name": "m"}}),
     "agent.tier_capacity_bytes"),
    (_minimal(agent={"tier_capacity_bytes": 1, "backend": "sglang",
                     "sglang": {"model_name": "m", "page_size": 0}}), "agent.sglang.page_size"),
])
def test_bad_configs_fail_at_start_naming_the_field(tmp_path: Path, cfg: dict[str, Any],
                                                    field: str) -> None:
    path = _write(tmp_path, cfg)
    with pytest.raises(ConfigError) as err:
        load_serve_config(path)
    assert str(path) in str(err.value) and field in str(err.value), str(err.value)


def test_the_tier_eviction_knob_reaches_every_agent_tier(tmp_path: Path) -> None:
    """``agent.tier_eviction: predicted`` ranks each local tier by the scheduler's
    predicted next use (the ``local`` engine profile's DRAM ranking); LRU by default."""
    from kvprefetch.agents.stores.eviction import LruPolicy, PredictedNextUsePolicy, make_policy

    default = load_serve_config(_write(tmp_path, _minimal())).agent.dram(0)
    assert default is not None and isinstance(make_policy(default.eviction), LruPolicy)
    # the agent owns its DRAM tier: a clean stop gives the memory back
    assert default.kind == "dram" and default.remove_on_close
    ranked = load_serve_config(_write(tmp_path, _minimal(engine="local", agent={
        "tier_capacity_bytes": 64 * MIB, "tier_eviction": "predicted"}))).agent.dram(2)
    assert ranked is not None
    assert isinstance(make_policy(ranked.eviction), PredictedNextUsePolicy)


def test_the_sglang_backend_fills_each_node_tier_with_sglang_pages(tmp_path: Path) -> None:
    cfg = load_serve_config(_write(tmp_path, _minimal(agent={
        "backend": "sglang", "tier_capacity_bytes": 64 * MIB, "tier_path": "/dev/shm/kvp-{node}",
        "sglang": {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "tp_size": 2}})))
    a = cfg.agent
    assert a.backend == "sglang" and a.sglang is not None and a.sglang.tp_size == 2
    tier = a.dram(3)
    assert tier is not None and tier.path == "/dev/shm/kvp-3" and tier.capacity_bytes == 64 * MIB


def test_a_missing_token_variable_and_a_missing_file_are_config_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVP_TEST_TOKEN", raising=False)
    path = _write(tmp_path, _minimal(http={"bearer_token_env": "KVP_TEST_TOKEN"}))
    with pytest.raises(ConfigError, match="KVP_TEST_TOKEN"):
        load_serve_config(path).http.token()
    assert main(["serve", "--config", str(path), "--check"]) == 2
    with pytest.raises(ConfigError, match="not found"):
        load_serve_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_serve_config(tmp_path / "list.yaml")


def _node(node_id: str, resources: dict[str, float], labels: dict[str, str] | None = None,
          alive: bool = True) -> dict[str, Any]:
    return {"NodeID": node_id, "Alive": alive, "Resources": resources,
            "Labels": labels or {}, "NodeManagerAddress": f"10.0.0.{node_id}"}


def test_placement_matches_gpu_resource_custom_resource_and_labels() -> None:
    nodes = [
        _node("3", {"CPU": 8, "GPU": 1}, {"kvprefetch/role": "gpu"}),
        _node("1", {"CPU": 8}),  # the head: no GPU
        _node("2", {"CPU": 8, "GPU": 8, "kv_node": 1}),
        _node("4", {"CPU": 8, "GPU": 1}, {"kvprefetch/role": "gpu"}, alive=False),
    ]
    assert [p.node_id for p in gpu_node_placements(nodes)] == ["2", "3"]  # NodeID order
    assert [p.node_id for p in gpu_node_placements(nodes, resource="kv_node")] == ["2"]
    assert [p.node_id for p in gpu_node_placements(nodes, resource=None)] == ["1", "2", "3"]
    assert [n["NodeID"] for n in matching_nodes(
        nodes, labels={"kvprefetch/role": "gpu"})] == ["3"]
    assert matching_nodes(nodes, labels={"kvprefetch/role": "cpu"}) == []
    assert gpu_node_placements(nodes)[0].node_id == "2"


@pytest.mark.servers
@pytest.mark.parametrize(("shards", "front_end"),
                         [(1, "serve"), (2, "serve"), (1, "scheduler")])
def test_serve_on_a_local_ray_runtime(tmp_path: Path, valkey_server: EmbeddedValkey,
                                      s3_server: EmbeddedS3, shards: int,
                                      front_end: str) -> None:
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="kvps", dir="/tmp")  # short: Ray's socket paths
    tier = f"/dev/shm/kvp-serve-{os.getpid()}-{{node}}"
    s3 = s3_server.store_config(key_prefix="serve-test/").model_dump(mode="json")
    s3["secret_access_key"] = s3_server.store_config().secret_access_key.get_secret_value()
    cfg = {
        "ray": {"address": "auto", "local_temp_dir": ray_tmp, "log_to_driver": False},
        "placement": {"resource": "GPU", "min_nodes": 1},
        "fleet": {"model": "8b"},
        "service": {"policy": "predictive", "predictor": "hinted",
                    "journal_path": str(tmp_path / "journal.jsonl"), "shards": shards},
        "stores": {"valkey": valkey_server.store_config(key_prefix="serve-test:")
                   .model_dump(mode="json"), "s3": s3},
        "agent": {"tier_path": tier, "tier_capacity_bytes": 64 * MIB},
        "http": {"host": "127.0.0.1", "port": port, "bearer_token": "tok",
                 "front_end": front_end},
    }
    path = _write(tmp_path, cfg)
    log_path = tmp_path / "serve.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvprefetch", "serve", "--config", str(path),
             "--address", "local"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait_healthy(url, proc, 90), log_path.read_text()[-4000:]
        # The API in the scheduler's process answers before serve has placed every agent.
        assert _wait_ready(log_path, proc, 90), log_path.read_text()[-4000:]
        ready_s = time.monotonic() - started
        with connect(url, token="tok", tenant="acme", timeout_s=5) as c:
            ans = c.route("s1", input_tokens=4096)
            assert ans.node == 0 and ans.node_name and not ans.timed_out
            assert c.request_finished("s1", node=0, input_tokens=4096).accepted
            assert c.hint("s1", "tool_running", eta_s=2.0).accepted
            assert c.session_closed("s1").accepted
        assert httpx.post(f"{url}/v1/route", json={"session_id": "x", "input_tokens": 1}
                          ).status_code == 401
        metrics = httpx.get(f"{url}/metrics").text
        if shards == 1:
            assert 'kvprefetch_events_total{kind="request_started"} 1.0' in metrics
        else:  # each shard's samples, labelled; s1's shard saw the one request
            owner = ShardRing(shards).owner("acme", "s1")
            started = f'kvprefetch_events_total{{kind="request_started",shard="{owner}"}} 1.0'
            assert started in metrics
            assert metrics.count("# TYPE kvprefetch_events_total counter") == 1
        assert "kvprefetch_prefetch_lateness_seconds" in metrics
        assert "kvprefetch_ttlb_seconds" in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        leftovers = _pids_under(ray_tmp)
        _end(leftovers)
        subprocess.run(["rm", "-rf", ray_tmp], check=False)
        for d in Path("/dev/shm").glob(f"kvp-serve-{os.getpid()}-*"):
            subprocess.run(["rm", "-rf", str(d)], check=False)
    out = log_path.read_text()
    assert "placed agent 0" in out and "HTTP API on" in out, out[-4000:]
    where = "in the scheduler actor's process" if front_end == "scheduler" else "in this process"
    assert f"HTTP API on {url} ({where}" in out, out[-4000:]
    assert "kvprefetch serve stopped" in out, out[-4000:]
    assert not leftovers, f"Ray processes left running after SIGTERM: {leftovers}"
    journals = ([tmp_path / "journal.jsonl"] if shards == 1 else
                [tmp_path / f"journal.jsonl.shard{i}of{shards}" for i in range(shards)])
    assert all(j.stat().st_size > 0 for j in journals)  # every shard journals (its epoch)
    print(f"serve ready after {ready_s:.1f} s")


def _wait_ready(log_path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether serve printed its ready line within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "kvprefetch serve: ready" in log_path.read_text(errors="replace"):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return True
        time.sleep(0.2)
    return False


def _serve_local(path: Path, ray_tmp: str) -> subprocess.CompletedProcess[str]:
    """``kvprefetch serve --config PATH --address local`` run to its end (a start that
    fails), then every process of its Ray session ended and ``ray_tmp`` removed."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "kvprefetch", "serve", "--config", str(path), "--address",
             "local"], cwd=ROOT, capture_output=True, text=True, timeout=180,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    finally:
        _end(_pids_under(ray_tmp))
        subprocess.run(["rm", "-rf", ray_tmp], check=False)


@pytest.mark.servers
def test_an_actor_that_fails_at_start_is_one_line_naming_it_and_the_cause(
        tmp_path: Path, valkey_server: EmbeddedValkey) -> None:
    """The agent's tier cannot be made (its path runs through a file): serve exits 2 with
    one line that names the agent and the error, not Ray's traceback of the actor."""
    ray_tmp = tempfile.mkdtemp(prefix="kvpf", dir="/tmp")  # short: Ray's socket paths
    (tmp_path / "a-file").write_text("")
    cfg = {
        "ray": {"local_temp_dir": ray_tmp, "log_to_driver": True},
        "stores": {"valkey": valkey_server.store_config(key_prefix="serve-fail:")
                   .model_dump(mode="json")},
        "agent": {"tier_path": str(tmp_path / "a-file" / "kvp-{node}"),
                  "tier_capacity_bytes": 64 * MIB},
        "http": {"host": "127.0.0.1", "port": free_port(), "bearer_token": "tok"},
    }
    done = _serve_local(_write(tmp_path, cfg), ray_tmp)
    assert done.returncode == 2, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvprefetch: ")]
    assert len(errors) == 1, done.stderr[-4000:]
    assert errors[0].startswith("kvprefetch: error: the agent failed to start: "), errors
    assert "StoreConfigError" in errors[0] and "a-file/kvp-0: " in errors[0]
    assert "Not a directory" in errors[0]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]


def test_the_ready_line_names_the_address_listened_on_and_the_local_url() -> None:
    from kvprefetch.controlplane.cli.serve import listening_on

    assert listening_on("0.0.0.0", "http://127.0.0.1:8000") == (
        "HTTP API on 0.0.0.0:8000 (all interfaces; http://127.0.0.1:8000 from this machine)")
    assert listening_on("127.0.0.1", "http://127.0.0.1:8000") == (
        "HTTP API on http://127.0.0.1:8000")


@pytest.mark.servers
def test_an_lmcache_url_that_is_not_an_lmcache_server_is_one_line_naming_the_field(
        tmp_path: Path, valkey_server: EmbeddedValkey) -> None:
    """Something else listens at ``agent.lmcache.http_url`` (it passes the check's TCP
    probe, and answers a request with another protocol's banner): the agent fails at start,
    and serve exits 2 with one line naming the agent, the cause and the field to check, not
    Ray's traceback."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_nonsense() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.recv(4096)
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    threading.Thread(target=answer_nonsense, daemon=True).start()
    ray_tmp = tempfile.mkdtemp(prefix="kvpl", dir="/tmp")  # short: Ray's socket paths
    cfg = {
        "ray": {"local_temp_dir": ray_tmp, "log_to_driver": True},
        "stores": {"valkey": valkey_server.store_config(key_prefix="serve-lmc:")
                   .model_dump(mode="json")},
        "agent": {"backend": "lmcache-mp",
                  "lmcache": {"http_url": f"http://127.0.0.1:{port}",
                              "model_name": "meta-llama/Llama-3.1-8B-Instruct"}},
        "http": {"host": "127.0.0.1", "port": free_port(), "bearer_token": "tok"},
    }
    try:
        done = _serve_local(_write(tmp_path, cfg), ray_tmp)
    finally:
        listener.close()
    assert done.returncode == 2, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvprefetch: ")]
    assert len(errors) == 1, done.stderr[-4000:]
    assert errors[0].startswith("kvprefetch: error: the agent failed to start: LMCache"), errors
    assert f"127.0.0.1:{port}" in errors[0], errors
    assert errors[0].endswith("(check agent.lmcache.http_url)"), errors
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
