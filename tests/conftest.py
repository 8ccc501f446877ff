"""Test-run settings shared by every folder: how ``pytest -n N --dist loadgroup`` (make
test, make test-fast) splits the tests over its workers, and which modules a ``-m``
expression lets pytest skip without importing them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from markselect import deselects_whole, module_marks

# Token auth (two raylets on one machine need it); Ray reads the mode when it is imported,
# so it is set here, before any test module of any folder imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")

#: Modules with tests that start a Ray runtime (ray.init, ``ray start``, ``kvprefetch serve``,
#: the demos): one group, run one test at a time on one worker. Two runtimes at once would
#: contend for Ray's fixed default ports (Serve's HTTP port, the dashboard agent's, the
#: head's client server).
RAY_MODULES = (
    "tests/deploy/test_local_cluster.py",
    "tests/docs/test_getting_started.py",
    *(f"tests/harness/{name}" for name in (
        "test_aiperf_bench.py", "test_bench_ray.py", "test_demo.py", "test_demo_lmcache.py",
        "test_demo_vllm.py")),
    *(f"tests/live/{name}" for name in (
        "test_gateway_nodes.py", "test_http_ray.py", "test_node_join.py", "test_ray.py",
        "test_readme_http.py", "test_route_ids_sharded.py", "test_serve.py",
        "test_serve_gateway.py", "test_shards_ray.py")),
)
#: Modules whose module-scoped fixtures are expensive (a wheel built and installed, the docs
#: site built, LMCache servers started, models trained, a large trace evaluated, LMCache or
#: SGLang imported): each is a group of its own, so that one worker builds them once rather
#: than each worker once.
WHOLE_MODULES = (
    "tests/agents/test_lmcache_agent.py",
    "tests/agents/test_lmcache_keys.py",
    "tests/agents/test_lmcache_mp.py",
    "tests/agents/test_sglang_keys.py",
    "tests/deploy/test_serve_check.py",
    "tests/live/test_http_edge.py",
    "tests/packaging/test_wheel.py",
    "tests/predictors/test_adaptive.py",
    "tests/predictors/test_calibration.py",
    "tests/predictors/test_predictors.py",
    "tests/test_docs.py",
)
#: Test module path -> xdist group.
XDIST_GROUPS = {**{path: "ray" for path in RAY_MODULES},
                **{path: path for path in WHOLE_MODULES}}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """loadgroup, with the groups above taken from each test's module path. The scheduler
    sees only node ids; an ``xdist_group`` mark, which pytest-xdist carries as an ``@group``
    suffix of the node id, still counts where it arrives."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = XDIST_GROUPS.get(nodeid.split("::", 1)[0])
            return group if group and "@" not in nodeid else super()._split_scope(nodeid)

    return ModuleGroupScheduling(config, log)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Skip a test module whose module marks ``-m`` deselects whole, without importing it:
    ``make test-fast`` then imports neither the engines (torch, LMCache, SGLang) nor the
    server clients for tests it would not run."""
    markexpr = config.getoption("markexpr")
    name = collection_path.name
    if not markexpr or not (name.startswith("test_") and name.endswith(".py")):
        return None
    marks = module_marks(collection_path)
    return True if marks and deselects_whole(markexpr, marks) else None
