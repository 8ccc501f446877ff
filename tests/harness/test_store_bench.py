from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvprefetch.controlplane.cli import bench_store

pytestmark = pytest.mark.servers


def test_bench_store_small_run_writes_the_json_shape(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_store.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args([
        "--object-mib", "8", "--chunk-mib", "2", "--part-mib", "0.5", "--repeats", "2",
        "--valkey-link", "0.0005,40", "--s3-link", "0.010,20", "--json", str(out),
        "--no-progress",
    ])
    assert bench_store.run(args) == 0
    result = json.loads(out.read_text())
    assert result["object_bytes"] == 8 << 20 and result["chunk_bytes"] == 2 << 20
    assert result["raw_limit_mib_s"] > 0 and result["verified"] is True
    for condition in ("loopback", "link"):
        for store in ("valkey", "s3", "tiered"):
            row = result["conditions"][condition][store]
            for field in ("ttlb_s", "throughput_mib_s", "naive_ttlb_s", "speedup_vs_naive",
                          "fraction_of_raw"):
                assert row[field] > 0
    assert result["conditions"]["link"]["s3"]["speedup_vs_naive"] > 1.5
    # Loopback: naive, engine and raw interleaved, one run of each per repeat; medians.
    valkey = result["conditions"]["loopback"]["valkey"]
    assert len(valkey["engine_runs_mib_s"]) == len(valkey["raw_runs_mib_s"]) == 2
    assert valkey["fraction_of_raw_paired"] > 0 and result["raw_runs"] == 2
    assert len(result["load_avg_1m"]) == 2
