"""Run the measurements behind the result pages and record how each ran.

Usage (from the repository root)::

    python docs/results/run.py            # every run below
    python docs/results/run.py sim-grid   # only the named runs

Each run writes its JSON to ``docs/results/data/<name>.json`` (and a PNG beside the page
where the command has ``--plot``); this script adds an entry to
``docs/results/data/runs.json``: the exact command, the UTC date, the short commit, the
machine (cores, GPU) and the wall time. ``generate.py`` turns both into the tables.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
ROOT = HERE.parent.parent

def _yardstick(engine: str, *, hints: bool = False) -> list[str]:
    """The yardstick grid on one engine profile: the bundled slice and four synthetic
    profiles x 2/4/8 nodes x loads 0.5/1/2 x 3 seeds, every default policy; ``hints``:
    every client sends typing and tool hints."""
    name = f"yardstick-{engine}" + ("-hints" if hints else "")
    return [
        "kvprefetch", "sim-grid",
        "--traces", "controlplane/data/traces/claude-code,synthetic:agentic,"
        "synthetic:agentic-nostop,synthetic:chat,synthetic:research",
        "--nodes", "2,4,8", "--loads", "0.5,1,2", "--seeds", "0,1,2",
        "--engine", engine,
        *(["--hints", "user_typing,tool_running", "--hint-coverage", "1"] if hints else []),
        "--workers", "2", "--no-progress",
        "--json", f"docs/results/data/{name}.json",
        "--plot", f"docs/results/{name}.png",
    ]


#: name -> the command line, as a user types it from the repository root.
RUNS: dict[str, list[str]] = {
    "sim-bundled-n1": [
        "kvprefetch", "sim", "--nodes", "1", "--no-progress",
        "--json", "docs/results/data/sim-bundled-n1.json",
        "--plot", "docs/results/sim-bundled-n1.png",
    ],
    "sim-bundled-n2": [
        "kvprefetch", "sim", "--nodes", "2", "--no-progress",
        "--json", "docs/results/data/sim-bundled-n2.json",
        "--plot", "docs/results/sim-bundled-n2.png",
    ],
    "sim-ablation-local-n2": [
        "kvprefetch", "sim", "--nodes", "2", "--engine", "local", "--ablation",
        "--hints", "user_typing,tool_running", "--no-progress",
        "--json", "docs/results/data/sim-ablation-local-n2.json",
    ],
    **{f"yardstick-{engine}": _yardstick(engine)
       for engine in ("vllm-lmcache", "vllm-lmcache-lazy")},
    "yardstick-vllm-lmcache-hints": _yardstick("vllm-lmcache", hints=True),
    # The bound of forecasts from history: synthetic traffic only (its laws are known).
    "yardstick-true-law": [
        "kvprefetch", "sim-grid",
        "--traces", "synthetic:agentic,synthetic:agentic-nostop,synthetic:chat,"
        "synthetic:research",
        "--nodes", "2,4,8", "--loads", "0.5,1,2", "--seeds", "0,1,2",
        "--engine", "vllm-lmcache",
        "--policies", "ondemand,reactive,true-law,predictive,perfect", "--subject", "true-law",
        "--workers", "2", "--no-progress",
        "--json", "docs/results/data/yardstick-true-law.json",
    ],
    "bench-control-plane": [
        "kvprefetch", "bench", "control-plane", "--modes",
        "inproc,service,ray-1,http,http-batch,http-actor,http-threaded", "--sessions", "1000",
        "--events", "4000", "--callers", "1,8,32,128", "--no-progress",
        "--json", "docs/results/data/bench-control-plane.json",
    ],
    "bench-store": [
        "kvprefetch", "bench", "store", "--object-mib", "128", "--repeats", "3",
        "--conditions", "loopback", "--stores", "valkey,s3,tiered", "--no-progress",
        "--json", "docs/results/data/bench-store.json",
    ],
}


def _machine() -> dict[str, object]:
    gpu = shutil.which("nvidia-smi") is not None
    return {"cores": os.cpu_count(), "gpu": "yes" if gpu else "none"}


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def main(names: list[str]) -> int:
    DATA.mkdir(parents=True, exist_ok=True)
    manifest_path = DATA / "runs.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    exe = Path(sys.executable).parent / "kvprefetch"
    for name in names or list(RUNS):
        argv = RUNS[name]
        started = time.monotonic()
        entry = {
            "command": " ".join(argv),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
            "commit": _commit(),
            "machine": _machine(),
        }
        print(f"== {name}: {entry['command']}", flush=True)
        proc = subprocess.run([str(exe), *argv[1:]], cwd=ROOT)
        if proc.returncode != 0:
            print(f"{name} failed (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode
        entry["wall_s"] = round(time.monotonic() - started, 1)
        manifest[name] = entry
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
