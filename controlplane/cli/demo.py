"""``kvprefetch demo``: the live control plane on a local Ray runtime, moving real bytes.

Starts Ray (small object store), embedded Valkey and S3 (SeaweedFS), N emulated GPU nodes
(one prefetch agent and one engine emulator each, pinned by a per-node custom resource),
and replays the bundled Claude Code slice at a time compression through the Python client:
first with ``ondemand``, then with ``predictive``. Prints a table, writes a JSON report
(the fields of ``kvprefetch sim``, plus real bytes) and a PNG. Everything is shut down at
the end, also on Ctrl-C.

The replayed trace: the first ``--sessions`` sessions of the slice, at most ``--turns``
turns each, idle gaps capped at ``--max-gap-s`` (long pauses only stretch the demo: the
tiers are then cold either way), at most ``--max-context`` tokens of context.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import signal
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
GIB = 1 << 30
MIB = 1 << 20

EPILOG = """examples:
  kvprefetch demo                                  # 2 nodes, ~2.5 minutes on 2 cores
  kvprefetch demo --backend lmcache-mp             # one real LMCache server per node
  kvprefetch demo --nodes 3 --compression 40 --json out/demo.json --plot out/demo.png
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--nodes", type=int, default=2, help="emulated GPU nodes (default 2)")
    p.add_argument("--backend", choices=("local", "lmcache-mp"), default="local",
                   help="node-local KV tier: 'local' = the agents' own DRAM tier; "
                        "'lmcache-mp' = a real LMCache MP server per node (L2: our adapter "
                        "over the same Valkey + S3), the engine emulators its engine-driven "
                        "clients, the agents warming it over its HTTP API (default local)")
    p.add_argument("--policies", default="ondemand,predictive",
                   help="policies to run, in order (default: ondemand,predictive)")
    p.add_argument("--predictor", default="ewma", help="predictor of 'predictive' (ewma)")
    p.add_argument("--compression", type=float, default=20.0,
                   help="service seconds per wall second (default 20)")
    p.add_argument("--kv-scale", type=float, default=1 / 4096,
                   help="real bytes per modelled KV byte (default 1/4096)")
    p.add_argument("--chunk-tokens", type=int, default=4096,
                   help="tokens per stored chunk (default 4096)")
    p.add_argument("--sessions", type=int, default=12, help="sessions to replay (default 12)")
    p.add_argument("--turns", type=int, default=25, help="turns per session at most (25)")
    p.add_argument("--max-gap-s", type=float, default=60.0,
                   help="cap idle gaps at this many trace seconds (default 60)")
    p.add_argument("--session-rate", type=float, default=0.03,
                   help="session starts per trace second (default 0.03)")
    p.add_argument("--hbm-gib", type=float, default=2.0, help="HBM for KV per node, GiB (2)")
    p.add_argument("--dram-gib", type=float, default=24.0, help="DRAM tier per node, GiB (24)")
    p.add_argument("--no-link-emulation", dest="link_emulation", action="store_false",
                   help="let the agents move bytes as fast as the loopback allows, instead of "
                        "at the fleet model's remote-read rate (scaled by kv_scale and the "
                        "compression)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", help="write the report as JSON here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--no-progress", action="store_true")


def build_trace(args: argparse.Namespace, window: int) -> Any:
    from controlplane.sim.simulator import clamp_to_window
    from controlplane.traces import ArrivalOptions, bundled_trace_path, load_trace

    trace = load_trace(bundled_trace_path("claude-code"),
                       arrivals=ArrivalOptions(session_rate_per_s=args.session_rate),
                       seed=args.seed)
    sessions = []
    for s in trace.sessions[: args.sessions]:
        reqs = tuple(replace(r, gap_s=min(r.gap_s, args.max_gap_s) if r.gap_s else r.gap_s)
                     for r in s.requests[: args.turns])
        sessions.append(replace(s, requests=reqs))
    return clamp_to_window(replace(trace, sessions=tuple(sessions)), window)


