"""``kvprefetch bench control-plane``: how many session events per second the scheduler
takes, how long a route waits, how long a planning step holds the scheduler, and how much
memory an idle session costs (logic in :mod:`kvprefetch.controlplane.harness.loadgen`)."""

from __future__ import annotations

import argparse
import logging
import sys

EPILOG = """\
modes:
  inproc   the pure scheduling core in this process (no service, no client); its
           planning step (due prefetch orders, the sweep) runs inline every
           planner.sweep_interval_s of service time
  service  SchedulerService in this process through the Python client
  http     the HTTP API as kvprefetch serve runs it (one scheduler actor on a local
           Ray runtime, the app on uvicorn in this process), driven from a separate
           process: at each --callers count that many async callers (persistent
           connections) loop route then request_finished on their own sessions; a row
           per count (the mode's own figures are the last count's); the server
           side's CPU per event (the actor's process and this one) is printed below
  http-batch  http with the load process queueing the finishes and sending them in
           batches of up to 64 (POST /v1/events, also every 5 ms and before a session
           with a queued finish is routed again); the routes one call each
  http-actor  http with the API served in the scheduler actor's own process
           (serve's http.front_end: scheduler): no Ray hop per call
  http-threaded  the http server calling the actor from its thread pool
  ray-1    one scheduler actor on a local Ray runtime (started here) through the
           Python client, fire-and-forget events batched: each request_finished is
           queued and rides with the next route's actor call (or the 5 ms flush
           timer); route stays synchronous; measuring ends when every queued event is
           answered (refused ones count as lost)
  ray-1-sync  the same, one synchronous actor call per event (no batching)
  ray-2, ray-4  2 or 4 scheduler shards (Ray actors), each owning the sessions that hash
           to it, with its quota of every node; the client sends each call to its owner
           (routes of one --concurrency batch: one actor call per shard, all at once)

How it runs: SESSIONS live sessions each play a trace session (cycled, so any number of
sessions can be made from a small trace) turn by turn. First every session plays its
first turn (populating; memory traced over it gives bytes per idle session where the
scheduler is in this process), then EVENTS events are measured: a random session plays
its next turn, route then request_finished, closed loop (the next call leaves when the
previous answered), the service clock running --speedup times the wall clock. With
--concurrency K, K distinct sessions play a turn at once (their routes together, then
their finishes); a route's latency is then its batch's. With --lanes L, L client threads
(a gateway's workers) each play their own share of the sessions in their own closed loop,
so up to L calls are in flight at once (the scheduler works on one while the others are
built); inproc always has one.

Reported per mode: events/s, route p50/p99 in ms (as the caller sees it), planning-step
p99 in ms, bytes per idle session (n/a through Ray: each shard actor's RSS before and
after is in shard_rss_mib instead), lost events (refused, timed out or failed calls); for
ray-N the ratio to ray-1 and, with --kill-shard, the restart time and each shard's route
p99 before and after the kill. Ray modes also report the CPU seconds each shard actor's
process and this one (the generator with its Ray driver) used while measuring, as cores
busy, and the events per shard-CPU-second: with the generator sharing the machine's
cores, what ray-N would give with a core per shard at the CPU cost per event measured
(its ratio to ray-1's is printed). JSON (--json, written atomically):
  {"modes": {"<mode>": {"events_per_s", "route_p50_ms", "route_p99_ms", "plan_p99_ms",
   "bytes_per_session", "lost_events", "shards", "shard_rss_mib", "kill", "cpu_s",
   "events_per_shard_cpu_s", ...}}, "sessions": N, ...}

examples:
  kvprefetch bench control-plane                       # ~1 min: inproc, service, ray-1
  kvprefetch bench control-plane --modes inproc --sessions 100000 --events 100000
  kvprefetch bench control-plane --trace kv-cache-tester/traces --json out/cp.json
  kvprefetch bench control-plane --modes ray-1,ray-2,ray-4 --concurrency 256 --speedup 1
  kvprefetch bench control-plane --modes ray-1,ray-2 --concurrency 128 --lanes 2 --speedup 1
  kvprefetch bench control-plane --modes ray-2 --concurrency 64 --kill-shard 1
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvprefetch bench control-plane``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--modes", default="inproc,service,ray-1",
                        help="comma-separated: inproc, service, http, http-batch, "
                        "http-actor, "
                        "http-threaded, ray-1, ray-1-sync, ray-2, ray-4 (default: inproc, "
                        "service, ray-1)")
    parser.add_argument("--sessions", type=int, default=2_000,
                        help="live sessions held while measuring (default 2,000)")
    parser.add_argument("--events", type=int, default=10_000,
                        help="events measured per mode after populating (default 10,000)")
    parser.add_argument("--trace", default=None,
                        help="trace whose sessions are replayed (default: the bundled "
                        "Claude Code slice)")
    parser.add_argument("--trace-format", default="auto")
    parser.add_argument("--nodes", type=int, default=4, help="GPU nodes (default 4)")
    parser.add_argument("--policy", default="predictive")
    parser.add_argument("--predictor", default="default")
    parser.add_argument("--speedup", type=float, default=100.0,
                        help="service seconds per wall second (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=1, metavar="K",
                        help="turns played at once while measuring: K sessions' routes go "
                             "together (one actor call per shard through Ray), as from a "
                             "gateway with K requests arriving at once (default 1: one "
                             "route call at a time)")
    parser.add_argument("--lanes", type=int, default=1, metavar="L",
                        help="client threads, each playing its own sessions, K turns at a "
                             "time (so K x L sessions in flight); inproc uses one "
                             "(default 1)")
    parser.add_argument("--kill-shard", type=int, default=None, metavar="I",
                        help="in the ray-N modes that have shard I: kill it halfway through "
                             "the measurement (Ray restarts it from its journal segment) "
                             "and report lost events, its restart time and each shard's "
                             "route p99 before and after")
    parser.add_argument("--callers", default="1,8,32,128", metavar="N,N,...",
                        help="http modes: concurrent callers of the load process, one "
                             "measurement of --events events per count (default "
                             "1,8,32,128)")
    parser.add_argument("--json", metavar="OUT", help="write the result as JSON (atomically)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table; write ``--json``. Returns the exit code."""
    from kvprefetch.controlplane.base.errors import ConfigError
    from kvprefetch.controlplane.cli.benchrun import run_bench
    from kvprefetch.controlplane.harness.loadgen import (
        HTTP_MODES,
        MODES,
        LoadSpec,
        format_table,
        run_mode,
    )
    from kvprefetch.controlplane.traces import bundled_trace_path, load_trace

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        print(f"bench control-plane: unknown mode(s) {unknown or modes}; known: "
              f"{', '.join(MODES)}", file=sys.stderr)
        return 2
    try:
        try:
            callers = tuple(int(c) for c in args.callers.split(",") if c.strip())
        except ValueError:
            raise ConfigError(f"--callers: expected counts like 1,8,32, got "
                              f"{args.callers!r}") from None
        spec = LoadSpec(sessions=args.sessions, events=args.events, nodes=args.nodes,
                        policy=args.policy, predictor=args.predictor,
                        time_compression=args.speedup, seed=args.seed,
                        concurrency=args.concurrency, lanes=args.lanes,
                        kill_shard=args.kill_shard, callers=callers)
        if any(m in HTTP_MODES for m in modes):
            spec.check_http()
    except ConfigError as exc:
        print(f"bench control-plane: {exc}", file=sys.stderr)
        return 2
    path = args.trace or bundled_trace_path("claude-code")
    trace = load_trace(path, args.trace_format, seed=args.seed)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per call in http mode
    # Progress in units of 1,000 events (populating counts its route and finish too).
    steps_per_mode = (2 * spec.sessions + spec.events) // 1000

    def work(step: object) -> dict[str, object]:
        from tqdm import tqdm

        result: dict[str, object] = {
            "sessions": spec.sessions, "events": spec.events, "trace": trace.name,
            "nodes": spec.nodes, "policy": spec.policy, "speedup": spec.time_compression,
            "concurrency": spec.concurrency, "lanes": spec.lanes,
            "callers": list(spec.callers), "modes": {},
        }
        modes_out: dict[str, object] = {}
        bar = tqdm(total=steps_per_mode * len(modes), unit="k events", file=sys.stderr,
                   disable=args.no_progress, desc="bench control-plane")
        with bar:
            for mode in modes:
                bar.set_postfix_str(mode)
                modes_out[mode] = run_mode(
                    mode, trace, spec, progress=lambda n: bar.update(n / 1000)).to_json()
        result["modes"] = modes_out
        return result

    out = run_bench("bench control-plane", 0, work, format_table, json_out=args.json,
                    progress=False)
    return 0 if out is not None else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvprefetch bench control-plane")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
