"""``kvprefetch journal check`` says what was lost, not only which lines are damaged: the
records a damaged region held (gaps in the sequence numbers), an empty file, a file cut
mid-record or at a record boundary; ``--repair``, the quarantine side file and compaction
keep the journal's file mode."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.cli import main
from kvprefetch.controlplane.journal.compaction import compact_journal
from kvprefetch.controlplane.journal.file import quarantine_path
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
PAGE = 4096
_SEQ = re.compile(rb'^\{"seq":(\d+),')


@pytest.fixture(scope="module")
def journal_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A journal of ~300 records written by a scheduler that stopped cleanly."""
    path = tmp_path_factory.mktemp("journal") / "journal.jsonl"
    with SchedulerService(ServiceConfig(fleet=FLEET, journal_path=str(path))) as svc:
        c = connect(service=svc, tenant="acme")
        for turn in range(3):
            for i in range(50):
                tokens = 1000 * (turn + 1)
                ans = c.route(f"session-{i}", input_tokens=tokens)
                c.request_finished(f"session-{i}", node=ans.node or 0, input_tokens=tokens,
                                   output_tokens=20, context_tokens=tokens + 20)
    assert path.stat().st_mode & 0o777 == 0o600  # the writer creates it owner-only
    return path.read_bytes()


def _seqs(data: bytes) -> list[int]:
    return [int(m.group(1)) for line in data.splitlines() if (m := _SEQ.match(line))]


def _check(path: Path, capsys: pytest.CaptureFixture[str], *extra: str
           ) -> tuple[int, dict[str, object], str]:
    status = main(["journal", "check", "--no-time-check", "--json", *extra, str(path)])
    report = json.loads(capsys.readouterr().out)
    main(["journal", "check", "--no-time-check", str(path)])
    return status, report, capsys.readouterr().out


def test_a_zeroed_page_reports_the_records_it_held_and_repair_keeps_the_mode(
        journal_bytes: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = bytearray(journal_bytes)
    at = (len(data) // 2) // PAGE * PAGE
    data[at:at + PAGE] = bytes(PAGE)
    path = tmp_path / "journal.jsonl"
    path.write_bytes(bytes(data))
    path.chmod(0o600)
    intact = set(bytes(data).splitlines())
    gone = [seq for line, seq in zip(journal_bytes.splitlines()[1:], _seqs(journal_bytes),
                                     strict=True) if line not in intact]
    assert len(gone) >= 15 and gone == list(range(gone[0], gone[-1] + 1))

    status, report, text = _check(path, capsys)
    assert status == 1 and report["damaged"] == 1
    (lost,) = report["lost"]  # type: ignore[misc]
    assert lost["first_seq"] == gone[0] and lost["last_seq"] == gone[-1]
    assert lost["records"] == len(gone) and lost["exact"]
    assert lost["damaged_lines"] == [report["damaged_lines"][0]["line"]]  # type: ignore[index]
    assert report["records_lost"] == len(gone) and report["end"] == "stopped"
    assert f"lost: {len(gone)} records, seq {gone[0]}..{gone[-1]}, in damaged line" in text

    status, report, _ = _check(path, capsys, "--repair")
    assert status == 0 and report["repaired"]
    assert path.stat().st_mode & 0o777 == 0o600
    assert quarantine_path(path).stat().st_mode & 0o777 == 0o600
    # Repaired: no damaged line left, and the loss is still told.
    status, report, text = _check(path, capsys)
    assert status == 0 and report["damaged"] == 0 and report["records_lost"] == len(gone)
    assert "with no damaged line" in text


def test_repair_and_compaction_keep_the_journals_own_mode(
        journal_bytes: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = journal_bytes.splitlines(keepends=True)
    lines[5] = lines[5].replace(b'"kind"', b'"kinb"')
    path = tmp_path / "journal.jsonl"
    path.write_bytes(b"".join(lines))
    path.chmod(0o640)
    status, report, _ = _check(path, capsys, "--repair")
    assert status == 0 and report["repaired"]
    assert path.stat().st_mode & 0o777 == 0o640
    assert quarantine_path(path).stat().st_mode & 0o777 == 0o640
    compact_journal(path)
    assert path.stat().st_mode & 0o777 == 0o640


def test_an_empty_journal_is_reported_as_empty(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "journal.jsonl"
    path.write_bytes(b"")
    status, report, text = _check(path, capsys)
    assert status == 1 and report["empty"] and report["end"] == "empty"
    assert "empty (0 bytes)" in text


def test_a_cut_mid_record_and_a_cut_at_a_record_boundary_are_reported(
        journal_bytes: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = journal_bytes.splitlines(keepends=True)
    middle = len(lines) // 2
    before = _seqs(b"".join(lines[:middle]))[-1]
    path = tmp_path / "journal.jsonl"

    path.write_bytes(b"".join(lines[:middle]) + lines[middle][:40])
    status, report, text = _check(path, capsys)
    assert status == 1 and report["end"] == "cut-mid-record"
    assert f"truncated mid-record after seq {before}" in text

    path.write_bytes(b"".join(lines[:middle]))
    status, report, text = _check(path, capsys)
    assert status == 0 and report["end"] == "open" and report["last_seq"] == before
    assert f"no stop record after seq {before}" in text and "truncated at a record" in text

    path.write_bytes(journal_bytes)
    status, report, text = _check(path, capsys)
    assert status == 0 and report["end"] == "stopped" and report["lost"] == []
    assert "stopped cleanly" in text
