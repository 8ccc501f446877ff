"""A pytest plugin that runs LMCache's own L2-adapter tests against our adapter.

Loaded (``-p kvp_lmcache_suite``) into a pytest run over the ``tests/`` folder of LMCache's
source distribution at the installed version (``tests/agents/test_lmcache_suite.py`` fetches
it, starts Valkey and S3 and runs that pytest in a subprocess). Their files stay as LMCache
ships them; this plugin changes these things before they are collected:

- ``MockL2Adapter`` (the adapter LMCache's adapter-contract, controller and storage-manager
  tests drive) and ``ValkeyL2Adapter`` (whose unit tests drive store, lookup, load, delete
  and namespacing) are replaced in their modules -- so LMCache's ``mock`` factory builds
  ours too -- by :class:`SuiteL2Adapter`: given one of their configs, it builds OUR adapter
  through LMCache's ``plugin`` factory (``create_l2_adapter_from_registry(
  PluginL2AdapterConfig(...))``, as ``lmcache server --l2-adapter`` does) over the real
  Valkey and S3 named by ``KVP_SUITE_ADAPTER_PARAMS`` (JSON ``adapter_params``), write-back,
  as configured by default. Each mock gets a namespace of its own (with the mock's size as
  our reported capacity and its bandwidth as our emulated load link); valkey adapters of one
  test share a namespace per LMCache ``key_prefix``.
- :class:`SuiteL2Adapter` is our adapter plus the mock's three read-only ``debug_*``
  queries, answered from our public surface (listing, status, the stores); the valkey
  tests' ``_in_store`` helper (which reads their fake server) asks ours the same way.
- LMCache's CPU stub device says it is available (LMCache 0.5.6 skips its controller tests
  on CPU otherwise; the L1 they use is plain host memory either way).

Tests that check another adapter's internals (the mock's simulated store delay and type
name, faults and truncation injected into the valkey tests' fake server) are skipped with
the reason in :data:`NOT_FOR_OURS`; nothing else is skipped here. The plugin prints how many
adapters it built, so the runner can check that their tests really drove ours.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections import Counter
from typing import Any

import pytest
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters import mock_l2_adapter, valkey_l2_adapter
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.valkey_l2_adapter import ValkeyL2AdapterConfig

from kvprefetch.agents.lmcache.l2.adapter import KvPrefetchL2Adapter

PARAMS_ENV = "KVP_SUITE_ADAPTER_PARAMS"

#: Test node id (relative to LMCache's ``tests/`` parent) -> why it does not apply to ours.
NOT_FOR_OURS: dict[str, str] = {
    "tests/v1/distributed/test_mock_l2_adapter.py::TestBandwidthSimulation::"
    "test_store_completion_is_delayed_by_bandwidth":
        "the mock delays stores by its simulated bandwidth; ours emulates the load link only "
        "(a store completes when Valkey and the upload journal hold it)",
    "tests/v1/distributed/test_report_status.py::TestStorageManagerReportStatus::"
    "test_report_status_shape_with_l2":
        "asserts the adapter's status says type 'MockL2Adapter'; ours says 'kvprefetch'",
    "tests/v1/distributed/test_valkey_l2_adapter.py::TestStore::test_partial_failure_accounting":
        "injects a SET failure into LMCache's fake glide server through its valkey adapter's "
        "private _wire_key; ours talks to a real Valkey through valkey-py",
    "tests/v1/distributed/test_valkey_l2_adapter.py::TestLoad::test_size_mismatch_treated_as_miss":
        "truncates the value inside LMCache's fake glide server; ours stores a checksummed "
        "header (a wrong-size destination is a miss: test_lmcache_adapter.py::"
        "test_round_trip_is_byte_exact_and_bitmaps_are_per_key)",
}


class SuiteL2Adapter(KvPrefetchL2Adapter):
    """Our adapter as LMCache's tests see ``MockL2Adapter``.

    ``SuiteL2Adapter(MockL2AdapterConfig(...))`` (how their tests write it) builds the
    instance through LMCache's plugin factory, which calls ``SuiteL2Adapter(adapter_params)``
    like any plugin; the class itself stays patchable the way their tests patch the mock's.
    Adds the mock's three read-only ``debug_*`` queries, answered from our public surface.
    """

    def __new__(cls, params: Any = None, **kwargs: Any) -> Any:
        if isinstance(params, MockL2AdapterConfig | ValkeyL2AdapterConfig):
            return build_ours(params)
        return super().__new__(cls)

    def __init__(self, params: Any = None, **kwargs: Any) -> None:
        if isinstance(params, MockL2AdapterConfig | ValkeyL2AdapterConfig):
            return  # built by the factory inside __new__; Python calls __init__ again
        super().__init__(params, **kwargs)

    def debug_get_stored_object_count(self) -> int:
        count, cursor = 0, None
        while True:
            page = self.list_l2_keys(page_size=1000, cursor=cursor)
            count += len(page.entries)
            cursor = page.next_page_token
            if cursor is None:
                return count

    def debug_get_locked_key_count(self) -> int:
        return int(self.report_status()["locked_keys"])

    def debug_has_key(self, key: ObjectKey) -> bool:
        return bool(self.store.exists([self.name_of(key)])[0].ok)


#: A fresh namespace per test: adapters a test builds with the same LMCache ``key_prefix``
#: share objects (as two LMCache valkey adapters with one prefix would), nothing else does.
_test_namespace = uuid.uuid4().hex[:12]


def suite_params(config: MockL2AdapterConfig | ValkeyL2AdapterConfig) -> dict[str, Any]:
    """Our ``adapter_params`` for one of LMCache's adapter configs, over the suite's servers.

    ``MockL2AdapterConfig``: a namespace of its own (each mock is a separate store), the
    mock's size as the capacity we report and its bandwidth as our emulated load link.
    ``ValkeyL2AdapterConfig``: the test's namespace plus its ``key_prefix``."""
    raw = os.environ.get(PARAMS_ENV)
    if not raw:
        raise RuntimeError(f"{PARAMS_ENV} is not set: run this suite through "
                           "tests/agents/test_lmcache_suite.py, which starts Valkey and S3")
    params: dict[str, Any] = json.loads(raw)
    if isinstance(config, MockL2AdapterConfig):
        namespace = f"suite-{uuid.uuid4().hex[:12]}/"
        extra = {"max_capacity_gb": float(config.max_size_gb),
                 "load_bandwidth_mib_s": float(config.mock_bandwidth_gb) * 1024}
    else:
        namespace = f"suite-{_test_namespace}/{config.key_prefix or 'default'}/"
        extra = {"max_capacity_gb": float(config.max_capacity_gb or 0)}
    # The write-back journal lives under the Valkey prefix: one per namespace, like one
    # per node, so an adapter never picks up another's uploads at start.
    valkey = {**params["valkey"], "key_prefix": namespace} if "valkey" in params else None
    return {**params, **({"valkey": valkey} if valkey else {}), "key_prefix": namespace,
            **extra}