def run(args: argparse.Namespace) -> int:
    from controlplane.base.config import fleet_from_dict
    from controlplane.base.errors import ConfigError
    from controlplane.core.policies import parse_policies

    if not 1 <= args.nodes <= 8:
        raise ConfigError("--nodes must be 1..8 on one machine")
    if args.compression <= 0 or not 0 < args.kv_scale <= 1:
        raise ConfigError("--compression must be > 0 and --kv-scale in (0, 1]")
    policies = parse_policies(args.policies)
    fleet = fleet_from_dict({"nodes": args.nodes, "node": {
        "hbm_kv_bytes": int(args.hbm_gib * GIB), "dram_tier_bytes": int(args.dram_gib * GIB)}})
    trace = build_trace(args, fleet.model.max_context_tokens)
    stop = threading.Event()
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        print("\ninterrupted: stopping the replay and shutting down...", file=sys.stderr)
        stop.set()

    signal.signal(signal.SIGINT, on_sigint)
    try:
        report = _run(args, fleet, policies, trace, stop)
    finally:
        signal.signal(signal.SIGINT, previous)
    if report is None:
        return 130
    _print(report)
    if args.json_out:
        from controlplane.base.atomic import write_json_atomic

        write_json_atomic(args.json_out, report)
        print(f"wrote {args.json_out}")
    if args.plot:
        from controlplane.sim.report import write_plot

        write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _run(args: argparse.Namespace, fleet: Any, policies: Any, trace: Any,
         stop: threading.Event) -> dict[str, Any] | None:
    import ray

    from agents.embedded import EmbeddedS3, EmbeddedValkey
    from agents.ray_entry import NAMESPACE, node_resource

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        valkey = stack.enter_context(EmbeddedValkey())
        s3 = stack.enter_context(EmbeddedS3())
        ray.init(num_cpus=2, object_store_memory=80 * MIB, include_dashboard=False,
                 namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                 resources={node_resource(i): 1.0 for i in range(fleet.nodes)})
        stack.callback(ray.shutdown)
        results: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for policy in policies:
            if stop.is_set():
                return None
            summary, live = _run_policy(args, fleet, policy.name, trace, valkey, s3, stop)
            if summary is None:
                return None
            results[policy.name] = summary
            extra[policy.name] = live
    return _report(args, fleet, trace, results, extra, time.perf_counter() - started)


