"""LMCache's own L2-adapter tests, run against our adapter.

Nothing of LMCache's is vendored: the test fetches LMCache's source distribution at the
installed version (``pip download``), keeps it in pytest's cache (or ``$KVP_LMCACHE_SDIST_DIR``)
so later runs do not download it again, and runs the adapter, controller and storage-manager
test files of its ``tests/v1/distributed/`` in a pytest subprocess with the plugin
``tests/lmcache_suite/kvp_lmcache_suite.py``, which has LMCache's factory build our adapter
wherever those tests build their mock or valkey adapter, over the real Valkey and S3 this
session starts. Their files run as shipped.

It fails (it does not skip) when the sdist cannot be fetched: CI without a package index must
provide the file (put ``lmcache-<version>.tar.gz`` in the cache folder). It fails on any
failure or error in their tests, and on any skip that is not one of the named ones below.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path
from types import ModuleType

import pytest

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json

pytestmark = [pytest.mark.servers, pytest.mark.slow]

SUITE_PLUGIN_DIR = Path(__file__).resolve().parents[1] / "lmcache_suite"
SDIST_DIR_ENV = "KVP_LMCACHE_SDIST_DIR"

#: LMCache's files that drive an L2 adapter (ours, through the plugin), in run order.
SUITE_FILES = (
    "test_mock_l2_adapter.py",        # the adapter contract, on LMCache's mock's tests
    "test_valkey_l2_adapter.py",      # store / lookup / load / delete / namespacing
    "test_l2_adapter_base.py",        # the listener and usage machinery ours inherits
    "test_store_controller.py",
    "test_prefetch_controller.py",
    "test_distributed_storage_manager.py",
    "test_storage_manager_l2_keys.py",
    "test_runtime_adapters.py",
    "test_report_status.py",
    "test_cache_salt_l2_eviction.py",
    "test_l1_l2_state_metrics.py",
    "test_fault_inject_l2_adapter.py",
    "test_multimodel.py",
    "test_l2_adapter_factory.py",
)

#: Skips LMCache's own files make on this machine, whatever the adapter (node id -> reason).
LMCACHE_OWN_SKIPS = {
    "tests/v1/distributed/test_l2_adapter_factory.py::TestFactoryRegistry::"
    "test_create_raw_block_via_registry":
        "lmcache_rust_raw_block_io extension not installed",
}


def _sdist_cache(config: pytest.Config) -> Path:
    override = os.environ.get(SDIST_DIR_ENV)
    if override:
        path = Path(override)
        path.mkdir(parents=True, exist_ok=True)
        return path
    cache = getattr(config, "cache", None)
    if cache is None:
        pytest.fail(f"no pytest cache (-p no:cacheprovider?): set {SDIST_DIR_ENV} to a folder "
                    "for LMCache's source distribution")
    return Path(cache.mkdir("lmcache-sdist"))


def fetch_sdist(cache_dir: Path, lmcache_version: str) -> Path:
    """LMCache's sdist at ``lmcache_version``, downloaded once into ``cache_dir``."""
    sdist = cache_dir / f"lmcache-{lmcache_version}.tar.gz"
    if sdist.is_file():
        return sdist
    # pip prepares the sdist's metadata after downloading it; LMCache's setup.py builds no
    # native extension for that when told so (it would look for CUDA otherwise).
    env = {**os.environ, "NO_CUDA_EXT": "1", "NO_GPU_EXT": "1", "NO_NATIVE_EXT": "1"}
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--no-build-isolation", "--no-binary", ":all:", "-d", str(cache_dir),
           f"lmcache=={lmcache_version}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    if done.returncode != 0 or not sdist.is_file():
        pytest.fail(
            f"could not fetch LMCache {lmcache_version}'s source distribution (needed to run "
            f"LMCache's own L2-adapter tests against ours): `{' '.join(cmd[2:])}` exited "
            f"{done.returncode}: {done.stderr.strip()[-1500:]}\n"
            f"Without network access, put lmcache-{lmcache_version}.tar.gz in {cache_dir}.")
    return sdist


