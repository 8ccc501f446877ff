"""Test-run settings shared by every folder: how ``pytest -n N --dist loadgroup`` (make
test, make test-fast) splits the tests over its workers."""

from __future__ import annotations

from typing import Any

import pytest

#: Test modules whose tests run on one xdist worker, one after another, by group name.
#: ``ray``: modules that start a Ray runtime (ray.init, ``ray start``, ``kvprefetch serve``,
#: the demos); two runtimes at once would contend for Ray's fixed default ports (Serve's HTTP
#: port, the dashboard agent's, the head's client server). ``predictors``: the module's
#: models are trained once, in a module fixture, rather than once per worker.
XDIST_GROUPS = {
    **{f"tests/live/{name}": "ray" for name in (
        "test_bench_ray.py", "test_demo.py", "test_demo_lmcache.py", "test_demo_vllm.py",
        "test_node_join.py", "test_ray.py", "test_readme_http.py", "test_serve.py",
        "test_serve_gateway.py", "test_shards_ray.py")},
    "tests/deploy/test_local_cluster.py": "ray",
    "tests/predictors/test_predictors.py": "predictors",
}


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