def build_ours(config: MockL2AdapterConfig | ValkeyL2AdapterConfig) -> SuiteL2Adapter:
    """Our adapter, built the way LMCache's server builds a plugin adapter."""
    plugin = PluginL2AdapterConfig(module_path=__name__, class_name="SuiteL2Adapter",
                                   adapter_params=suite_params(config))
    adapter = create_l2_adapter_from_registry(plugin)
    assert type(adapter) is SuiteL2Adapter
    _built[type(config).__name__] += 1
    return adapter


def pytest_configure(config: pytest.Config) -> None:
    import lmcache

    type(lmcache.torch_dev).is_available = lambda self: True  # type: ignore[method-assign]
    mock_l2_adapter.MockL2Adapter = SuiteL2Adapter  # type: ignore[misc]
    valkey_l2_adapter.ValkeyL2Adapter = SuiteL2Adapter  # type: ignore[misc]
    config.addinivalue_line("markers", "not_for_ours: skipped, checks the mock's internals")


#: Our adapters built in place of LMCache's, by the config class the test gave.
_built: Counter[str] = Counter()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line the runner checks: how many of LMCache's adapters were ours."""
    terminalreporter.write_line(
        "kvprefetch adapters built: " + json.dumps(dict(sorted(_built.items()))))


def _in_ours(adapter: SuiteL2Adapter, key: ObjectKey) -> bool:
    return adapter.debug_has_key(key)


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _test_namespace
    _test_namespace = uuid.uuid4().hex[:12]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # test_valkey_l2_adapter asks its fake server whether a key is stored; ask ours.
    valkey_tests = sys.modules.get("tests.v1.distributed.test_valkey_l2_adapter")
    if valkey_tests is not None:
        valkey_tests._in_store = _in_ours  # type: ignore[attr-defined]
    for item in items:
        reason = NOT_FOR_OURS.get(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"not for ours: {reason}"))