def _run_policy(args: argparse.Namespace, fleet: Any, policy: str, trace: Any, valkey: Any,
                s3: Any, stop: threading.Event) -> tuple[Any, Any]:
    import ray
    from tqdm import tqdm

    from agents.agent import AgentConfig, RemoteStoreConfig
    from agents.engine_emulator import EngineConfig, ServeRequest, ServeResult
    from agents.stores.local import LocalTierConfig
    from agents.stores.tiered import TieredStoreConfig
    from agents.transfer import TransferConfig
    from controlplane.live.client import connect
    from controlplane.live.ray_app import deploy, local_placements
    from controlplane.live.replay import Replayer
    from controlplane.live.service import ServiceConfig
    from controlplane.sim.metrics import summarize
    from controlplane.sim.simulator import PolicyRun

    run_id = f"{policy}-{uuid.uuid4().hex[:6]}"
    remote = RemoteStoreConfig(
        valkey=valkey.store_config(key_prefix=f"{run_id}:"),
        s3=s3.store_config(key_prefix=f"{run_id}/"),
        tiered=TieredStoreConfig(write_mode="write-back"))
    # The real tier holds the modelled DRAM tier at kv_scale, plus slack for headers: the
    # scheduler's books decide what stays; the tier's own LRU is only a backstop.
    tier_bytes = int(fleet.node.dram_tier_bytes * args.kv_scale * 1.25) + 16 * MIB
    dirs = [Path("/dev/shm") / f"kvp-demo-{run_id}-{i}" for i in range(fleet.nodes)]
    link_mib_s = link_rate_mib_s(fleet, args) if args.link_emulation else None
    # The node's ingress link at the modelled rate (what the simulator's link model does):
    # without it the loopback moves a scaled KV object in a fraction of the modelled time.
    transfer = (TransferConfig(bandwidth_limit_mib_s=link_mib_s, burst_bytes=16 * 1024)
                if link_mib_s is not None else TransferConfig())
    # Fresh LMCache servers per policy (their L1 must not carry over from the last run).
    stack = contextlib.ExitStack()
    servers = (_start_lmcache(args, fleet, remote, tier_bytes, link_mib_s, stack)
               if args.backend == "lmcache-mp" else [])
    agents, engines = [], []
    for i, d in enumerate(dirs):
        kv = {"dram": LocalTierConfig(path=str(d), capacity_bytes=tier_bytes)}
        agent_kv: dict[str, Any] = kv
        if servers:
            agent_kv, kv = _lmcache_configs(args, fleet, servers[i])
        agents.append(AgentConfig(node=i, node_name=f"gpu-{i}", remote=remote,
                                  transfer=transfer, backend=args.backend, **agent_kv))
        engines.append(EngineConfig(node=i, fleet=fleet, time_compression=args.compression,
                                    kv_scale=args.kv_scale, chunk_tokens=args.chunk_tokens,
                                    backend=args.backend, **kv))
    service = ServiceConfig(fleet=fleet, policy=policy, predictor=args.predictor,
                            time_compression=args.compression, chunk_tokens=args.chunk_tokens,
                            node_names=tuple(a.node_name for a in agents))
    try:
        deployment = deploy(service, agents, local_placements(fleet.nodes), engines=engines,
                            engine_remote=remote)
    except BaseException:
        stack.close()
        raise
    try:
        client = connect("auto", timeout_s=5.0)
        handles = deployment.engines

        def serve(node: int, req: ServeRequest) -> ServeResult:
            result: ServeResult = ray.get(handles[node].serve.remote(req))
            return result

        bar = tqdm(total=trace.requests, unit="req", desc=f"{policy:>10}",
                   disable=args.no_progress, mininterval=0.5)
        with bar:
            out = Replayer(trace, client, serve, compression=args.compression,
                           nodes=fleet.nodes, progress=bar.update, stop=stop).run()
        if stop.is_set():
            return None, None
        time.sleep(0.5)  # let the last reports land
        summ = ray.get(deployment.scheduler.summary.remote(), timeout=30)
        statuses = ray.get([a.status.remote() for a in deployment.agents], timeout=30)
    finally:
        deployment.shutdown()
        stack.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    run = PolicyRun(policy, records=out.records,
                    prefetched_bytes=summ["prefetch_model_bytes"],
                    wasted_bytes=summ["wasted_bytes_modelled"],
                    remote_bytes=summ["prefetch_model_bytes"] + summ["demand_model_bytes"],
                    prefetches=summ["prefetches"], prefetches_dropped=summ["prefetches_dropped"],
                    ttlb_s=summ["ttlb_s"], lateness_s=summ["lateness_s"], events=summ["events"])
    summary = summarize(run).to_dict()
    ok = [r for r in out.results if not r.error]
    live = {
        "link_mib_s": round(link_mib_s, 3) if link_mib_s is not None else None,
        # Control-plane time, wall milliseconds (not in the TTFT: see EngineEmulator.serve).
        "route_overhead_ms": _pcts([r.route_overhead_s * 1e3 for r in ok]),
        "gpu_overhead_ms": _pcts([r.gpu_overhead_s * 1e3 for r in ok]),
        "timeline_lag_ms": _pcts([r.lag_s * 1e3 for r in ok]),
        "real_bytes_moved": summ["prefetch_bytes"] + summ["demand_bytes"],
        "real_prefetch_bytes": summ["prefetch_bytes"],
        "real_demand_bytes": summ["demand_bytes"],
        "real_bytes_read_local": sum(r.read_bytes for r in out.results),
        "real_bytes_written": sum(r.written_bytes for r in out.results),
        "orders_sent": summ["orders_sent"], "orders_failed": summ["orders_failed"],
        "unrouted": out.unrouted, "failed_requests": out.failed,
        "replay_wall_s": round(out.wall_s, 2),
        "agents": [{"node": s.node, "keys": s.keys, "used_bytes": s.used_bytes,
                    "orders_done": s.orders_done, "bytes_moved": s.bytes_moved}
                   for s in statuses],
    }
    summary.update(live)
    return summary, live


