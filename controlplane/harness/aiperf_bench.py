"""``kvprefetch bench aiperf``: NVIDIA's aiperf, a peer benchmark client, replays the vLLM
demo's multi-turn trace through the gateway, next to our own replayer.

The stack is ``kvprefetch demo --engine vllm``'s (:mod:`kvprefetch.controlplane.harness.demo_vllm`:
local Ray, Valkey + S3, per node a real vLLM CPU server and ``lmcache server`` with our L2 adapter
behind an emulated link, one ``lmcache-mp`` agent per node, the gateway in front), started
once. Then two replays of the same scaled trace, each on a fresh deployment of the chosen
policy (default ``predictive``) with emptied L1 and prefix caches and prompts of its own
content:

1. ours: :class:`~kvprefetch.controlplane.harness.gateway_replay.GatewayReplayer` (TTFT at our
   client);
2. aiperf (``aiperf profile``, its own venv: it only talks HTTP) with the trace written as a
   ``mooncake_trace`` JSONL file: one row per turn, ``session_id``, the session's first turn
   at its ``timestamp`` (ms, compressed like ours), later turns ``delay`` ms after the
   previous answer, and the request body verbatim (``payload``: the same token-id prompts
   our replayer sends, streaming). aiperf sends each session's id in the ``X-Session-ID``
   header, so the gateway sees sessions, not loose requests. Its tokenizer (for token
   counts) is the tiny model's: aiperf loads tokenizers by hub name, offline too
   (``HF_HUB_OFFLINE=1`` makes it resolve the name in the local hub cache, never a path),
   so the tokenizer is filed in a hub cache layout under the artifact folder
   (:func:`kvprefetch.agents.vllm.tiny_model.hub_cache`) and aiperf runs with ``HF_HUB_CACHE``
   pointing there: nothing is downloaded.

No client hints (aiperf sends none; ours sends none either here, so the two are alike).
The JSON report (``--json``) puts aiperf's own TTFT statistics (from its
``profile_export_aiperf.json``) next to ours, with both runs' failed requests, the answers
whose text was empty (a random-weight model may emit nothing printable: counted apart,
not failures), the gateway's own request outcomes and the engines' counters.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: aiperf's message for an answer that carried no text.
EMPTY_ANSWER = "No responses with actual content"
def find_aiperf(given: str | None) -> str:
    from kvprefetch.controlplane.base.errors import ConfigError

    candidates = [given] if given else [".venv-aiperf/bin/aiperf", shutil.which("aiperf")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return str(Path(c).resolve())
    where = given or "looked for .venv-aiperf/bin/aiperf and aiperf on PATH"
    raise ConfigError(f"aiperf not found ({where}): make setup-aiperf")

def mooncake_rows(trace: Any, salt: str, model: str, compression: float) -> list[dict[str, Any]]:
    """aiperf's ``mooncake_trace`` rows for ``trace`` (see the module docstring): the same
    prompts
    :class:`~kvprefetch.controlplane.harness.gateway_replay.GatewayReplayer` sends with ``salt``."""
    from kvprefetch.controlplane.harness.gateway_replay import PromptBook

    book = PromptBook(salt)
    rows = []
    for s in sorted(trace.sessions, key=lambda s: (s.start_s, s.session_id)):
        for r in s.requests:
            row: dict[str, Any] = {"session_id": s.session_id}
            if r.turn == 0:
                row["timestamp"] = round(s.start_s / compression * 1e3, 3)
            else:
                row["delay"] = round((r.gap_s or 0.0) / compression * 1e3, 3)
            row["payload"] = {"model": model, "prompt": book.prompt(s.session_id, r),
                              "max_tokens": r.output_tokens, "stream": True,
                              "ignore_eos": True, "temperature": 0.0}
            rows.append(row)
    return rows


def run_aiperf_bench(args: argparse.Namespace, ns: argparse.Namespace) -> int:
    """``kvprefetch bench aiperf`` with its options ``args`` and the vLLM demo's options
    ``ns`` (its defaults applied): writes the report, exits 1 when a request failed."""
    from kvprefetch.controlplane.base.atomic import write_json_atomic
    from kvprefetch.controlplane.base.errors import ConfigError
    from kvprefetch.controlplane.harness import demo_vllm

    aiperf = find_aiperf(args.aiperf)
    if args.timeout_s <= 0:
        raise ConfigError("--timeout-s must be > 0")
    plan = demo_vllm.prepare(ns)
    st = plan.seeds[0]
    artifacts = Path(args.artifact_dir)
    artifacts.mkdir(parents=True, exist_ok=True)
    print(f"bench aiperf: {st.trace.requests} requests of {len(st.trace.sessions)} sessions "
          f"per client, policy {args.policy}",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    with demo_vllm.started_stack(ns, plan) as stack:
        ours = _ours(stack, plan, st)
        theirs = _aiperf(stack, plan, st, aiperf, artifacts, args.timeout_s)
    report = {
        "meta": {"scenario": "bench-aiperf", "engine": "vllm", "policy": args.policy,
                 "sessions": len(st.trace.sessions), "requests": st.trace.requests,
                 "seed": args.seed, "time_compression": args.compression,
                 "token_scale": args.token_scale,
                 "link_mib_s": round(plan.link_mib_s, 3) if plan.link_mib_s else None,
                 "calibration": stack.calibration, "ttft_unit": "ms, at each client",
                 "aiperf": theirs.pop("version", None), "wall_s":
                     round(time.perf_counter() - started, 1)},
        "ours": ours, "aiperf": theirs,
    }
    write_json_atomic(args.json_out, report)
    _print(report)
    print(f"wrote {args.json_out}")
    failed = (theirs["failed_requests_gateway"] + theirs["errors_other"]
              + ours["failed_requests"])
    return 1 if failed else 0


def _ttft_stats(values_ms: list[float]) -> dict[str, float | int]:
    if not values_ms:
        return {"count": 0}
    xs = sorted(values_ms)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    return {"count": len(xs), "avg": round(statistics.fmean(xs), 2), "p50": round(q(0.5), 2),
            "p90": round(q(0.9), 2), "p99": round(q(0.99), 2), "min": round(xs[0], 2),
            "max": round(xs[-1], 2)}


def _gateway_outcomes(url: str) -> dict[str, int]:
    """The gateway's own request counts by outcome (``/metrics``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, int] = {}
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        if family.name == "kvprefetch_gateway_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels["outcome"]
                    out[key] = out.get(key, 0) + int(sample.value)
    return out


