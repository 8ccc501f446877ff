"""The deploy kit as an operator reads it: the fleet's GPU chosen by name sets the HBM left
for KV and the peak FLOP/s the cost model plans with; the KubeRay pod's ``/dev/shm`` holds
the LMCache L1 it is sized for; Prometheus scrapes serve and the gateway on the ports the
configs give, under the job names the alert rules expect; the deploy guide says how to
upgrade, roll back and back up the journal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvprefetch.controlplane.base.config import GIB, GPU_PRESETS, fleet_from_dict, load_fleet
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.units import parse_size

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "examples" / "deploy" / "kuberay"


@pytest.mark.parametrize(("gpu", "model", "kv_gib", "tflops"), [
    ("h100", "8b", 48, 989), ("a100", "8b", 48, 312), ("l40s", "8b", 22, 362),
    ("h100", "70b", 400, 989), ("a100", "70b", 400, 312), ("l40s", "70b", 170, 362),
])
def test_a_gpu_by_name_sets_kv_room_and_peak_flops(gpu: str, model: str, kv_gib: int,
                                                   tflops: int) -> None:
    fleet = fleet_from_dict({"model": model, "gpu": gpu, "nodes": 2})
    assert fleet.node.hbm_kv_bytes == kv_gib * GIB
    assert fleet.node.peak_flops_per_gpu == tflops * 1e12
    # the node section still overrides a field; the others stay the GPU's
    over = fleet_from_dict({"model": model, "gpu": gpu, "node": {"nic_gbps": 400}})
    assert over.node.nic_gbps == 400 and over.node.hbm_kv_bytes == kv_gib * GIB


def test_an_l40s_prefills_slower_than_an_h100() -> None:
    h100 = fleet_from_dict({"model": "8b", "gpu": "h100"})
    l40s = fleet_from_dict({"model": "8b", "gpu": "L40S"})
    assert l40s.prefill_s(8192, 0) > 2 * h100.prefill_s(8192, 0)


def test_an_unknown_gpu_names_the_field_and_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"field 'gpu': unknown GPU 'v100'; known: "
                                          r"a100, h100, l40s"):
        fleet_from_dict({"model": "8b", "gpu": "v100"})
    assert set(GPU_PRESETS) == {"h100", "a100", "l40s"}


def test_the_example_fleets_name_their_gpu() -> None:
    assert load_fleet(ROOT / "examples" / "fleet.yaml").node.hbm_kv_bytes == 48 * GIB
    for path in (ROOT / "examples" / "serve.yaml", KUBERAY / "configmap-serve.yaml"):
        text = path.read_text()
        doc = yaml.safe_load(text)
        if "serve.yaml" in doc.get("data", {}):
            doc = yaml.safe_load(doc["data"]["serve.yaml"])
        assert doc["fleet"]["gpu"] == "h100" and "hbm_kv_bytes" not in doc["fleet"]["node"]


def _gpu_pod() -> dict:
    docs = list(yaml.safe_load_all((KUBERAY / "raycluster.yaml").read_text()))
    (cluster,) = [d for d in docs if d and d.get("kind") == "RayCluster"]
    (group,) = cluster["spec"]["workerGroupSpecs"]
    return group["template"]["spec"]


def test_the_gpu_pod_shared_memory_holds_the_lmcache_l1() -> None:
    pod = _gpu_pod()
    (lmcache,) = [c for c in pod["containers"] if c["name"] == "lmcache"]
    l1_gib = int(re.search(r"--l1-size-gb (\d+)", lmcache["command"][-1]).group(1))
    (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory"
    size = parse_size(dshm["emptyDir"]["sizeLimit"].replace("Gi", "GiB"))
    assert size >= (l1_gib + 1) * GIB, (l1_gib, dshm)
    # the memory-backed volume is charged to the container that fills it
    assert parse_size(lmcache["resources"]["limits"]["memory"].replace("Gi", "GiB")) \
        >= l1_gib * GIB


def test_prometheus_scrapes_serve_and_the_gateway_under_the_alerts_job_names() -> None:
    scrape = yaml.safe_load((ROOT / "examples" / "prometheus-scrape.yaml").read_text())
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    assert set(jobs) == {"kvprefetch-serve", "kvprefetch-gateway"}
    serve_port = yaml.safe_load((ROOT / "examples" / "serve.yaml").read_text())["http"]["port"]
    assert jobs["kvprefetch-serve"]["static_configs"][0]["targets"][0].endswith(f":{serve_port}")
    assert jobs["kvprefetch-gateway"]["static_configs"][0]["targets"][0].endswith(":8080")
    assert all(j["metrics_path"] == "/metrics" for j in jobs.values())
    assert jobs["kvprefetch-serve"]["authorization"]["credentials_file"]
    alerts = (ROOT / "examples" / "prometheus-alerts.yaml").read_text()
    assert "kvprefetch" in alerts


def test_the_deploy_guide_has_ports_upgrade_rollback_and_journal_backup() -> None:
    guide = (ROOT / "docs" / "guides" / "deploy.md").read_text()
    for heading in ("## GPUs", "## Ports per role", "## Upgrade, rollback and journal backup"):
        assert heading in guide
    section = guide[guide.index("## Upgrade, rollback"):]
    for step in ("Back it up", "Upgrade", "Roll back", "kvprefetch journal check"):
        assert step in section
    assert "examples/prometheus-scrape.yaml" in guide
