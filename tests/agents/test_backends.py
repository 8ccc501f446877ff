"""The node-backend seam: one protocol, one registry by name, one folder per backend. The
registry loads each backend it names and the class answers the protocol; a config names only
registered backends and gets a clear error for a missing section; nothing outside the
registry branches on a backend's name; the ``local`` backend, driven through the protocol
alone, warms, lists, trims and evicts a real tier."""

from __future__ import annotations

import ast
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError

from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
from kvprefetch.agents.backends import (
    BACKENDS,
    DEFAULT_BACKEND,
    BackendContext,
    BackendName,
    backend_spec,
    require_settings,
)
from kvprefetch.agents.backends.base import NodeBackend
from kvprefetch.agents.backends.sglang.warmer import SGLangWarmConfig
from kvprefetch.agents.backends.tokens import put_session_tokens, synthetic_tokens
from kvprefetch.agents.embedded import EmbeddedValkey
from kvprefetch.agents.sglang.keys import PageKeyScheme, page_hashes
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.agents.stores.valkey import ValkeyStoreConfig
from kvprefetch.agents.transfer import TransferConfig
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.keys import (
    payload,
    position_keys,
    session_prefix,
    tenant_cache_salt,
)
from kvprefetch.controlplane.base.wire import TransferOrder

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_METHODS = ("start", "close", "describe", "warm", "evict", "write", "trim", "listing",
                    "has", "holds", "stats", "events")


def test_every_registered_name_loads_a_class_with_the_protocol_methods() -> None:
    assert set(BACKENDS) == set(get_args(BackendName)) == {"local", "lmcache-mp", "sglang"}
    for name, spec in BACKENDS.items():
        cls = spec.load()
        missing = [m for m in PROTOCOL_METHODS if not callable(getattr(cls, m, None))]
        assert not missing, f"{name}: {cls.__name__} lacks {missing}"
        assert cls.__module__.startswith(f"kvprefetch.agents.backends.{spec.target.split('.')[3]}")


def test_an_unknown_backend_is_a_config_error_that_lists_the_known() -> None:
    with pytest.raises(ConfigError, match=r"unknown node backend 'redis'.*local, lmcache-mp"):
        backend_spec("redis")


