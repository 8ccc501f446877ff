"""Run the demos behind the "simulated vs live" page and record how each ran.

Usage (from the repository root)::

    python docs/results/sim_vs_live.py                      # every demo
    python docs/results/sim_vs_live.py lmcache-mp           # only the named ones
    python docs/results/sim_vs_live.py --vllm-python .venv-vllm/bin/python vllm

Each demo writes its full report (per-request rows included) to ``out/sim-vs-live-NAME.json``;
this script keeps, in ``docs/results/data/sim-vs-live.json``, each demo's exact command, the
UTC date, the short commit, the machine and the wall time next to its report without the
per-request rows (the page's figures are all in the report's ``twin`` block), then fills the
page's block (``generate.py`` renders it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DATA = HERE / "data" / "sim-vs-live.json"
PAGE = HERE / "sim-vs-live.md"

#: name -> (the demo's options after ``kvprefetch demo``, whether it needs vLLM's Python).
DEMOS: dict[str, tuple[list[str], bool]] = {
    # The main job (`make demo`) as it ships: three seeds, client hints on.
    "emulated": (["--no-progress"], False),
    # Two seeds: three take over 7 minutes on a shared 2-core machine; the per-request
    # pairs give the intervals.
    "lmcache-mp": (["--backend", "lmcache-mp", "--repeats", "2", "--no-progress"], False),
    "vllm": (["--engine", "vllm", "--repeats", "2", "--no-progress"], True),
}


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def strip(report: dict[str, object]) -> dict[str, object]:
    """The report without its per-request rows."""
    policies = report.get("policies")
    if isinstance(policies, dict):
        report = {**report, "policies": {
            name: {k: v for k, v in block.items() if k != "per_request"}
            for name, block in policies.items()}}
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"demos to run: {', '.join(DEMOS)} "
                        "(default all)")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="the Python with vLLM's CPU build (make setup-vllm)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(DEMOS))
    if unknown:
        parser.error(f"unknown demo(s) {unknown}; known: {', '.join(DEMOS)}")
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    (ROOT / "out").mkdir(exist_ok=True)
    for name in args.names or list(DEMOS):
        options, needs_vllm = DEMOS[name]
        out = f"out/sim-vs-live-{name}.json"
        argv_ = ["kvprefetch", "demo", *options, "--json", out]
        python = args.vllm_python if needs_vllm else sys.executable
        entry: dict[str, object] = {
            "command": " ".join(argv_),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
            "commit": _commit(), "machine": {"cores": os.cpu_count(), "gpu": "none"}}
        print(f"== {name}: {entry['command']}", flush=True)
        started = time.monotonic()
        proc = subprocess.run([python, "-m", "kvprefetch", *argv_[1:]], cwd=ROOT)
        if proc.returncode != 0:
            print(f"{name} failed (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode
        entry["wall_s"] = round(time.monotonic() - started, 1)
        entry["report"] = strip(json.loads((ROOT / out).read_text()))
        data[name] = entry
        DATA.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    sys.path.insert(0, str(HERE))
    from generate import fill

    PAGE.write_text(fill(PAGE.read_text()))
    print(f"rewrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
