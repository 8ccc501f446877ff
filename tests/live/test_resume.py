"""Restart safety: resuming from the journal applies events exactly as the live calls did."""

from __future__ import annotations

from pathlib import Path

from controlplane.base.config import fleet_from_dict
from controlplane.live.client import connect
from controlplane.live.config import ServiceConfig
from controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 8 * GIB}})


def _turns(svc: SchedulerService, *sessions: str) -> None:
    c = connect(service=svc, tenant="t")
    for sid in sessions:
        ans = c.route(sid, input_tokens=1_000)
        c.request_finished(sid, node=ans.node, input_tokens=1_000, output_tokens=50,
                           context_tokens=1_040)


def test_a_session_closed_before_a_restart_stays_closed(tmp_path: Path) -> None:
    cfg = ServiceConfig(fleet=FLEET, journal_path=str(tmp_path / "journal.jsonl"))
    with SchedulerService(cfg) as svc:
        _turns(svc, "a", "b")
        connect(service=svc, tenant="t").session_closed("a")
        assert svc.core.sessions() == 1
    with SchedulerService(cfg) as again:
        assert not again.has_session("t", "a") and again.has_session("t", "b")
        # The core, not only the registry, forgot it: before the one apply path, resume
        # re-created the closed session's state in the core.
        assert again.core.sessions() == 1
        assert again.core.session_home("t/a") is None
        assert again.core.session_home("t/b") is not None
        # The context the client reported (not input + output) survives the restart.
        assert again.core.remote_tokens("t/b") == 1_040
