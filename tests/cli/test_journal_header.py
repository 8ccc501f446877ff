"""``kvprefetch journal check`` fails on every journal the scheduler refuses to start on (a
journal without its header line included), and ``--repair`` mends it so that the scheduler
starts and resumes the same sessions, or says it cannot and leaves the journal as it was."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.errors import TraceFormatError
from kvprefetch.controlplane.cli import main
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})


def _config(path: Path) -> ServiceConfig:
    return ServiceConfig(fleet=FLEET, policy="ondemand", predictor="last-gap",
                         time_compression=1000.0, journal_path=str(path),
                         journal_compact_records=0)


@pytest.fixture(scope="module")
def journal_lines(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """A journal of six sessions (three live at the end) written by a scheduler."""
    path = tmp_path_factory.mktemp("journal") / "journal.jsonl"
    with SchedulerService(_config(path)) as svc:
        c = connect(service=svc, tenant="acme")
        for i in range(6):
            ans = c.route(f"s{i}", input_tokens=100)
            c.request_finished(f"s{i}", node=ans.node or 0, input_tokens=100,
                               output_tokens=10)
        for i in range(3):
            c.session_closed(f"s{i}")
    return path.read_bytes().splitlines(keepends=True)


def _starts(path: Path) -> int | None:
    """Live sessions after the scheduler resumed from ``path``; None when it refuses."""
    try:
        with SchedulerService(_config(path)) as svc:
            return len(svc.registry)
    except TraceFormatError:
        return None


#: Ways a journal is damaged: each maps the journal's lines to the file's bytes.
CASES: dict[str, Callable[[list[bytes]], bytes]] = {
    "intact": lambda lines: b"".join(lines),
    "header lost": lambda lines: b"".join(lines[1:]),
    "blank line before the header": lambda lines: b"\n" + b"".join(lines),
    "header garbled": lambda lines: b'{"kvprefetch_journ' + b"".join(lines[1:]),
    "record garbled": lambda lines: b"".join([*lines[:3], b"{not json\n", *lines[3:]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_check_fails_where_serve_refuses_and_repair_mends_it(
    tmp_path: Path, journal_lines: list[bytes], case: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "journal.jsonl"
    damaged = CASES[case](journal_lines)
    path.write_bytes(damaged)
    refused = _starts(path) is None
    path.write_bytes(damaged)  # as it was before the scheduler touched it
    rc = main(["journal", "check", "--json", str(path)])
    report = json.loads(capsys.readouterr().out)
    assert refused <= (rc == 1)  # whatever serve refuses, check fails on
    assert (rc == 0) == (case == "intact")
    assert report["header"] == {"intact": "ok", "header lost": "missing",
                                "blank line before the header": "missing",
                                "header garbled": "damaged",
                                "record garbled": "ok"}[case]
    if case == "header lost":
        assert refused and report["records"] == len(journal_lines) - 1
    assert path.read_bytes() == damaged  # a check without --repair changes nothing
    rc = main(["journal", "check", "--repair", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    if report["header"] == "missing":
        assert "a fresh header written before line 1" in out
    assert main(["journal", "check", str(path)]) == 0
    capsys.readouterr()
    assert _starts(path) == 3  # every session the journal held, none lost to the repair


def test_repair_says_when_it_cannot(tmp_path: Path, journal_lines: list[bytes],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A compressed journal without its header: the check fails, and ``--repair`` says it
    cannot repair it (exit 1), leaving the file as it was."""
    path = tmp_path / "journal.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(journal_lines[1:])))
    before = path.read_bytes()
    assert main(["journal", "check", str(path)]) == 1
    assert "refuses to append" in capsys.readouterr().out
    assert main(["journal", "check", "--repair", "--json", str(path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["header"] == "missing" and not report["repaired"]
    assert "compressed" in report["repair_failed"]
    assert path.read_bytes() == before
    assert main(["journal", "check", "--repair", str(path)]) == 1
    assert "cannot repair: a compressed journal" in capsys.readouterr().out
