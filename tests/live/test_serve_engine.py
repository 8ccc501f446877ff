"""``kvprefetch serve``'s ``engine``: the engine profile (as ``kvprefetch sim --engine``
names it) is validated with the field named, the scheduler's policy runs with the
mechanisms it grants, and each of them is set up on the nodes: ``local`` ranks the agents'
tiers by predicted use and trims sessions to a prefix; ``vllm-lmcache-lazy`` turns on
LMCache's ``lazy_offload`` in vLLM's connector config and the scheduler books a context
in DRAM when HBM evicts it, not when it is stored; the LMCache profiles turn on
``eager_prefetch`` (loads while queued). ``agent.vllm`` (vLLM's KV events) reaches every
agent with its node's address."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvprefetch.agents.backends.registry import BACKENDS
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.base.wire import HbmReport
from kvprefetch.controlplane.cli.serve_config import ServeConfig, load_serve_config
from kvprefetch.controlplane.core.engines import DEFAULT_ENGINE, ENGINES, Mechanism
from kvprefetch.controlplane.core.policies import EvictionKind
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService

MIB = 1 << 20
LMCACHE = {"backend": "lmcache-mp",
           "lmcache": {"http_url": "http://127.0.0.1:6556", "model_name": "m"}}
#: One node whose DRAM tier holds two 50k-token sessions of 8B KV and a 31,072-token gap
#: (tests/live/test_trim_advice.py).
ONE_NODE = {"node": {"hbm_kv_bytes": 4 << 30, "dram_tier_bytes": 16 << 30}}


def _load(tmp_path: Path, **over: Any) -> ServeConfig:
    cfg: dict[str, Any] = {"stores": {"valkey": {"host": "127.0.0.1", "port": 6379}},
                           "agent": {"tier_capacity_bytes": 64 * MIB}, "fleet": ONE_NODE}
    cfg.update(over)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_serve_config(path)


@pytest.mark.parametrize(("over", "field"), [
    ({"engine": "vllm"}, "engine: unknown engine profile 'vllm'; known: vllm-lmcache, "),
    ({"service": {"engine": "local"}}, "service.engine"),
    ({"engine": "local", "agent": LMCACHE}, "engine local"),
    ({"engine": "sglang-hicache", "agent": LMCACHE}, "engine sglang-hicache"),
    ({"agent": {"tier_capacity_bytes": 1, "tier_eviction": "predicted"}},
     "agent.tier_eviction: predicted"),
    ({"agent": {"tier_capacity_bytes": 1, "vllm": {"kv_events": "sometimes"}}},
     "agent.vllm.kv_events"),
])
def test_a_bad_engine_setting_fails_at_start_naming_the_field(
        tmp_path: Path, over: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, **over)
    assert str(tmp_path / "serve.yaml") in str(err.value) and field in str(err.value), err


def _trims(cfg: ServeConfig) -> list[Any]:
    """Three 50k-token sessions on one node whose tier holds two and a bit: the trims the
    scheduler decides (a victim cut back to a prefix)."""
    trims: list[Any] = []
    with SchedulerService(cfg.service_config(["n0"])).start() as svc:
        real = svc.driver.carry

        def carry(out: Any, box: Any) -> None:
            trims.extend(out.trims)
            real(out, box)

        svc.driver.carry = carry  # type: ignore[method-assign]
        c = connect(service=svc, tenant="t")
        for sid in ("a", "b", "c"):
            assert c.route(sid, input_tokens=49_900, reused_tokens=0).node == 0
            c.request_finished(sid, node=0, input_tokens=49_900, output_tokens=100)
    return trims


def test_engine_local_ranks_the_tiers_by_predicted_use_and_trims(tmp_path: Path) -> None:
    from kvprefetch.agents.stores.eviction import LruPolicy, PredictedNextUsePolicy, make_policy

    local = _load(tmp_path, engine="local")
    policy = local.service_config(["n0"]).policy_spec
    assert policy.engine == "local" and policy.eviction is EvictionKind.PREDICTED_USE
    tier = local.agent.dram(0)
    assert tier is not None and isinstance(make_policy(tier.eviction), PredictedNextUsePolicy)
    assert len(_trims(local)) == 1
    default = _load(tmp_path)
    assert default.engine == DEFAULT_ENGINE
    policy = default.service_config(["n0"]).policy_spec
    assert policy.engine == DEFAULT_ENGINE and policy.eviction is EvictionKind.LRU
    tier = default.agent.dram(0)
    assert tier is not None and isinstance(make_policy(tier.eviction), LruPolicy)
    assert _trims(default) == []  # whole sessions go: no trims on an LMCache L1


def _dram_after_finish(cfg: ServeConfig) -> tuple[int, int]:
    """DRAM tokens the books hold for a session whose context is in HBM when it
    finishes, then after HBM evicts it."""
    with SchedulerService(cfg.service_config(["n0"])).start() as svc:
        c = connect(service=svc, tenant="t")
        wire = SessionKey("t", "s").wire
        assert c.route("s", input_tokens=1000, reused_tokens=0).node == 0
        svc.hbm_changed(HbmReport(0, "", ((wire, 1100),)))
        c.request_finished("s", node=0, input_tokens=1000, output_tokens=100)
        at_finish = svc.driver.core.dram_tokens(0, wire)
        svc.hbm_changed(HbmReport(0, "", ((wire, 0),)))
        return at_finish, svc.driver.core.dram_tokens(0, wire)


def test_engine_lazy_sets_lazy_offload_and_books_dram_on_hbm_eviction(tmp_path: Path) -> None:
    lazy = _load(tmp_path, engine="vllm-lmcache-lazy", agent=LMCACHE)
    extra = lazy.vllm_connector("10.0.0.7", 6555)["kv_connector_extra_config"]
    assert extra == {"lmcache.mp.host": "tcp://10.0.0.7", "lmcache.mp.port": 6555,
                     "lmcache.mp.lazy_offload": True, "lmcache.mp.eager_prefetch": True}
    assert lazy.service_config(["n0"]).policy_spec.demote_on_evict
    assert _dram_after_finish(lazy) == (0, 1100)  # written to L1 as HBM evicts it
    write_through = _load(tmp_path, agent=LMCACHE)
    extra = write_through.vllm_connector("10.0.0.7", 6555)["kv_connector_extra_config"]
    assert "lmcache.mp.lazy_offload" not in extra and extra["lmcache.mp.eager_prefetch"]
    assert _dram_after_finish(write_through) == (1100, 1100)  # written when stored


def test_the_mechanisms_each_engine_grants_are_named_with_what_carries_them_out(
        tmp_path: Path) -> None:
    lazy = _load(tmp_path, engine="vllm-lmcache-lazy", agent=LMCACHE).engine_mechanisms()
    assert "lazy_offload" in lazy["demote-on-evict"] and "L1" in lazy["evict-advice"]
    local = _load(tmp_path, engine="local").engine_mechanisms()
    assert local["dram-ranking"] == "agent.tier_eviction: predicted" and "trims" in local
    own_tier = _load(tmp_path).engine_mechanisms()
    assert own_tier["evict-advice"] == "the agent's evict advice to its own tier"
    assert own_tier["queued-load"] == "the scheduler's demand order at routing"
    lmcache = _load(tmp_path, agent=LMCACHE).engine_mechanisms()
    assert "eager_prefetch" in lmcache["queued-load"] and "L1" in lmcache["evict-advice"]


def test_the_backend_registry_names_only_known_mechanisms_and_engines() -> None:
    """What serve's config reads from a backend's registry entry (the mechanisms it carries
    out its own way, the engine profiles it refuses) names real mechanisms and profiles."""
    known = {m.value for m in Mechanism}
    for name, spec in BACKENDS.items():
        assert set(spec.carried_by) <= known, name
        assert set(spec.refused_engines) <= set(ENGINES), name


def test_agent_vllm_reaches_each_agent_with_its_node_address(tmp_path: Path) -> None:
    cfg = _load(tmp_path, agent={
        "tier_capacity_bytes": 64 * MIB,
        "vllm": {"endpoint": "tcp://{node_ip}:5557", "replay_endpoint": "tcp://{node_ip}:5558",
                 "kv_events": "required"}})
    events = cfg.agent.vllm_for("10.1.2.3")
    assert events is not None and events.kv_events == "required"
    assert (events.endpoint, events.replay_endpoint) == ("tcp://10.1.2.3:5557",
                                                         "tcp://10.1.2.3:5558")
    assert _load(tmp_path).agent.vllm_for("10.1.2.3") is None
    moved = _load(tmp_path, agent={"tier_capacity_bytes": 1,
                                   "engine_url": "http://{node_ip}:8000"})
    assert moved.agent.engine_url_for("10.1.2.3") == "http://10.1.2.3:8000"
    # the deployment starts vLLM publishing where the agents listen
    assert cfg.vllm_kv_events() == {"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": "tcp://*:5557", "topic": "",
                                    "replay_endpoint": "tcp://*:5558"}
    assert _load(tmp_path).vllm_kv_events() is None
    off = _load(tmp_path, agent={"tier_capacity_bytes": 1, "vllm": {"kv_events": "off"}})
    assert off.vllm_kv_events() is None
    # several nodes on one machine: each agent binds its own address, vLLM connects there
    bound = _load(tmp_path, agent={"tier_capacity_bytes": 1, "vllm": {
        "endpoint": "tcp://{node_ip}:5557", "replay_endpoint": "tcp://{node_ip}:5558",
        "bind": True}})
    events = bound.vllm_kv_events("127.0.0.3")
    assert events is not None and events["endpoint"] == "tcp://127.0.0.3:5557"
    assert events["replay_endpoint"] == "tcp://127.0.0.3:5558"
    with pytest.raises(ConfigError, match="KVP_NODE_IP"):
        bound.vllm_kv_events("")