def _start_lmcache(args: argparse.Namespace, fleet: Any, remote: Any, tier_bytes: int,
                   link_mib_s: float | None, stack: contextlib.ExitStack) -> list[Any]:
    """One real ``lmcache server`` per node: L1 the size of the agents' own tier, L2 our
    adapter over the run's Valkey + S3 (its loads at the node's link rate)."""
    from agents.lmcache.l2_adapter import plugin_adapter_json
    from agents.lmcache.server import LMCacheServer

    adapter = plugin_adapter_json(valkey=remote.valkey, s3=remote.s3, tiered=remote.tiered,
                                  load_bandwidth_mib_s=link_mib_s or 0.0)
    servers = []
    for i in range(fleet.nodes):
        server = LMCacheServer(l2_adapter=adapter, chunk_size=args.chunk_tokens,
                               l1_size_gb=tier_bytes / GIB, transfer_mode="engine_driven")
        servers.append(stack.enter_context(server))
        log.info("node %d: lmcache server %s", i, server.http_url)
    return servers


def _lmcache_configs(args: argparse.Namespace, fleet: Any, server: Any
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The agent's and the engine's settings for one node's LMCache server."""
    from agents.lmcache.backend import LMCacheBackendConfig
    from agents.lmcache.engine_kv import LMCacheEngineConfig

    engine = LMCacheEngineConfig(
        port=server.port, http_url=server.http_url, chunk_size=args.chunk_tokens,
        token_bytes=max(4, int(fleet.model.kv_bytes_per_token * args.kv_scale)))
    agent = LMCacheBackendConfig(
        http_url=server.http_url, model_name=engine.model_name, chunk_size=args.chunk_tokens,
        hash_algorithm=server.hash_algorithm,
        chunk_bytes=engine.layout().chunk_bytes(args.chunk_tokens))
    return {"lmcache": agent}, {"lmcache": engine}


def link_rate_mib_s(fleet: Any, args: argparse.Namespace) -> float:
    """The fleet model's remote-read rate per node (Valkey; the NIC if slower), in real
    MiB per wall second: modelled bytes/s x kv_scale x compression."""
    modelled = min(fleet.node.nic_bytes_per_s, fleet.remote.valkey_gbyte_s_per_node * 1e9)
    return float(modelled * args.kv_scale * args.compression / MIB)


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    xs = sorted(values)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    return {"mean": round(sum(xs) / len(xs), 2), "p50": round(q(0.5), 2),
            "p90": round(q(0.9), 2), "max": round(xs[-1], 2)}


def _report(args: argparse.Namespace, fleet: Any, trace: Any, results: dict[str, Any],
            extra: dict[str, Any], wall_s: float) -> dict[str, Any]:
    from controlplane.core.policies import parse_policies
    from controlplane.sim.metrics import gap_closure, working_set_peak_bytes
    from controlplane.sim.runner import SimOptions, run_policies

    ws = working_set_peak_bytes(trace, fleet.model.kv_bytes_per_token)
    sim = run_policies(trace, fleet, parse_policies(",".join(results)),
                       SimOptions(predictor=args.predictor, seed=args.seed))
    report: dict[str, Any] = {
        "meta": {
            "trace": trace.name, "trace_format": trace.source_format,
            "requests": trace.requests, "sessions": len(trace.sessions), "seed": args.seed,
            "scenario": "live-demo", "predictor": args.predictor, "model": fleet.model.name,
            "nodes": fleet.nodes, "working_set_peak_bytes": ws,
            "local_capacity_bytes": fleet.local_capacity_bytes,
            "pressure_ratio": round(ws / max(1, fleet.local_capacity_bytes), 3),
            "wall_s": round(wall_s, 3), "time_compression": args.compression,
            "kv_scale": args.kv_scale, "chunk_tokens": args.chunk_tokens,
            "link_emulation": args.link_emulation, "backend": args.backend,
        },
        "policies": results,
        "simulated": {name: {"returning": p.returning.to_dict(),
                             "ttft_mean_s": p.ttft_mean_s, "stall_s": p.stall_s}
                      for name, p in sim.policies.items()},
    }
    closure = gap_closure({name: p["returning"]["ttft_mean_s"] for name, p in results.items()})
    if closure is not None:
        report["gap_closure"] = closure
    return report


def _print(report: dict[str, Any]) -> None:
    meta = report["meta"]
    print(f"\nlive demo: {meta['requests']} requests of {meta['sessions']} sessions on "
          f"{meta['nodes']} emulated nodes ({meta['model']}), {meta['time_compression']:g}x "
          f"time compression, kv_scale {meta['kv_scale']:.6g}; pressure "
          f"{meta['pressure_ratio']:.2f}x")
    head = (f"{'policy':<11} {'ret':>5} {'ret mean':>9} {'ret p50':>8} {'ret p90':>8} "
            f"{'ret p99':>8} {'stall s':>8} {'TTLB s':>7} {'moved MiB':>10} "
            f"{'prefetch':>9} {'wasted':>7} {'sim mean':>9}")
    print("TTFT of returning requests in service seconds; real MiB moved by the agents; "
          "prefetch/wasted in modelled GiB")
    print(head)
    print("-" * len(head))
    for name, p in report["policies"].items():
        r = p["returning"]
        sim = report["simulated"].get(name, {}).get("returning", {}).get("ttft_mean_s", 0.0)
        print(f"{name:<11} {r['requests']:>5} {r['ttft_mean_s']:>9.3f} {r['ttft_p50_s']:>8.3f} "
              f"{r['ttft_p90_s']:>8.3f} {r['ttft_p99_s']:>8.3f} {p['stall_s']:>8.1f} "
              f"{p.get('ttlb_mean_s', 0.0):>7.3f} {p['real_bytes_moved'] / MIB:>10.1f} "
              f"{p['prefetched_bytes'] / GIB:>9.1f} {p['wasted_bytes'] / GIB:>7.1f} "
              f"{sim:>9.3f}")
    print("control-plane time per request, wall ms (measured, not in the TTFT above): "
          "route = gateway arrival -> engine; on-GPU = round trips while the GPU holds the "
          "request, beyond the transfer itself; lag = real run behind the GPU timeline")
    for name, p in report["policies"].items():
        ro, go, lag = p["route_overhead_ms"], p["gpu_overhead_ms"], p["timeline_lag_ms"]
        print(f"  {name:<11} route p50 {ro['p50']:.1f} p90 {ro['p90']:.1f} | on-GPU p50 "
              f"{go['p50']:.1f} p90 {go['p90']:.1f} | lag p90 {lag['p90']:.1f} max "
              f"{lag['max']:.1f}; demand orders {p['orders_sent'] - p['prefetches']}, "
              f"failed orders {p['orders_failed']}")
    pol = report["policies"]
    if "ondemand" in pol and "predictive" in pol:
        on, pr = pol["ondemand"]["returning"], pol["predictive"]["returning"]
        better = (pr["ttft_mean_s"] < on["ttft_mean_s"], pr["ttft_p90_s"] < on["ttft_p90_s"])
        verdict = "lower" if all(better) else "NOT lower (see the table)"
        print(f"predictive vs ondemand, returning TTFT mean and p90: {verdict}: mean "
              f"{on['ttft_mean_s']:.3f} -> {pr['ttft_mean_s']:.3f} s, p90 "
              f"{on['ttft_p90_s']:.3f} -> {pr['ttft_p90_s']:.3f} s")
    print(f"wall time {meta['wall_s']:.1f} s")
