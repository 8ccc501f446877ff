"""The README's HTTP API examples, pasted as written, against ``kvprefetch serve --address
local`` (a local Ray runtime, real Valkey and S3 on loopback, a per-tenant token): every
``curl`` answers 200 with the JSON the README shows."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from raycluster import _end, _pids_under  # noqa: E402

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def readme_http_block() -> str:
    """The README's bash block of curl calls to the HTTP API."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if "curl" in b and "/v1/route" in b]
    return block


def test_the_readme_block_calls_each_operation_with_a_json_body() -> None:
    block = readme_http_block()
    calls = re.findall(r"curl [^\n]*?(/v1/\w+)", block)
    assert calls == ["/v1/route", "/v1/request_finished", "/v1/hint", "/v1/session_state",
                     "/v1/session_closed"]
    assert block.count('-H "$J"') == len(calls) and 'J="Content-Type: application/json"' in block


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


@pytest.mark.servers
def test_the_readme_curl_examples_answer_200(tmp_path: Path, valkey_server: EmbeddedValkey,
                                             s3_server: EmbeddedS3) -> None:
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="kvpr", dir="/tmp")  # short: Ray's socket paths
    s3 = s3_server.store_config(key_prefix="readme/").model_dump(mode="json")
    s3["secret_access_key"] = s3_server.store_config().secret_access_key.get_secret_value()
    cfg = {
        "ray": {"address": "auto", "local_temp_dir": ray_tmp, "log_to_driver": False},
        "placement": {"resource": "GPU", "min_nodes": 1},
        "service": {"journal_path": str(tmp_path / "journal.jsonl")},
        "stores": {"valkey": valkey_server.store_config(key_prefix="readme:")
                   .model_dump(mode="json"), "s3": s3},
        "agent": {"tier_path": f"/dev/shm/kvp-readme-{os.getpid()}-{{node}}",
                  "tier_capacity_bytes": 64 * MIB},
        "http": {"host": "127.0.0.1", "port": port},
        "tenants": {"default": {"token": {"env": "KVPREFETCH_API_TOKEN"}}},
    }
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "KVPREFETCH_API_TOKEN": "readme-example-token-default"}
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvprefetch", "serve", "--config",
                                 str(tmp_path / "serve.yaml"), "--address", "local"],
                                cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        assert _wait_healthy(f"http://127.0.0.1:{port}", proc, 120), log_path.read_text()[-4000:]
        # curl reads ~/.curlrc: the status after each body, the commands left as written
        (tmp_path / ".curlrc").write_text('write-out = "\\n%{http_code}\\n"\n')
        script = readme_http_block().replace("localhost:8000", f"localhost:{port}")
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                             timeout=60, env={**env, "HOME": str(tmp_path)})
        assert out.returncode == 0, out.stderr
        lines = [line for line in out.stdout.splitlines() if line.strip()]
        bodies, statuses = lines[0::2], lines[1::2]
        assert statuses == ["200"] * 5, out.stdout
        route, finished, hint, state, closed = (json.loads(b) for b in bodies)
        assert route["node"] == 0
        assert finished["accepted"] and hint["accepted"] and closed["accepted"]
        assert state["session_id"] == "s1" and state["turns"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        _end(_pids_under(ray_tmp))
        subprocess.run(["rm", "-rf", ray_tmp], check=False)
        for d in Path("/dev/shm").glob(f"kvp-readme-{os.getpid()}-*"):
            subprocess.run(["rm", "-rf", str(d)], check=False)
