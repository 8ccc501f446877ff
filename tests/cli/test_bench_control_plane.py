"""``kvprefetch bench control-plane`` run tiny: the table, the JSON it promises, and figures
that can be checked (every event measured and none lost; memory traced per session)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprefetch.controlplane.cli import main
from kvprefetch.controlplane.harness.loadgen import format_table


def _check_modes(result: dict, modes: set[str], sessions: int, events: int) -> None:
    assert result["sessions"] == sessions
    assert set(result["modes"]) == modes
    for mode, m in result["modes"].items():
        assert {"events_per_s", "route_p50_ms", "route_p99_ms", "plan_p99_ms",
                "bytes_per_session", "lost_events"} <= set(m), mode
        assert m["events"] == events and m["lost_events"] == 0, mode
        assert m["events_per_s"] > 0 and 0 < m["route_p50_ms"] <= m["route_p99_ms"], mode
        # Traced over populating: a live idle session costs something, and not megabytes.
        assert 100 < m["bytes_per_session"] < 64 * 1024, mode


def test_bench_control_plane_inproc_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    out = tmp_path / "cp.json"
    rc = main(["bench", "control-plane", "--modes", "inproc", "--sessions", "300",
               "--events", "1000", "--speedup", "5000", "--json", str(out), "--no-progress"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "inproc" in table and "events/s" in table
    result = json.loads(out.read_text())
    _check_modes(result, {"inproc"}, 300, 1000)
    # The pure core runs its planning step inline: there are steps to time (at 5,000x the
    # 1,000 events span several sweep intervals however fast the core is; at the default
    # 100x a fast run could end within one, and no step was timed).
    assert result["modes"]["inproc"]["plan_p99_ms"] is not None


def test_bench_control_plane_service_tiny(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The same figures through the service's client, with fewer events."""
    out = tmp_path / "cp.json"
    rc = main(["bench", "control-plane", "--modes", "service", "--sessions", "100",
               "--events", "300", "--speedup", "5000", "--json", str(out), "--no-progress"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "service" in table and "events/s" in table
    _check_modes(json.loads(out.read_text()), {"service"}, 100, 300)


def test_bench_control_plane_refuses_bad_callers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "control-plane", "--modes", "http", "--sessions", "10",
                 "--callers", "1,32", "--no-progress"]) == 2
    assert "callers must be 1-10" in capsys.readouterr().err
    assert main(["bench", "control-plane", "--modes", "http", "--callers", "x",
                 "--no-progress"]) == 2
    assert "--callers" in capsys.readouterr().err


def test_bench_control_plane_refuses_an_unknown_mode(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    assert main(["bench", "control-plane", "--modes", "ray-9", "--no-progress"]) == 2
    assert "unknown mode" in capsys.readouterr().err


def test_bench_control_plane_lanes_play_every_turn_once(tmp_path: Path) -> None:
    """Three client threads against the service (and one for inproc, whose core is not
    thread-safe): the events are split over the lanes, every one measured, none lost."""
    out = tmp_path / "cp.json"
    assert main(["bench", "control-plane", "--modes", "inproc,service", "--sessions", "90",
                 "--events", "900", "--concurrency", "5", "--lanes", "3", "--speedup", "5000",
                 "--json", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert result["lanes"] == 3 and result["concurrency"] == 5
    for mode, m in result["modes"].items():
        assert m["events"] == 900 and m["lost_events"] == 0, mode


def test_bench_control_plane_refuses_lanes_with_a_kill_and_too_many_in_flight(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "control-plane", "--modes", "ray-2", "--lanes", "2",
                 "--kill-shard", "1", "--no-progress"]) == 2
    assert "one lane" in capsys.readouterr().err
    assert main(["bench", "control-plane", "--sessions", "100", "--concurrency", "60",
                 "--lanes", "2", "--no-progress"]) == 2
    assert "concurrency x lanes" in capsys.readouterr().err


def test_the_table_prints_n_a_without_a_unit_for_what_was_not_measured() -> None:
    """A mode without planning steps (or a kill that never saw the shard answer again)
    prints ``n/a`` in the column's place, never ``n/ams``; measured values keep units."""
    def mode(plan_p99_ms: float | None, **extra: object) -> dict[str, object]:
        return {"events_per_s": 1000.0, "route_p50_ms": 0.5, "route_p99_ms": 2.0,
                "plan_p99_ms": plan_p99_ms, "bytes_per_session": None, "lost_events": 0,
                **extra}

    kill = {"shard": 1, "restart_s": None,
            "route_p99_ms_by_shard": {"0": {"before": 1.0, "after": None, "settled": None}}}
    table = format_table({"sessions": 10, "events": 100, "trace": "t", "nodes": 2,
                          "policy": "predictive",
                          "modes": {"inproc": mode(1.25), "ray-2": mode(None, kill=kill)}})
    assert "n/ams" not in table and "n/a s" not in table
    lines = table.splitlines()
    header, measured, missing = lines[1], lines[3], lines[4]
    end = header.index("plan p99") + len("plan p99")  # the column's right edge
    assert measured[:end].endswith("    1.25ms") and missing[:end].endswith("      n/a")
    assert measured[end:] == missing[end:]  # the columns after it stay in place
    assert "answering again after n/a; route p99" in table
    revived = format_table({"sessions": 10, "events": 100, "trace": "t", "nodes": 2,
                            "policy": "predictive",
                            "modes": {"ray-2": mode(None, kill={**kill, "restart_s": 1.5})}})
    assert "answering again after 1.50 s; route p99" in revived
