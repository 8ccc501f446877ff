"""Journal fuzz: random damage to a scheduler's journal, each case followed by a
start-up. Damage: byte flips, truncation, duplicated lines, reordered lines, and records
forged with absurd values and a matching checksum (``"t": 1e300``, a node outside the fleet,
10^12 tokens, a day-long ETA, bad chunk names, ...).

For every case: start-up returns (never raises, so Ray never loops on it); every record
either resumes or is quarantined and counted (``journal_quarantined`` = lines added to the
side file); the records that resume are original records, in their original order, each
once (so a flip, a duplicate, a reordering or a forged value never changes state silently);
forged, duplicated and reordered records are always caught; and the next start-up finds
nothing more to quarantine.

The suite runs 100 cases; ``KVPREFETCH_JOURNAL_FUZZ_CASES=1000`` for a longer run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.journal.file import encode_checked, quarantine_path
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 8 * GIB}})
CASES = int(os.environ.get("KVPREFETCH_JOURNAL_FUZZ_CASES", "100"))
SEED = int(os.environ.get("KVPREFETCH_JOURNAL_FUZZ_SEED", "15"))

#: Forged values, each with a recomputed checksum: none of them may resume.
ABSURD: list[tuple[str, object]] = [
    ("t", 1e300), ("t", -5.0), ("node", 99), ("in", 10**12), ("ctx", 10**15),
    ("eta_s", 1e9), ("turn", 10**12), ("keys", {"keep": -1, "add": []}),
    ("keys", {"keep": 0, "add": ["a/b"]}), ("kind", "nope"), ("session", ""),
    ("tenant", 123), ("out", -1), ("reused", "many"), ("seq", 1),
]
#: The same for scheduler-start records (an epoch of 2^40 would overflow order ids).
EPOCH_ABSURD: list[tuple[str, object]] = [
    ("t", 1e300), ("wall", 1e300), ("kvprefetch_epoch", 1 << 40), ("compression", -1.0),
    ("kvprefetch_epoch", -3), ("seq", 1),
]
#: The same for route records.
ROUTE_ABSURD: list[tuple[str, object]] = [
    ("t", 1e300), ("t", -5.0), ("node", 99), ("turn", 10**12), ("arrival", -1.0),
    ("kvprefetch_route", "a b"), ("digest", "xyz"), ("session", "other/x"),
    ("cancelled", "yes"), ("seq", 1),
]
#: The same for clean-stop records.
STOP_ABSURD: list[tuple[str, object]] = [
    ("t", 1e300), ("wall", 1e300), ("kvprefetch_stop", -3), ("seq", 1),
]


def _config(path: Path) -> ServiceConfig:
    return ServiceConfig(fleet=FLEET, policy="predictive", predictor="last-gap",
                         journal_path=str(path), journal_compact_records=0)


@pytest.fixture(scope="module")
def clean_journal(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A journal of three scheduler starts: content-keyed and position-keyed sessions,
    hints, closes."""
    path = tmp_path_factory.mktemp("fuzz") / "journal.jsonl"
    for start in range(3):
        with SchedulerService(_config(path)) as svc:
            c = connect(service=svc, tenant="t")
            for i in range(6):
                sid = f"s{start}-{i}"
                prompt = list(range(1_000 * (i + 1)))
                ans = c.route(sid, token_ids=prompt) if i % 2 else c.route(
                    sid, input_tokens=len(prompt))
                c.request_finished(sid, node=ans.node, input_tokens=len(prompt),
                                   output_tokens=40)
                c.hint(sid, "tool_running", eta_s=3.0)
                if i % 3 == 0:
                    c.session_closed(sid)
    return path.read_bytes()


def _lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


def _mutate(data: bytes, rng: random.Random) -> tuple[str, bytes, bool]:
    """(kind, damaged journal, whether the damage must be caught)."""
    lines = _lines(data)
    body = list(range(1, len(lines)))  # not the header
    kind = rng.choice(["flip", "truncate", "duplicate", "reorder", "absurd"])
    if kind == "flip":
        header = len(lines[0])
        at = rng.randrange(len(data))
        out = bytearray(data)
        out[at] ^= rng.randrange(1, 256)
        # A flip in the header (no state, no checksum) may go unnoticed.
        return kind, bytes(out), at >= header
    if kind == "truncate":
        at = rng.randrange(len(lines[0]), len(data))
        # Cut at a line's end (with or without its newline): whole records, no damage.
        boundary = data[at - 1:at] == b"\n" or data[at:at + 1] == b"\n"
        return kind, data[:at], not boundary
    if kind == "duplicate":
        i = rng.choice(body)
        j = rng.randrange(i + 1, len(lines) + 1)
        lines.insert(j, lines[i])
        return kind, b"".join(lines), True
    if kind == "reorder":
        i, j = sorted(rng.sample(body, 2))
        lines[i], lines[j] = lines[j], lines[i]
        return kind, b"".join(lines), True
    i = rng.choice(body)
    row = json.loads(lines[i])
    row.pop("crc", None)
    key, value = rng.choice(ABSURD if "kind" in row else STOP_ABSURD
                            if "kvprefetch_stop" in row else ROUTE_ABSURD
                            if "kvprefetch_route" in row else EPOCH_ABSURD)
    same = row.get(key) == value
    row[key] = value
    lines[i] = encode_checked(row)
    return f"absurd {key}", b"".join(lines), not same


def _is_ordered_subsequence(part: list[bytes], whole: list[bytes]) -> bool:
    position = 0
    for line in part:
        try:
            position = whole.index(line, position) + 1
        except ValueError:
            return False
    return True


def test_journal_fuzz(tmp_path: Path, clean_journal: bytes) -> None:
    rng = random.Random(SEED)
    original = _lines(clean_journal)
    kinds: dict[str, int] = {}
    caught = quarantined_total = 0
    for case in range(CASES):
        kind, damaged, must_catch = _mutate(clean_journal, rng)
        kinds[kind.split()[0]] = kinds.get(kind.split()[0], 0) + 1
        work = tmp_path / f"case{case % 4}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        path = work / "journal.jsonl"
        path.write_bytes(damaged)
        records = sum(1 for line in _lines(damaged) if line.strip())
        with SchedulerService(_config(path)) as svc:  # never raises
            quarantined = svc.stats.journal_quarantined
        side = quarantine_path(path)
        side_lines = len(side.read_bytes().splitlines()) if side.exists() else 0
        assert side_lines == quarantined, (case, kind)
        kept = _lines(path.read_bytes())
        # header, the kept records, then the epoch and stop records this start and its
        # close appended
        resumed = kept[1:-2]
        assert len(resumed) + quarantined + (kept[0] in _lines(damaged)[:1]) >= records - 1, (
            case, kind)
        assert _is_ordered_subsequence(resumed, original), (case, kind)
        if must_catch:
            assert quarantined >= 1, (case, kind)
        caught += quarantined >= 1
        quarantined_total += quarantined
        if case % 10 == 0:  # the next start-up has nothing left to set aside
            with SchedulerService(_config(path)) as again:
                assert again.stats.journal_quarantined == 0, (case, kind)
    print(f"\njournal fuzz (seed {SEED}): {CASES} cases {kinds}; start-up never failed; "
          f"{caught} cases caught damage, {quarantined_total} records quarantined and "
          f"counted; every resumed record an original one, in order, once")