def extract_tests(sdist: Path, lmcache_version: str) -> Path:
    """The sdist's ``tests/`` and ``pytest.ini``, unpacked beside it once; returns the root."""
    top = f"lmcache-{lmcache_version}"
    root = sdist.parent / f"{top}-tests"
    done = root / ".complete"
    if done.is_file():
        return root
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name == f"{top}/pytest.ini" or m.name.startswith(f"{top}/tests/")]
        if not any(m.name == f"{top}/tests/v1/distributed/test_mock_l2_adapter.py"
                   for m in members):
            pytest.fail(f"{sdist} has no {top}/tests/v1/distributed/: not LMCache's sdist?")
        staging = sdist.parent / f"{top}-tests.partial"
        tar.extractall(staging, members=members, filter="data")
    if root.exists():
        import shutil

        shutil.rmtree(root)
    (staging / top).rename(root)
    staging.rmdir()
    done.write_text(lmcache_version)
    return root


def run_suite(root: Path, adapter_params: dict[str, object], junit: Path) -> tuple[int, str]:
    env = {**os.environ, "KVP_SUITE_ADAPTER_PARAMS": json.dumps(adapter_params),
           "PYTHONPATH": os.pathsep.join(
               [str(SUITE_PLUGIN_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "kvp_lmcache_suite",
           "-p", "no:cacheprovider", "-o", "log_cli=false", "-rs", "--junitxml", str(junit),
           *(f"tests/v1/distributed/{name}" for name in SUITE_FILES)]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    return done.returncode, done.stdout + done.stderr


def suite_plugin() -> ModuleType:
    """The plugin module, for its list of skips (loaded by path: it is not on sys.path)."""
    spec = importlib.util.spec_from_file_location(
        "kvp_lmcache_suite", SUITE_PLUGIN_DIR / "kvp_lmcache_suite.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """node id -> (passed | failed | error | skipped, message) from pytest's junit XML."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        dotted = case.get("classname", "").split(".")
        file_at = next(i for i, part in enumerate(dotted) if part.startswith("test_"))
        path = "/".join(dotted[: file_at + 1]) + ".py"
        node = "::".join([path, *dotted[file_at + 1 :], case.get("name", "")])
        state, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                state = "failed" if tag == "failure" else tag
                message = found.get("message", "")
                break
        out[node] = (state, message)
    return out


def test_lmcache_l2_adapter_suite_passes_on_ours(
        request: pytest.FixtureRequest, tmp_path: Path,
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3) -> None:
    lmcache_version = version("lmcache")
    sdist = fetch_sdist(_sdist_cache(request.config), lmcache_version)
    root = extract_tests(sdist, lmcache_version)
    params = plugin_adapter_json(valkey=valkey_server.store_config(),
                                 s3=s3_server.store_config())["adapter_params"]
    junit = tmp_path / "junit.xml"
    started = time.monotonic()
    rc, output = run_suite(root, params, junit)
    elapsed = time.monotonic() - started
    assert junit.is_file(), f"LMCache's suite did not run (exit {rc}):\n{output[-6000:]}"
    results = outcomes(junit)
    bad = {n: m for n, (s, m) in results.items() if s in ("failed", "error")}
    assert not bad, (f"LMCache's L2-adapter tests failed on our adapter: {sorted(bad)}\n"
                     f"{output[-8000:]}")
    skipped = {n: m for n, (s, m) in results.items() if s == "skipped"}
    expected = {**{n: f"not for ours: {r}" for n, r in suite_plugin().NOT_FOR_OURS.items()},
                **LMCACHE_OWN_SKIPS}
    assert set(skipped) == set(expected), (
        f"unexpected skips {sorted(set(skipped) - set(expected))}, "
        f"expected skips that ran {sorted(set(expected) - set(skipped))}")
    for node, reason in expected.items():
        assert reason in skipped[node], (node, skipped[node])
    passed = sum(1 for s, _ in results.values() if s == "passed")
    assert rc == 0 and passed >= 250, (rc, passed)
    # Their tests really drove ours: the plugin counts the adapters it built for them.
    built_line = re.search(r"^kvprefetch adapters built: (\{.*\})$", output, re.MULTILINE)
    assert built_line is not None, output[-3000:]
    built = json.loads(built_line.group(1))
    assert built.get("MockL2AdapterConfig", 0) >= 150 and built.get("ValkeyL2AdapterConfig", 0) \
        >= 15, built
    print(f"LMCache {lmcache_version} L2-adapter suite on ours: {passed} passed, "
          f"{len(skipped)} skipped (named), 0 failed, {elapsed:.0f} s; our adapters built "
          f"for their tests: {built}")
