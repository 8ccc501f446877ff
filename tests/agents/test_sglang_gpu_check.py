"""The CPU half of ``examples/gpu_check.sh MODEL --engine sglang`` (the GPU half is SGLang's
server itself): the check's own functions, driven against our HiCache backend the way
HiCache calls it, over real Valkey and S3 on loopback. The pages HiCache writes back are
found under the names the check waits for; the session's token ids and the transfer order
make the ``sglang`` agent warm exactly those pages; the counters the backend publishes
for another process show the request before warming read from Valkey, the one after it
from the node-local tier, byte for byte; and the command the check launches SGLang with
(through examples/sglang_node.sh) is read by SGLang's own argument parser as meant.
SGLang is imported directly (see test_sglang_keys.py for the rule on a missing SGLang).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sglang_guard import sglang_missing

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from examples.gpu_check_sglang import (
        node_agent_config,
        page_names,
        served_from_node_tier,
        sglang_launch,
        wait_stored,
    )
    from kvprefetch.agents.sglang.backend import (
        KvPrefetchHiCacheStorage,
        SGLangStorageConfig,
        dynamic_extra_config,
    )
except ImportError as exc:  # pragma: no cover - the environment decides
    sglang_missing(exc)

from examples.gpu_check import parse_args
from examples.gpu_check_common import (
    TENANT,
    publish_session_tokens,
    session_order,
    synthetic_prompt,
    warm_session,
)
from kvprefetch.agents.agent import PrefetchAgent, RemoteStoreConfig
from kvprefetch.agents.sglang.keys import page_hashes
from kvprefetch.agents.sglang.stats import BackendStats, read_stats
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.controlplane.base.keys import tenant_cache_salt

pytestmark = pytest.mark.servers

PAGE, CHUNK, MODEL, FULL_PAGES = 16, 64, "org/tiny-model", 5
PAGE_FLOATS = 2 * PAGE * 2 * 4 * 8  # K and V, page tokens, layers, heads, dim
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def storage(remote: RemoteStoreConfig, dram: LocalTierConfig, tmp_path: Path
            ) -> SGLangStorageConfig:
    return SGLangStorageConfig(local=dram, remote=remote, stats_dir=str(tmp_path / "stats"))


@pytest.fixture
def backend(storage: SGLangStorageConfig) -> Iterator[KvPrefetchHiCacheStorage]:
    """Built by SGLang's own factory, as its scheduler builds it (one TP rank)."""
    extra = json.loads(json.dumps(dynamic_extra_config(storage)))
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=MODEL, extra_config=extra)
    built = StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(built, KvPrefetchHiCacheStorage)
    yield built
    built.close()


