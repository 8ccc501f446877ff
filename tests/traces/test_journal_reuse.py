"""A journal written by ordinary API use is a trace the simulator and the trainer replay:
a session id used again after its close (the service numbers the new session's turns from
0) is a new session of the trace, ``<id>#2``; the same id in two tenants stays two
sessions."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.cli import main
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService
from kvprefetch.controlplane.traces import load_trace

GIB = 1 << 30
IDS = [f"chat-{i}" for i in range(6)]


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    path = tmp_path / "journal.jsonl"
    fleet = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                                  "dram_tier_bytes": 8 * GIB}})
    svc = SchedulerService(ServiceConfig(fleet=fleet, journal_path=str(path))).start()
    try:
        acme = connect("inproc", service=svc, tenant="acme")
        globex = connect("inproc", service=svc, tenant="globex")
        for life in range(2):  # each id twice: opened, three turns, closed
            for sid in IDS:
                for turn in range(3):
                    tokens = 1000 * (turn + 1) + 100 * life
                    answer = acme.route(sid, input_tokens=tokens)
                    assert acme.request_finished(sid, node=answer.node, input_tokens=tokens,
                                                 output_tokens=40, stop_reason="tool_use"
                                                 ).accepted
                assert acme.session_closed(sid).accepted
        answer = globex.route(IDS[0], input_tokens=700)
        globex.request_finished(IDS[0], node=answer.node, input_tokens=700, output_tokens=9)
    finally:
        svc.close()
    return path


def test_a_reused_session_id_is_a_new_session_of_the_trace(journal: Path) -> None:
    trace = load_trace(journal)
    ids = {s.session_id for s in trace.sessions}
    assert {f"acme/{sid}" for sid in IDS} <= ids
    assert {f"acme/{sid}#2" for sid in IDS} <= ids and "globex/chat-0" in ids
    assert len(trace.sessions) == 2 * len(IDS) + 1
    again = {s.session_id: s for s in trace.sessions}["acme/chat-3#2"]
    assert [r.turn for r in again.requests] == [0, 1, 2]
    assert [r.input_tokens for r in again.requests] == [1100, 2100, 3100]
    assert again.requests[1].gap_s is not None and again.requests[1].gap_s >= 0


def test_sim_and_train_replay_the_journal(journal: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--trace", str(journal), "--nodes", "1", "--no-progress"]) == 0
    assert "37 requests, 13 sessions" in capsys.readouterr().out
    out = tmp_path / "model.kvp"
    assert main(["train", "--trace", str(journal), "--predictor", "empirical", "--out",
                 str(out), "--test-fraction", "0", "--no-progress"]) == 0
    assert out.stat().st_size > 0
