"""``kvprefetch journal check [--repair] PATH``: check a scheduler journal record by record,
in the spirit of Valkey's ``valkey-check-aof``; ``kvprefetch journal compact PATH``: drop
closed sessions' records from it.

It reads every line as the scheduler does when it resumes (checksums, sequence numbers,
record syntax, values no live call produces and,
unless ``--no-time-check``, the range of each record's time against the wall clock now) and
reports the records, the scheduler starts and every damaged line with its number and why.
Exit status: 0 when the journal is clean (or was repaired), 1 when it has damaged lines.

``--repair`` replaces the journal atomically by a copy without the damaged lines (a fresh
header when the header was damaged) and appends those lines to the side file
``PATH.quarantine`` (JSON lines: line, reason, raw text), as the scheduler itself does on
start-up. Run it on a journal no scheduler is appending to.
"""

from __future__ import annotations

import argparse
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="journal_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="check a journal; --repair sets damaged lines aside",
                           description=__doc__,
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
                             description=COMPACT_HELP,
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
    from kvprefetch.controlplane.traces.journal import HEADER_KEY

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
    from kvprefetch.controlplane.live.journal import compact_journal

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


def _check(args: argparse.Namespace) -> int:
    from kvprefetch.controlplane.live.journal import LiveJournalScanner
    from kvprefetch.controlplane.traces.journal import TimeLimits, quarantine

    limits = None if args.no_time_check else TimeLimits(now_wall_s=time.time())
    scan = LiveJournalScanner(args.path, limits=limits)
    for _ in scan:
        pass
    side = quarantine(args.path, scan.damaged) if args.repair and scan.damaged else None
    report = {
        "path": str(args.path), "records": scan.records, "events": scan.events,
        "scheduler_starts": scan.epochs, "last_epoch": scan.last_epoch,
        "checksummed": scan.checked, "last_t": scan.last_t, "damaged": len(scan.damaged),
        "damaged_lines": [{"line": d.line, "reason": d.reason, "torn": d.torn}
                          for d in scan.damaged],
        "repaired": side is not None, "quarantine": str(side) if side is not None else None,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.path}: {scan.records} records ({scan.events} events, {scan.epochs} "
              f"scheduler starts, {scan.checked} checksummed), {len(scan.damaged)} damaged")
        for d in scan.damaged[: args.show]:
            print(f"  line {d.line}: {d.reason}")
        if len(scan.damaged) > args.show:
            print(f"  ... and {len(scan.damaged) - args.show} more")
        if side is not None:
            print(f"repaired: {len(scan.damaged)} damaged lines moved to {side}")
        elif scan.damaged:
            print("run with --repair to set them aside")
    return 1 if scan.damaged and side is None else 0
