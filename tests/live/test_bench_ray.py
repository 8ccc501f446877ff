"""``kvprefetch bench control-plane --modes ray-1`` run tiny: one scheduler actor on a local
Ray runtime through the Python client; every event measured arrives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controlplane.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.servers]


def test_bench_control_plane_ray_1_tiny(tmp_path: Path) -> None:
    out = tmp_path / "cp.json"
    assert main(["bench", "control-plane", "--modes", "ray-1", "--sessions", "100",
                 "--events", "400", "--json", str(out), "--no-progress"]) == 0
    m = json.loads(out.read_text())["modes"]["ray-1"]
    assert m["events"] == 400 and m["lost_events"] == 0
    assert m["events_per_s"] > 0 and 0 < m["route_p50_ms"] <= m["route_p99_ms"]
    assert m["bytes_per_session"] is None  # the actor's memory is not traced from here
    assert m["plan_p99_ms"] is not None  # the actor's control loop ran and was timed