def _ours(stack: Any, plan: Any, st: Any) -> dict[str, Any]:
    from kvprefetch.controlplane.harness import demo_vllm
    from kvprefetch.controlplane.harness.gateway_replay import GatewayReplayer

    args = stack.args
    print("replaying with our client ...", file=sys.stderr, flush=True)
    with demo_vllm.deployed(stack, args.policies, plan.service_predictor) as d:
        before = stack.counters()
        out = GatewayReplayer(st.trace, d.client, d.gateway_url,
                              stack.engines[0].vllm.served_model_name,
                              compression=args.compression, nodes=stack.fleet.nodes,
                              salt=f"ours-{uuid.uuid4().hex[:6]}").run()
        counters = stack.counters_since(before, len(out.records))
        outcomes = _gateway_outcomes(d.gateway_url)
    ttft = [(r.first_token_s - r.arrival_s) * 1e3 for r in out.records]
    returning = [(r.first_token_s - r.arrival_s) * 1e3 for r in out.records if r.returning]
    return {"ttft_ms": _ttft_stats(ttft), "returning_ttft_ms": _ttft_stats(returning),
            "requests": len(out.records) + out.failed, "failed_requests": out.failed,
            "errors": out.errors, "empty_text": out.empty_text, "gateway_outcomes": outcomes,
            "engine_counters": counters.reported(), "wall_s": round(out.wall_s, 1)}


def _aiperf(stack: Any, plan: Any, st: Any, aiperf: str, artifacts: Path,
            timeout_s: float) -> dict[str, Any]:
    from kvprefetch.controlplane.harness import demo_vllm

    args = stack.args
    model = stack.engines[0].vllm.served_model_name
    trace_file = artifacts / "trace.mooncake.jsonl"
    rows = mooncake_rows(st.trace, f"aiperf-{uuid.uuid4().hex[:6]}", model, args.compression)
    trace_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = artifacts / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    from kvprefetch.agents.vllm.tiny_model import hub_cache

    cache = artifacts / "hf-cache"
    tokenizer = hub_cache(stack.model_dir, cache)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_CACHE": str(cache.resolve()), "HF_HUB_DISABLE_TELEMETRY": "1"}
    print(f"replaying with aiperf ({len(rows)} requests, {trace_file}) ...", file=sys.stderr,
          flush=True)
    with demo_vllm.deployed(stack, args.policies, plan.service_predictor) as d:
        command = [aiperf, "profile", "--model", model, "--tokenizer", tokenizer,
                   "--url", d.gateway_url, "--endpoint-type", "completions", "--streaming",
                   "--custom-dataset-type", "mooncake_trace", "--input-file", str(trace_file),
                   "--session-header", "X-Session-ID", "--fixed-schedule",
                   "--fixed-schedule-auto-offset",
                   "--request-timeout-seconds", "300", "--artifact-dir", str(run_dir),
                   "--ui-type", "none", "--no-server-metrics"]
        before = stack.counters()
        started = time.perf_counter()
        log_path = artifacts / "aiperf.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.run(command, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=timeout_s, check=False)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"aiperf exited with {proc.returncode}: {tail}")
        summary = _read_summary(run_dir)
        records = _read_records(run_dir)
        counters = stack.counters_since(before, len(rows)).reported()
        outcomes = _gateway_outcomes(d.gateway_url)
    gateway_failed = sum(n for k, n in outcomes.items() if k != "ok")
    errors = summary.get("errors") or []
    # aiperf counts an answer with no text as an error (InvalidInferenceResultError, "no
    # responses with actual content"): the random-weight model's doing, not a failure.
    empty_errors = sum(int(e.get("count", 0)) for e in errors
                       if EMPTY_ANSWER in str((e.get("error_details") or {}).get("message")))
    return {
        "version": _version(aiperf),
        "command": " ".join(command[1:]),
        "ttft_ms": summary.get("time_to_first_token"),
        "returning_ttft_ms": _ttft_stats([r["ttft_ms"] for r in records
                                          if r["turn"] > 0 and r["ttft_ms"] is not None]),
        "request_latency_ms": summary.get("request_latency"),
        "request_count": summary.get("request_count"),
        "error_request_count": summary.get("error_request_count", 0),
        "errors_empty_text": empty_errors,
        "errors_other": summary.get("error_request_count", 0) - empty_errors,
        "errors": errors,
        "empty_text": sum(1 for r in records if r.get("empty_text")),
        "records": len(records),
        "failed_requests_gateway": gateway_failed,
        "gateway_outcomes": outcomes,
        "engine_counters": counters,
        "wall_s": round(wall, 1),
        "artifacts": str(run_dir),
    }


