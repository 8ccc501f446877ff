"""``kvprefetch bench aiperf`` end to end, short: NVIDIA's aiperf (its own venv,
``make setup-aiperf``) replays 3 sessions of at most 3 turns through the gateway in front
of two real vLLM (CPU) + LMCache nodes, after our own client replays the same trace.

Both clients must finish with no failed request (a random-weight model's empty answers are
counted apart, not failures), aiperf's own TTFT statistics must be in the report, the
gateway must have answered every request as ``ok``, and aiperf's sessions must have reached
the engines as sessions (their prefixes reused). Needs vLLM's CPU build and aiperf
(``make test-vllm`` sets up both). About 3 min on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
#: The aiperf command (make test-vllm passes its venv's; default the Makefile's default).
AIPERF = Path(os.environ.get("AIPERF") or ROOT / ".venv-aiperf" / "bin" / "aiperf")


def test_aiperf_replays_the_multi_turn_trace_through_the_gateway(tmp_path: Path) -> None:
    assert AIPERF.is_file(), "aiperf is not installed: make setup-aiperf"
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "kvprefetch",
           "bench", "aiperf", "--aiperf", str(AIPERF), "--sessions", "3", "--turns", "3",
           "--no-progress", "--json", str(out), "--artifact-dir", str(tmp_path / "aiperf")]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=_offline())
    print(f"\nthe short aiperf bench took {time.monotonic() - started:.0f} s")
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    report = json.loads(out.read_text())
    requests = report["meta"]["requests"]
    ours, theirs = report["ours"], report["aiperf"]
    assert ours["failed_requests"] == 0 and ours["ttft_ms"]["count"] == requests
    # aiperf counts an answer without text as an error: those are the model's, apart.
    assert theirs["errors_other"] == 0 and theirs["failed_requests_gateway"] == 0
    assert theirs["request_count"] + theirs["errors_empty_text"] == requests
    assert theirs["gateway_outcomes"] == {"ok": requests}
    ttft = theirs["ttft_ms"]
    assert ttft["unit"] == "ms" and 0 < ttft["avg"] <= ttft["max"]
    assert ttft["count"] == theirs["request_count"]
    # aiperf's later turns re-send their session's context: the engines reused prefixes.
    counters = theirs["engine_counters"]
    assert counters["vllm_prefix_hit_tokens"] + counters["vllm_external_hit_tokens"] > 0
    rows = (tmp_path / "aiperf" / "trace.mooncake.jsonl").read_text().splitlines()
    assert len(rows) == requests and all("session_id" in json.loads(r) for r in rows)


def _offline() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