def test_the_checks_order_warms_the_pages_hicache_then_reads_from_the_node_tier(
        backend: KvPrefetchHiCacheStorage, storage: SGLangStorageConfig,
        remote: RemoteStoreConfig, dram: LocalTierConfig) -> None:
    assert storage.stats_dir is not None
    stats_dir = storage.stats_dir
    session = f"s-{uuid.uuid4().hex[:6]}"
    prompt = synthetic_prompt(FULL_PAGES * PAGE + 3, seed=7)  # a partial last page
    # HiCache's write-back after the cold request: the prompt's full pages, keyed by
    # SGLang's page hashes under the tenant's cache salt (the request carries it)
    hashes = page_hashes(prompt[: FULL_PAGES * PAGE], PAGE,
                         cache_salt=tenant_cache_salt(TENANT))
    g = torch.Generator().manual_seed(3)
    values = [torch.randn(PAGE_FLOATS, generator=g) for _ in hashes]
    assert backend.batch_set(hashes, values)
    published = read_stats(stats_dir)
    assert published.model_names == (MODEL,)  # what the check configures the agent with
    assert published.counters["pages_written"] == FULL_PAGES

    names = page_names(prompt, MODEL, PAGE, tp_size=1)
    assert wait_stored(remote, names, timeout_s=10.0) == FULL_PAGES
    publish_session_tokens(remote, TENANT, session, prompt)

    def hicache_request() -> tuple[list[torch.Tensor], dict[str, int]]:
        """What HiCache's prefetch does on arrival: how many pages L3 has, then read
        them; and the growth of the published counters over it."""
        before: BackendStats = read_stats(stats_dir)
        n = backend.batch_exists(hashes)
        assert n == FULL_PAGES
        dest = [torch.zeros(PAGE_FLOATS) for _ in hashes]
        assert all(page is not None for page in backend.batch_get(hashes[:n], dest[:n]))
        return dest, read_stats(stats_dir).since(before)

    dest, pages = hicache_request()  # no prefetch: the pages come from Valkey
    assert pages["valkey_hits"] == pages["remote_hits"] == FULL_PAGES
    assert pages["local_hits"] == 0
    assert not served_from_node_tier(pages, FULL_PAGES)

    with PrefetchAgent(node_agent_config(remote, dram, MODEL, PAGE, 1)) as agent:
        order = session_order(1, TENANT, session, len(prompt), CHUNK)
        warm = warm_session(agent, order, timeout_s=30.0)
        assert warm["complete"] and warm["chunks_warmed"] == len(order.keys)
        assert sorted(agent.inventory()) == sorted(names)
        dest, pages = hicache_request()
    assert pages["local_hits"] == FULL_PAGES and pages["remote_hits"] == 0, pages
    assert served_from_node_tier(pages, FULL_PAGES)
    for got, stored in zip(dest, values, strict=True):
        assert got.numpy().tobytes() == stored.numpy().tobytes()


def test_served_from_node_tier_allows_one_page_per_rank_short_and_nothing_else() -> None:
    base = {"local_hits": 9, "remote_hits": 0, "misses": 0, "local_bad": 0}
    assert served_from_node_tier(base, 10)
    assert not served_from_node_tier({**base, "local_hits": 8}, 10)
    assert not served_from_node_tier(base, 10, ranks=2)
    assert served_from_node_tier({**base, "local_hits": 18}, 10, ranks=2)
    for spoiler in ("remote_hits", "misses", "local_bad"):
        assert not served_from_node_tier({**base, spoiler: 1}, 10)
    assert not served_from_node_tier({**base, "local_hits": 0}, 0)  # nothing read at all


def test_sglang_reads_the_launch_command_as_the_check_means_it(
        storage: SGLangStorageConfig, tmp_path: Path) -> None:
    """examples/sglang_node.sh with the check's environment, its SGLang replaced by a
    script that prints its arguments; those parsed by SGLang's own ServerArgs parser."""
    from sglang.srt.server_args import ServerArgs

    args = parse_args(["--model", "/models/Some-Model", "--engine", "sglang", "--tp", "2",
                       "--gpu-memory-utilization", "0.6"])
    cmd, env = sglang_launch(args, storage)
    stub = tmp_path / "argv.py"
    stub.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    env["SGLANG"] = f"{sys.executable} {stub}"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                         check=True, cwd=tmp_path)  # not the repository: PYTHONPATH finds it
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(json.loads(out.stdout.strip().splitlines()[-1]))
    assert parsed.model_path == "/models/Some-Model" and parsed.port == 30000
    assert parsed.tp_size == 2 and parsed.page_size == 64
    assert parsed.mem_fraction_static == 0.6 and parsed.context_length == 16384
    assert parsed.enable_hierarchical_cache and parsed.hicache_size == 16
    assert parsed.hicache_storage_backend == "dynamic"
    assert parsed.hicache_storage_prefetch_policy == "timeout"
    assert parsed.hicache_write_policy == "write_back"  # the profile's demote-on-evict
    extra = json.loads(parsed.hicache_storage_backend_extra_config)
    assert extra["module_path"] == "kvprefetch.agents.sglang.backend" and extra["interface_v1"] == 1
    assert SGLangStorageConfig.model_validate(extra["kvprefetch"]) == storage
