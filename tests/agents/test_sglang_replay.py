"""The replay of HiCache's L3 page reads on the bundled trace's returning requests, tiny:
one request of the slice's first session, 20 pages of 1,024 tokens, through emulated links
to real Valkey and S3. With the agent's warming every page is served from the node-local
tier within SGLang's timeout, byte for byte; without it the same pages, fetched from S3 at
the emulated rate, cannot arrive in time (the link alone needs about twice the timeout)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_guard import sglang_missing

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.linkemu import S3_LINK

try:
    from kvprefetch.controlplane.harness.sglang_replay import (
        ReplayConfig,
        returning_requests,
        run_replay,
    )
except ImportError as exc:  # pragma: no cover - the environment decides
    sglang_missing(exc)

from kvprefetch.controlplane.traces import bundled_trace_path, load_trace

pytestmark = pytest.mark.servers

TINY = {"sessions": 1, "requests_per_session": 1, "page_tokens": 1024,
        "page_bytes": 16 * 1024, "model_page_bytes": 1024 * 128 * 1024, "time_scale": 10.0}


def test_sglangs_timeout_and_the_scaled_link() -> None:
    config = ReplayConfig(**TINY)  # type: ignore[arg-type]
    # SGLang 0.5.23: 1 s + 0.25 s per 1,024 requested tokens, here 10x faster.
    assert config.timeout_s(20) == pytest.approx((1.0 + 20 * 0.25) / 10)
    link = config.replay_link(S3_LINK)
    # A replayed page spends on the link what a model page would, 10x faster.
    model_page_s = S3_LINK.latency_s + 128 / S3_LINK.bandwidth_mib_s
    replay_page_s = link.latency_s + (16 / 1024) / link.bandwidth_mib_s
    assert replay_page_s == pytest.approx(model_page_s / 10)
    picked = returning_requests(load_trace(bundled_trace_path()), ReplayConfig(sessions=2))
    assert len({r.session_id for r in picked}) == 2 and len(picked) == 4
    assert all(r.turn > 0 and r.gap_s >= 30 and r.reused_tokens >= 64 for r in picked)


def test_a_tiny_replay_serves_warmed_pages_in_time_and_unwarmed_ones_late(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, dram_dir: Path) -> None:
    dram_dir.mkdir(parents=True, exist_ok=True)
    result = run_replay(ReplayConfig(dram_dir=str(dram_dir), **TINY),  # type: ignore[arg-type]
                        valkey_server, s3_server)
    [row] = result["requests"]
    assert result["pages"] == row["pages"] == 21056 // 1024
    assert row["warm_complete"] and row["warmed"]["found"] == row["pages"]
    assert result["warmed_in_time_share"] == result["warmed_local_share"] == 1.0
    assert result["unwarmed_in_time_share"] < result["warmed_in_time_share"]
    assert row["unwarmed"]["found"] == row["pages"]  # present in S3, only too slow
    assert row["unwarmed"]["landed_s"][-1] > row["timeout_s"]
    assert result["verified"] and row["warmed"]["verified"]
