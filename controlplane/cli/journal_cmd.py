"""``kvprefetch journal check [--repair] PATH``: check a scheduler journal record by record,
in the spirit of Valkey's ``valkey-check-aof``; ``kvprefetch journal compact PATH``: drop
closed sessions' records from it.

It reads every line as the scheduler does when it resumes (checksums, sequence numbers,
record syntax, values no live call produces and,
unless ``--no-time-check``, the range of each record's time against the wall clock now) and
reports the records, the scheduler starts and every damaged line with its number and why.

It also says what was lost. Records carry sequence numbers: the numbers missing between two
trusted records are records lost, listed with the damaged lines that held them (exactly in
a journal never compacted; "up to" in a compacted one, where gaps are normal). The end of
the journal: a clean stop record (the scheduler stopped), a record cut short (the file was
cut mid-record), or neither (a scheduler still appending, a crash, or a file cut at a
record boundary: records after the last one, if any, are lost). An empty file says so.

A journal whose first line is not its header (lost, or a blank line before it) fails the
check: the scheduler refuses to append to it, so ``kvprefetch serve`` does not start on it.

Exit status: 0 when the journal is clean (or was repaired), 1 when it has damaged lines,
lacks its header line, is empty, or could not be repaired.

``--repair`` replaces the journal atomically by a copy without the damaged lines (a fresh
header when the header was damaged or missing) and appends those lines to the side file
``PATH.quarantine`` (JSON lines: line, reason, raw text), as the scheduler itself does on
start-up; both keep the journal's file mode. Where it cannot (a compressed journal, a file
it cannot rewrite) it says why and exits 1, leaving the journal as it was. Run it on a
journal no scheduler is appending to.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path
from typing import Any

from kvprefetch.controlplane.cli.options import non_negative_int

COMPACT_HELP = """\
Rewrite the journal without the records of closed sessions, as the scheduler does at
start-up and while it runs (``journal_compact_records``): it keeps the header's metadata,
the last scheduler-start record and the records of the sessions still live, each from
after its last close, with their sequence numbers. The rewrite is atomic (a temporary file
beside the journal, fsynced, renamed over it): a crash leaves the old journal or the new
one. A journal with damaged records is left as it is (exit status 1): run `kvprefetch
journal check --repair` first. Run it on a journal no scheduler is appending to (a running
scheduler compacts its own journal).
"""


def _plain(text: str) -> str:
    """A docstring as help text: reST's double backquotes as the single ones the other
    commands' help uses."""
    return text.replace("``", "`")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="journal_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="check a journal; --repair sets damaged lines aside",
                           description=_plain(__doc__ or ""),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("path", type=Path, metavar="PATH", help="the journal (JSONL)")
    check.add_argument("--repair", action="store_true",
                       help="write a clean journal atomically; damaged lines go to "
                            "PATH.quarantine")
    check.add_argument("--no-time-check", action="store_true",
                       help="do not range-check record times against the wall clock")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("--show", type=non_negative_int, default=20, metavar="N",
                       help="damaged lines listed in the text report (default 20)")
    compact = sub.add_parser("compact", help="drop closed sessions' records (atomically)",
                             description=_plain(COMPACT_HELP),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    compact.add_argument("path", type=Path, metavar="PATH", help="the journal (JSONL)")
    compact.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    if args.journal_command == "compact":
        return _compact(args)
    return _check(args)


def _header_metadata(path: Path) -> dict[str, Any]:
    """The journal header's metadata (without the version and the ``compacted`` mark), to
    carry over into the compacted copy; empty when the header does not parse."""
    from kvprefetch.controlplane.journal.file import HEADER_KEY

    with path.open("rb") as f:
        first = f.readline()
    try:
        header = json.loads(first)
    except ValueError:
        return {}
    if not isinstance(header, dict) or HEADER_KEY not in header:
        return {}
    return {k: v for k, v in header.items() if k not in (HEADER_KEY, "compacted")}


def _compact(args: argparse.Namespace) -> int:
    from kvprefetch.controlplane.base.errors import ConfigError
    from kvprefetch.controlplane.journal.compaction import compact_journal

    path: Path = args.path
    if not path.is_file():
        raise ConfigError(f"{path}: no such journal")
    if path.suffix == ".gz":
        raise ConfigError(f"{path}: a compressed journal; compact the live (uncompressed) one")
    t0 = time.perf_counter()
    result = compact_journal(path, metadata=_header_metadata(path))
    report = {"path": str(path), **result.to_dict(), "compacted": not result.damaged,
              "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        print(json.dumps(report, indent=2))
    elif result.damaged:
        print(f"{path}: not compacted: {result.damaged} damaged records; run `kvprefetch "
              "journal check --repair` first")
    else:
        mib = 1 << 20
        print(f"{path}: compacted in {report['seconds']:.2f} s: {result.records_before:,} "
              f"records -> {result.records_after:,} ({result.bytes_before / mib:.2f} -> "
              f"{result.bytes_after / mib:.2f} MiB)")
    return 1 if result.damaged else 0


def _header_state(path: Path, size: int | None, damaged_lines: set[int]) -> str:
    """``ok``, ``missing`` (line 1 is no header: the scheduler refuses to append),
    ``damaged`` (line 1 is a damaged line: a repair puts a fresh header in its place) or
    ``none`` (an empty file)."""
    from kvprefetch.controlplane.journal.file import is_header_line

    if not size:
        return "none"
    if 1 in damaged_lines:
        return "damaged"
    with (gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb")) as f:
        return "ok" if is_header_line(f.readline()) else "missing"


def _repair(path: Path, damaged: list[Any], header: str) -> tuple[Path | None, str | None]:
    """Set the damaged lines aside and give a journal without its header a fresh one.
    Returns the quarantine side file (None: no damaged line) and why the repair could not
    be done (None: it was)."""
    from kvprefetch.controlplane.journal.file import (
        header_line,
        is_header_line,
        quarantine,
        replace_journal,
    )

    if path.name.endswith(".gz"):
        return None, "a compressed journal: repair the live (uncompressed) one"
    try:
        side = quarantine(path, damaged) if damaged else None
        if header == "missing":
            with path.open("rb") as f:
                replace_journal(path, [header_line(repaired=True), *f])
        with path.open("rb") as f:
            if not is_header_line(f.readline()):
                return side, "line 1 is still no journal header"
    except OSError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return side, None


def _check(args: argparse.Namespace) -> int:
    from kvprefetch.controlplane.journal.file import TimeLimits
    from kvprefetch.controlplane.journal.live import LiveJournalScanner

    path: Path = args.path
    size = path.stat().st_size if path.is_file() else None
    limits = None if args.no_time_check else TimeLimits(now_wall_s=time.time())
    scan = LiveJournalScanner(path, limits=limits)
    for _ in scan:
        pass
    lost = scan.lost()
    reported = [gap for gap in lost if gap.damaged_lines or gap.exact]
    torn = [d.line for d in scan.damaged if d.torn]
    header = _header_state(path, size, {d.line for d in scan.damaged})
    side, cannot = None, None
    if args.repair and (scan.damaged or header == "missing"):
        side, cannot = _repair(path, scan.damaged, header)
    repaired = (scan.damaged or header == "missing") and cannot is None and args.repair
    end = ("empty" if size == 0 else "stopped" if scan.stopped and not scan.trailing_damaged
           else "cut-mid-record" if torn else "open")
    report = {
        "path": str(path), "bytes": size, "empty": size == 0, "records": scan.records,
        "events": scan.events, "scheduler_starts": scan.epochs,
        "last_epoch": scan.last_epoch, "last_seq": scan.last_seq, "compacted": scan.compacted,
        "checksummed": scan.checked, "last_t": scan.last_t, "damaged": len(scan.damaged),
        "damaged_lines": [{"line": d.line, "reason": d.reason, "torn": d.torn}
                          for d in scan.damaged],
        "lost": [gap.to_dict() for gap in reported],
        "records_lost": sum(gap.records for gap in reported),
        "damaged_after_last_seq": list(scan.trailing_damaged), "end": end,
        "header": header, "repaired": bool(repaired), "repair_failed": cannot,
        "quarantine": str(side) if side is not None else None,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_check(path, scan, report, args.show)
    if size == 0:
        return 1
    return 1 if (scan.damaged or header == "missing") and not repaired else 0


def _print_check(path: Path, scan: Any, report: dict[str, Any], show: int) -> None:
    """The text report of :func:`_check`."""
    if report["empty"]:
        print(f"{path}: empty (0 bytes): no header and no records; whatever it held is lost")
        return
    print(f"{path}: {scan.records} records ({scan.events} events, {scan.epochs} scheduler "
          f"starts, {scan.checked} checksummed), {len(scan.damaged)} damaged")
    if report["header"] == "missing":
        print("  line 1: not the journal's header (lost, or a line before it): "
              "`kvprefetch serve` refuses to append to this journal")
    for d in scan.damaged[:show]:
        print(f"  line {d.line}: {d.reason}")
    if len(scan.damaged) > show:
        print(f"  ... and {len(scan.damaged) - show} more")
    for gap in report["lost"]:
        held = f"{gap['records']} records" if gap["exact"] else f"up to {gap['records']} records"
        lines = gap["damaged_lines"]
        where = (f"in damaged line{'s' if len(lines) > 1 else ''} "
                 f"{_ranges(lines)}" if lines else "with no damaged line (lines removed, or "
                 "set aside by an earlier repair)")
        print(f"lost: {held}, seq {gap['first_seq']}..{gap['last_seq']}, {where}")
    last = f"seq {scan.last_seq}" if scan.last_seq else "the header"
    after = report["damaged_after_last_seq"]
    if after and report["end"] != "cut-mid-record":
        print(f"lost: an unknown number of records in damaged lines {_ranges(after)} after "
              f"{last}")
    if scan.records <= 1 and not scan.damaged:
        print("no records after the header")
    if report["end"] == "stopped":
        print(f"end: the scheduler stopped cleanly at {last}")
    elif report["end"] == "cut-mid-record":
        print(f"end: truncated mid-record after {last} (line {after[-1]} cut short): what "
              "followed it is lost")
    else:
        print(f"end: no stop record after {last}: a scheduler still appending, a crash, or "
              f"a journal truncated at a record boundary (records after {last}, if any, "
              "are lost)")
    if report["repair_failed"]:
        print(f"cannot repair: {report['repair_failed']}; the journal is left as it was")
    elif report["repaired"]:
        if scan.damaged:
            print(f"repaired: {len(scan.damaged)} damaged lines moved to "
                  f"{report['quarantine']}")
        if report["header"] == "missing":
            print("repaired: a fresh header written before line 1")
    elif scan.damaged or report["header"] == "missing":
        print("run with --repair to mend it")


def _ranges(lines: list[int]) -> str:
    """``[3, 4, 5, 9]`` as ``3-5, 9``."""
    out: list[str] = []
    for n in lines:
        if out and n == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)
