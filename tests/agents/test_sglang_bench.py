"""``kvprefetch bench sglang``, tiny: four 64 KiB pages, one repeat, no replay. Every backend's
bytes verify in both measurements and the JSON has the fields the issue names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sglang_guard import sglang_missing

try:
    from kvprefetch.controlplane.harness.sglang_bench import BACKENDS
except ImportError as exc:  # pragma: no cover - the environment decides
    sglang_missing(exc)

from kvprefetch.controlplane.cli import bench_sglang

pytestmark = pytest.mark.servers


def test_the_bench_writes_verified_figures_for_every_backend(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert bench_sglang.main(["--pages", "4", "--page-mib", "0.0625", "--batch-pages", "2",
                              "--repeats", "2", "--replay-requests", "0",
                              "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"kvprefetch-local", "kvprefetch-valkey", "sglang-file"} <= set(BACKENDS)
    for mode, figure in (("backends", "batch_get_mib_s"), ("host_pool", "prefetch_mib_s")):
        assert set(result[mode]) == set(BACKENDS)
        for r in result[mode].values():
            assert r["verified"] is True and r[figure] > 0 and r["runs"] == 4
    assert result["local_hits"] == 4 * 2 * 2  # every page, both repeats, both measurements
    assert all(v > 0 for v in result["ratios"].values())
    assert result["replay"] is None