@pytest.mark.parametrize("name, sections, message", [
    ("local", {}, r"backend 'local' needs 'dram' \(the node's local tier\)"),
    ("lmcache-mp", {"dram": object()}, "backend 'lmcache-mp' needs 'lmcache'"),
    ("sglang", {"dram": object()}, "backend 'sglang' needs 'dram' .* and 'sglang'"),
])
def test_a_missing_section_names_what_the_backend_needs(
        name: str, sections: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        require_settings(name, sections)


def test_agent_config_refuses_a_backend_without_its_section() -> None:
    remote = RemoteStoreConfig(valkey=ValkeyStoreConfig(host="127.0.0.1", port=1))
    with pytest.raises(ValidationError, match="backend 'sglang' needs 'dram'"):
        AgentConfig(node=0, backend="sglang", remote=remote)
    with pytest.raises(ValidationError, match="backend"):
        AgentConfig(node=0, backend="redis", remote=remote)  # type: ignore[arg-type]


def test_the_registry_entries_say_what_callers_branch_on() -> None:
    assert backend_spec("local").needs_tier and backend_spec("sglang").needs_tier
    assert not backend_spec("lmcache-mp").needs_tier
    assert backend_spec("lmcache-mp").engine_stores_through_server
    assert not backend_spec("local").engine_stores_through_server
    assert [n for n, spec in BACKENDS.items() if spec.server is not None] == ["lmcache-mp"]
    assert backend_spec(DEFAULT_BACKEND).needs_tier and backend_spec(DEFAULT_BACKEND).server is None
    assert "sglang-hicache" in backend_spec("lmcache-mp").refused_engines
    assert not backend_spec("sglang").refused_engines


def test_a_node_server_reads_its_url_from_the_backend_settings() -> None:
    from kvprefetch.agents.backends.lmcache.warmer import LMCacheBackendConfig

    server = backend_spec("lmcache-mp").server
    assert server is not None
    settings = LMCacheBackendConfig(http_url="http://10.0.0.9:6556", model_name="m")
    assert server.url_of(settings) == "http://10.0.0.9:6556"


# ------------------------------------------------------------------ no name branches
def _name_branches(path: Path, root: Path = ROOT) -> list[str]:
    """``x.backend == "lmcache-mp"`` and the like: a comparison of something named
    ``backend`` with a registered backend's name."""
    names = set(BACKENDS)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any("backend" in ast.unparse(s) for s in sides):
            continue
        for side in sides:
            consts = ([side] if isinstance(side, ast.Constant) else
                      list(side.elts) if isinstance(side, ast.Tuple | ast.Set | ast.List) else [])
            if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


#: Where no code may branch on a backend's name: every package of the product, the command
#: line's deployment config and check and the harnesses included (they ask the registry's
#: entry what to start, probe and print).
NO_NAME_BRANCHES = ("agents", "controlplane", "predictors")


def test_the_scanned_folders_cover_every_layer() -> None:
    layers = {p.name for p in (ROOT / "controlplane").iterdir() if (p / "__init__.py").is_file()}
    assert {"cli", "harness", "live", "core"} <= layers
    assert all((ROOT / folder).is_dir() for folder in NO_NAME_BRANCHES)


def test_nothing_outside_the_registry_branches_on_a_backend_name() -> None:
    registry = ROOT / "agents" / "backends" / "registry.py"
    files = [p for folder in NO_NAME_BRANCHES for p in sorted((ROOT / folder).rglob("*.py"))
             if p != registry]
    found = [line for path in files for line in _name_branches(path)]
    assert not found, "branches on backend names:\n" + "\n".join(found)


def test_the_branch_check_finds_one(tmp_path: Path) -> None:
    path = tmp_path / "x.py"
    path.write_text('if cfg.backend == "sglang":\n    pass\n'
                    'if self.backend in ("local", "sglang"):\n    pass\n'
                    'if address == "local":\n    pass\n')
    assert len(_name_branches(path, tmp_path)) == 2


# ------------------------------------------------------------------ local, through the seam
@contextlib.contextmanager
def _no_orders() -> Iterator[set[str]]:
    yield set()


@pytest.mark.servers
def test_the_local_backend_through_the_protocol(tmp_path: Path) -> None:
    with EmbeddedValkey() as valkey:
        store = RemoteStoreConfig(valkey=valkey.store_config(key_prefix="seam:")).build()
        store.start()
        evicted: list[list[str]] = []
        dram = LocalTierConfig(path=str(tmp_path / "dram"), capacity_bytes=1 << 20)
        backend: NodeBackend = backend_spec("local").build(BackendContext(
            node=0, store=store, on_evict=evicted.append, dram=dram,
            transfer=TransferConfig(), settings=None))
        backend.start()
        try:
            keys = position_keys("t", "s1", 768, 256)
            assert len(keys) == 3
            store.put([(k, payload(k, 4096)) for k in keys])
            order = TransferOrder(order_id=1, session_id="t/s1", node=0, keys=tuple(keys),
                                  tokens=768, nbytes=3 * 4096, prefetch=True, deadline_s=10.0,
                                  priority=1.0)
            result = backend.warm(order).result(30)
            assert result.keys_moved == 3 and result.complete
            assert sorted(backend.listing()) == sorted(keys)
            assert backend.has([keys[0], "t/other/0"]) == [True, False]
            used, capacity, held = backend.stats()
            assert held == 3 and capacity == 1 << 20 and used >= 3 * 4096
            backend.trim([keys[2]], _no_orders)
            assert backend.holds(keys) == [True, True, False]
            assert backend.evict([session_prefix("t", "s1")], (), _no_orders) == 2
            assert backend.listing() == ()
            assert backend.events() is None
        finally:
            backend.close()
            store.close()


# ------------------------------------------------------------------ sglang, without SGLang
@pytest.mark.servers
def test_the_sglang_backend_warms_pages_lists_and_evicts_them(
        remote: RemoteStoreConfig, dram: LocalTierConfig) -> None:
    """The ``sglang`` backend needs no SGLang: it names pages as SGLang does and copies
    them into the tier. Pages stand in for what SGLang's write-back leaves in L3."""
    tenant, page, model = "acme", 16, "test/tiny"
    config = AgentConfig(node=0, backend="sglang", dram=dram, remote=remote,
                         sglang=SGLangWarmConfig(model_name=model, page_size=page, tp_size=2))
    with PrefetchAgent(config) as agent:
        tokens = synthetic_tokens(tenant, "s1", 3 * page + 5).tolist()  # 3 full pages
        hashes = page_hashes(tokens[:3 * page], page, cache_salt=tenant_cache_salt(tenant))
        names = [PageKeyScheme(model, tp_rank=r, tp_size=2).object_name(h)
                 for h in hashes for r in range(2)]
        assert all(r.ok for r in agent.store.put([(n, payload(n, 2048)) for n in names]))
        assert put_session_tokens(agent.store, tenant, "s1", tokens)
        keys = tuple(position_keys(tenant, "s1", len(tokens), 64))
        agent.execute(TransferOrder(1, f"{tenant}/s1", 0, keys, len(tokens), 0, True,
                                    time.time() + 60))
        report = agent.wait(1, timeout_s=30)
        assert report is not None and report.complete, report
        assert sorted(agent.inventory()) == sorted(names)
        assert agent.has([names[0], "sglang/none"]) == [True, False]
        assert agent.tier.exists(names[:1])[0].ok
        status = agent.status()
        assert status.keys == len(names) and status.capacity_bytes == dram.capacity_bytes
        assert agent.write_local([("acme/s1/9", b"x")]) == 0  # SGLang writes its own pages
        assert agent.evict(prefixes=[session_prefix(tenant, "s1")]) == len(names)
        assert agent.inventory() == ()