def _version(aiperf: str) -> str | None:
    try:
        out = subprocess.run([aiperf, "--version"], capture_output=True, text=True,
                             timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[-1] if lines else None


def _read_summary(run_dir: Path) -> dict[str, Any]:
    """aiperf's summary (``profile_export_aiperf.json``): TTFT and latency statistics in
    ms, request and error counts."""
    found = sorted(run_dir.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {run_dir}")
    body = json.loads(found[0].read_text())
    out: dict[str, Any] = {}
    records = body.get("records", body)
    for key in ("time_to_first_token", "request_latency"):
        metric = records.get(key)
        if isinstance(metric, dict):
            out[key] = {k: metric[k] for k in ("unit", "count", "avg", "p50", "p90", "p99",
                                               "min", "max") if k in metric}
    for key in ("request_count", "error_request_count"):  # absent when 0
        metric = records.get(key)
        value = metric.get("avg") if isinstance(metric, dict) else metric
        out[key] = int(value or 0)
    errors = body.get("error_summary")
    if errors:
        out["errors"] = errors
    return out


def _read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Per request (aiperf's ``profile_export.jsonl``): its turn in the session, its TTFT
    (ms), whether its answer had text, its error."""
    found = sorted(run_dir.rglob("profile_export.jsonl"))
    rows: list[dict[str, Any]] = []
    if not found:
        return rows
    for line in found[0].read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        metrics = record.get("metrics") or {}
        meta = record.get("metadata") or {}
        osl = (metrics.get("output_sequence_length") or {}).get("value")
        ttft = (metrics.get("time_to_first_token") or {}).get("value")
        rows.append({"turn": int(meta.get("turn_index") or 0), "ttft_ms": ttft,
                     "empty_text": not osl, "error": record.get("error")})
    return rows


def _print(report: dict[str, Any]) -> None:
    ours, theirs = report["ours"], report["aiperf"]
    print(f"\nbench aiperf: {report['meta']['requests']} requests per client through the "
          f"gateway, policy {report['meta']['policy']}; TTFT in ms at each client")
    head = (f"{'client':<8} {'count':>6} {'avg':>8} {'p50':>8} {'p90':>8} {'p99':>8} "
            f"{'ret avg':>8} {'ret p90':>8} {'failed':>7} {'empty':>6}")
    print(head)
    print("-" * len(head))
    for name, block, failed in (("ours", ours, ours["failed_requests"]),
                                ("aiperf", theirs, theirs["errors_other"])):
        t, r = block.get("ttft_ms") or {}, block.get("returning_ttft_ms") or {}
        print(f"{name:<8} {t.get('count', 0):>6} {t.get('avg', 0):>8.1f} "
              f"{t.get('p50', 0):>8.1f} {t.get('p90', 0):>8.1f} {t.get('p99', 0):>8.1f} "
              f"{r.get('avg', 0):>8.1f} {r.get('p90', 0):>8.1f} {failed or 0:>7} "
              f"{block['empty_text']:>6}")
    print(f"gateway outcomes: ours {ours['gateway_outcomes']}, aiperf "
          f"{theirs['gateway_outcomes']}; aiperf's errors: {theirs['error_request_count']}, "
          f"of which {theirs['errors_empty_text']} answers without text (the random-weight "
          "model's; counted under empty, not failed)")
