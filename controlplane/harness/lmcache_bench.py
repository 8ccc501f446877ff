"""``kvprefetch bench lmcache``: our L2 adapter against LMCache's own ``valkey`` and ``s3``
adapters, each measured by LMCache's benchmark (``lmcache bench l2 --no-skip-verify``) with
the same sizes, against the same real servers on loopback.

* ``kvprefetch``: :class:`~kvprefetch.agents.lmcache.l2.adapter.KvPrefetchL2Adapter` over Valkey in
  front of S3 (write-back by default: a store returns once Valkey holds the chunk and the
  upload journal names it, S3 follows in the background; ``--write-mode write-through``
  waits for S3 too; loads come from Valkey, received straight into LMCache's memory
  objects). In write-back the adapter is told not to wait for its uploads at exit, so what
  the run left is measured after it: the backlog at exit, the time a restarted adapter (a
  new one over the same Valkey journal) takes to drain it, and then -- with our Valkey keys
  flushed -- every key the run stored is read back from S3 alone and compared byte for
  byte with the pattern LMCache's benchmark wrote.
* ``kvprefetch-valkey`` (on request): the same adapter on Valkey alone.
* ``lmcache-valkey``: LMCache's adapter on the GLIDE client (8 workers, buffer GETs).
* ``lmcache-s3``: LMCache's adapter on the AWS CRT client. It only speaks virtual-hosted
  addressing (the bucket is part of the Host name) and there is no DNS here for
  ``bucket.localhost``, so SeaweedFS is started with ``-s3.domainName=0.0.1``: the Host
  ``127.0.0.1`` then reads as bucket ``127`` on domain ``0.0.1`` -- virtual-hosted
  addressing without DNS -- while boto3 (our S3 tier) addresses the same server
  path-style through ``localhost``.
* raw: one valkey-py client reading values of the same size with a plain single-connection
  GET loop (what a simple connector does; no adapter around it).

Each adapter runs in its own ``lmcache bench l2`` process (LMCache's store, lookup and load
rounds, then a byte-for-byte check of the last round). This machine is noisy (two cores
shared with the servers and with whatever else runs), so the benchmark repeats the set,
rotating the order every repeat, and reports medians; the speedup is our median load
throughput over LMCache-valkey's, and the paired figure the median of the per-repeat ratios.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from statistics import median
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.lmcache.server import find_lmcache
from kvprefetch.agents.stores.errors import StoreConfigError, StoreError
from kvprefetch.agents.stores.s3.store import S3StoreConfig

log = logging.getLogger(__name__)
MIB = 1 << 20
AdapterName = Literal["kvprefetch", "lmcache-valkey", "lmcache-s3", "kvprefetch-valkey"]
#: Run by default; ``kvprefetch-valkey`` (our adapter on Valkey alone, LMCache-valkey's scope
#: for stores too) on request.
ADAPTERS: tuple[AdapterName, ...] = ("kvprefetch", "lmcache-valkey", "lmcache-s3")
#: LMCache's s3 adapter bucket: the first label of ``127.0.0.1`` (see the module docstring).
VIRTUAL_HOST_BUCKET = "127"
OUR_VALKEY_PREFIX = "kvp:"
OUR_S3_PREFIX = "kvp/"
_VERIFIED = re.compile(r"\[Verify\] All (\d+) keys data verified OK")


class LMCacheBenchConfig(BaseModel):
    """What ``kvprefetch bench lmcache`` measures."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Bytes per key (one LMCache chunk): 4 MiB by default.
    data_size_kb: int = Field(4096, ge=1)
    #: Keys per submitted task (``lmcache bench l2 --num-keys``).
    num_keys: int = Field(32, ge=1)
    #: Measured rounds per run, after ``warmup_rounds``; each round is one task of
    #: ``num_keys`` keys (store, lookup, load).
    rounds: int = Field(3, ge=1)
    warmup_rounds: int = Field(1, ge=0)
    #: Runs of every adapter; the order rotates each repeat and figures are medians. Even,
    #: so that with two adapters each runs second as often as first (the later run of a
    #: pair was the faster one in 4 of 5 pairs: the server's memory warms up).
    repeats: int = Field(6, ge=1)
    #: Runs of every adapter before the measured ones, not counted: a fresh Valkey stores
    #: its first hundreds of MiB at a third of its later speed (first-touch pages), whoever
    #: writes them.
    warmup_runs: int = Field(1, ge=0)
    adapters: tuple[AdapterName, ...] = ADAPTERS
    #: Our adapter's write policy (the store figure includes S3 only in write-through).
    write_mode: Literal["write-through", "write-back"] = "write-back"
    #: ``lmcache bench l2 --lookup-max-hit-rate``: the share of looked-up keys that were
    #: stored (LMCache's default, 0, looks up keys never stored).
    lookup_hit_rate: float = Field(0.0, ge=0, le=1)
    #: How long a restarted adapter may take to drain the write-back backlog.
    drain_timeout_s: float = Field(300.0, gt=0)
    #: Also time a plain single-connection valkey-py GET loop over values of the same size.
    raw_get_loop: bool = True
    #: Per ``lmcache bench l2`` run.
    run_timeout_s: float = Field(900.0, gt=0)


class _VirtualHostS3(EmbeddedS3):
    """SeaweedFS that also answers virtual-hosted requests addressed to ``127.0.0.1``
    (bucket :data:`VIRTUAL_HOST_BUCKET`), for LMCache's s3 adapter. Clients that use
    path-style addressing (boto3, our S3 tier) go through ``localhost``."""

    def __init__(self) -> None:
        # Host 127.0.0.1 under the S3 domain "0.0.1" reads as bucket "127".
        super().__init__(backend="seaweedfs", bucket="kvprefetch",
                         extra_buckets=(VIRTUAL_HOST_BUCKET,),
                         weed_args=("-s3.domainName=0.0.1",))

    @property
    def endpoint_url(self) -> str:
        return f"http://localhost:{self.port}"

    @property
    def virtual_host_endpoint(self) -> str:
        """LMCache's ``s3_endpoint`` (``<bucket>.<domain>`` with its port)."""
        return f"{self.host}:{self.port}"


def adapter_specs(adapter: AdapterName, valkey: EmbeddedValkey, s3: _VirtualHostS3,
                  write_mode: str = "write-back") -> dict[str, Any]:
    """The ``--l2-adapter`` JSON of one adapter against the bench's servers."""
    if adapter == "kvprefetch":
        from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json

        return plugin_adapter_json(
            valkey=valkey.store_config(key_prefix=OUR_VALKEY_PREFIX),
            s3=s3.store_config(key_prefix=OUR_S3_PREFIX),
            tiered={"write_mode": write_mode},
            # Leave the backlog to the journal at exit: the bench drains it by a restart.
            write_back={"close_drain_s": 0},
        )
    if adapter == "kvprefetch-valkey":
        from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json

        return plugin_adapter_json(valkey=valkey.store_config(key_prefix="kvpv:"))
    if adapter == "lmcache-valkey":
        spec: dict[str, Any] = {"type": "valkey", "startup_nodes": f"{valkey.host}:{valkey.port}"}
        if valkey.password:
            spec["password"] = valkey.password
        return spec
    return {
        "type": "s3", "s3_endpoint": s3.virtual_host_endpoint, "s3_region": "us-east-1",
        "disable_tls": True, "s3_prefer_http2": False,
        "aws_access_key_id": s3.access_key_id, "aws_secret_access_key": s3.secret_access_key,
    }


def _op(metrics: dict[str, Any], operation: str) -> dict[str, Any]:
    for section in metrics.values():
        if isinstance(section, dict) and section.get("operation") == operation:
            return section
    raise StoreError(f"lmcache bench l2 reported no {operation} figures")


def run_lmcache_bench_l2(spec: dict[str, Any], cfg: LMCacheBenchConfig) -> dict[str, Any]:
    """One ``lmcache bench l2 --no-skip-verify`` run; its store / load figures (MiB/s, as
    LMCache computes them: bytes / 2^20 / round time, averaged over the measured rounds)
    and whether every key loaded and verified byte for byte."""
    import kvprefetch.agents

    # the folder that holds the kvprefetch package (a path entry for LMCache's process)
    root = str(Path(kvprefetch.agents.__file__).parents[2])
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="kvp-lmcache-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            find_lmcache(), "bench", "l2", "--l2-adapter", json.dumps(spec),
            "--data-size-kb", str(cfg.data_size_kb), "--num-keys", str(cfg.num_keys),
            "--rounds", str(cfg.rounds), "--warmup-rounds", str(cfg.warmup_rounds),
            "--no-skip-verify", "--format", "json", "--output", str(out),
            "--lookup-max-hit-rate", str(cfg.lookup_hit_rate),
        ]
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp,
                                  timeout=cfg.run_timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise StoreError(f"lmcache bench l2 ran over {cfg.run_timeout_s} s") from exc
        wall = time.monotonic() - started
        if not out.is_file():
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise StoreError(f"lmcache bench l2 exited with {proc.returncode}: {tail}")
        metrics = json.loads(out.read_text())["metrics"]
    store, load = _op(metrics, "Store"), _op(metrics, "Load")
    lookup = _op(metrics, "Lookup")
    m = _VERIFIED.search(proc.stdout)
    verified = (proc.returncode == 0 and m is not None
                and int(m.group(1)) == cfg.num_keys
                and load["total_success"] == load["total_keys"]
                and store["total_success"] == store["total_keys"])
    if not verified:
        log.warning("lmcache bench l2 did not verify (exit %d): %s", proc.returncode,
                    (proc.stdout + proc.stderr)[-2000:])
    return {
        "store_mib_s": float(store["throughput_avg_mbps"]),
        "load_mib_s": float(load["throughput_avg_mbps"]),
        "lookup_ms": float(lookup["duration_avg_ms"]),
        "lookup_p99_ms": float(lookup["duration_p99_ms"]),
        "store_keys_ok": int(store["total_success"]),
        "load_keys_ok": int(load["total_success"]),
        "keys": int(load["total_keys"]),
        "verified": verified,
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
    }


def drain_and_verify_from_s3(spec: dict[str, Any], valkey: EmbeddedValkey,
                             cfg: LMCacheBenchConfig, *, flush: bool) -> dict[str, Any]:
    """After a write-back run of our adapter: the backlog it left in the journal, the time
    a restarted adapter over the same state takes to drain it, and every key the run stored
    read back from S3 alone (our S3 tier by itself, Valkey not consulted), byte for byte.

    ``flush`` also deletes every key of ours from Valkey first (journal included). The
    benchmark flushes after its last run only: Valkey refilling freed memory would slow the
    next runs' stores, a cost the other adapters' runs would not pay."""
    import valkey as valkey_py
    from lmcache.cli.commands.bench.l2_adapter_bench.data import make_object_keys

    from kvprefetch.agents.lmcache.l2.adapter import KvPrefetchL2Adapter, object_key_name
    from kvprefetch.agents.stores.s3.store import S3Store
    from kvprefetch.agents.stores.write_back import journal_backlog

    params = spec["adapter_params"]
    journal = OUR_VALKEY_PREFIX + "wb:pending"
    client = valkey_py.Valkey(host=valkey.host, port=valkey.port, password=valkey.password)
    try:
        left_keys, left_bytes = journal_backlog(client, journal)
        started = time.monotonic()
        adapter = KvPrefetchL2Adapter(params)  # the restart: re-queues the journal
        try:
            drained = adapter.drain_uploads(cfg.drain_timeout_s)
            drain_s = time.monotonic() - started
            stats = adapter.write_back_stats()
        finally:
            adapter.close()
        flushed = 0
        if flush:
            for name in client.scan_iter(match=f"{OUR_VALKEY_PREFIX}*", count=1000):
                flushed += int(client.delete(name))  # type: ignore[arg-type]
    finally:
        client.close()
    size = cfg.data_size_kb * 1024
    keys = [k for r in range(cfg.warmup_rounds + cfg.rounds)
            for k in make_object_keys(cfg.num_keys, key_offset=r * cfg.num_keys)]
    prefix = params.get("key_prefix", "lmcache/")
    s3 = S3Store(S3StoreConfig.model_validate(params["s3"]), name="s3-alone")
    s3.start()
    good = 0
    try:
        names = [prefix + object_key_name(k) for k in keys]
        for start in range(0, len(names), 8):
            for j, r in enumerate(s3.get(names[start : start + 8])):
                i = start + j
                want = bytes([(i % cfg.num_keys) & 0xFF]) * size  # LMCache's fill pattern
                good += int(r.ok and r.data is not None and bytes(r.data) == want)
    finally:
        s3.close()
    return {
        "backlog_at_exit_keys": left_keys,
        "backlog_at_exit_mib": round(left_bytes / MIB, 1),
        "drained": drained,
        "drain_s": round(drain_s, 2),
        "requeued_on_restart": stats.requeued_on_start if stats else 0,
        "lost_keys": stats.lost_keys if stats else 0,
        "valkey_flushed": flush,
        "valkey_keys_flushed": flushed,
        "s3_alone_keys_ok": good,
        "s3_alone_keys": len(keys),
        "s3_alone_verified": drained and good == len(keys),
    }


class _RawLoop:
    """A plain single-connection valkey-py GET loop over ``num_keys`` values."""

    def __init__(self, valkey: EmbeddedValkey, cfg: LMCacheBenchConfig) -> None:
        import valkey as valkey_py

        self.size = cfg.data_size_kb * 1024
        self.names = [f"raw-get-loop/{i}" for i in range(cfg.num_keys)]
        self.client = valkey_py.Valkey(host=valkey.host, port=valkey.port,
                                       password=valkey.password)
        value = os.urandom(self.size)
        for name in self.names:
            self.client.set(name, value)
        back: list[Any] = [self.client.get(n) for n in self.names]
        if any(len(v or b"") != self.size for v in back):
            raise StoreError("raw GET loop: values did not read back whole")

    def run(self) -> float:
        started = time.perf_counter()
        for name in self.names:
            self.client.get(name)
        return len(self.names) * self.size / MIB / (time.perf_counter() - started)

    def close(self) -> None:
        self.client.delete(*self.names)
        self.client.close()


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {
        "store_mib_s": round(median(r["store_mib_s"] for r in runs), 1),
        "load_mib_s": round(median(r["load_mib_s"] for r in runs), 1),
        "lookup_ms": round(median(r["lookup_ms"] for r in runs), 2),
        # Per run LMCache's p99 (nearest rank) of its few rounds is their maximum, so the
        # largest of the runs' is the p99 over every measured round.
        "lookup_p99_ms": round(max(r["lookup_p99_ms"] for r in runs), 2),
        "verified": all(r["verified"] for r in runs),
        "best_load_mib_s": round(max(r["load_mib_s"] for r in runs), 1),
        "runs": runs,
    }
    drains = [r["write_back"] for r in runs if "write_back" in r]
    if drains:
        out["write_back"] = {
            "backlog_at_exit_mib": round(median(d["backlog_at_exit_mib"] for d in drains), 1),
            "drain_s": round(median(d["drain_s"] for d in drains), 2),
            "drain_s_max": max(d["drain_s"] for d in drains),
            "lost_keys": sum(d["lost_keys"] for d in drains),
            "s3_alone_keys_ok": sum(d["s3_alone_keys_ok"] for d in drains),
            "s3_alone_keys": sum(d["s3_alone_keys"] for d in drains),
            "s3_alone_verified": all(d["s3_alone_verified"] for d in drains),
        }
        out["verified"] = out["verified"] and out["write_back"]["s3_alone_verified"]
    return out


def bench_steps(config: LMCacheBenchConfig) -> int:
    """How many times ``on_step`` is called (for a progress bar)."""
    final = int("kvprefetch" in config.adapters and config.write_mode == "write-back")
    return 1 + final + config.warmup_runs * len(config.adapters) + config.repeats * (
        len(config.adapters) + int(config.raw_get_loop))


def run_lmcache_bench(config: LMCacheBenchConfig,
                      on_step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start Valkey and S3, run every adapter ``repeats`` times (order rotating), return
    the JSON-ready result (see the module docstring)."""
    step = on_step or (lambda _label: None)
    cfg = config
    if not cfg.adapters:
        raise StoreConfigError("no adapters to benchmark")
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in cfg.adapters}
    raw_runs: list[float] = []
    with ExitStack() as stack:
        valkey = stack.enter_context(EmbeddedValkey())
        s3 = _VirtualHostS3()
        stack.enter_context(s3)
        specs = {a: adapter_specs(a, valkey, s3, cfg.write_mode) for a in cfg.adapters}
        raw = _RawLoop(valkey, cfg) if cfg.raw_get_loop else None
        if raw is not None:
            stack.callback(raw.close)
        step("servers up")
        load_before = os.getloadavg()
        warmup: dict[str, list[dict[str, Any]]] = {a: [] for a in cfg.adapters}
        for repeat in range(-cfg.warmup_runs, cfg.repeats):
            shift = repeat % len(cfg.adapters)
            order = list(cfg.adapters[shift:] + cfg.adapters[:shift])
            for adapter in order:
                figures = run_lmcache_bench_l2(specs[adapter], cfg)
                figures["repeat"] = repeat
                if adapter == "kvprefetch" and cfg.write_mode == "write-back":
                    figures["write_back"] = drain_and_verify_from_s3(
                        specs[adapter], valkey, cfg, flush=False)
                (runs if repeat >= 0 else warmup)[adapter].append(figures)
                step(f"{adapter} {figures['load_mib_s']:.0f} MiB/s"
                     + (" (warm-up)" if repeat < 0 else ""))
            if raw is not None and repeat >= 0:
                raw_runs.append(raw.run())
                step(f"raw {raw_runs[-1]:.0f} MiB/s")
        load_after = os.getloadavg()
        final_check = None
        if "kvprefetch" in specs and cfg.write_mode == "write-back":
            # Last: our Valkey keys flushed, every key read back from S3 alone again.
            final_check = drain_and_verify_from_s3(specs["kvprefetch"], valkey, cfg,
                                                   flush=True)
            step("S3 alone, Valkey flushed: "
                 f"{final_check['s3_alone_keys_ok']}/{final_check['s3_alone_keys']}")
    adapters = {a: _summary(r) for a, r in runs.items()}
    for a, w in warmup.items():  # reported, never in the figures
        adapters[a]["warmup_runs"] = w
        adapters[a]["verified"] = adapters[a]["verified"] and all(r["verified"] for r in w)
    if final_check is not None:
        wb = adapters["kvprefetch"]["write_back"]
        wb["after_valkey_flush"] = final_check
        wb["s3_alone_verified"] = wb["s3_alone_verified"] and final_check["s3_alone_verified"]
        adapters["kvprefetch"]["verified"] = (adapters["kvprefetch"]["verified"]
                                              and final_check["s3_alone_verified"])
    result: dict[str, Any] = {
        "adapters": adapters,
        "config": cfg.model_dump(),
        "data_size_bytes": cfg.data_size_kb * 1024,
        "statistic": f"median of {cfg.repeats} interleaved runs per adapter, after "
                     f"{cfg.warmup_runs} uncounted (MiB/s = "
                     "LMCache's figure: bytes / 2^20 / round time)",
        "kvprefetch_mode": f"valkey+s3 {cfg.write_mode}",
        "load_avg_1m": [round(load_before[0], 2), round(load_after[0], 2)],
        "cpus": os.cpu_count(),
        "verified": all(s["verified"] for s in adapters.values()),
    }
    if raw_runs:
        result["raw_get_loop_mib_s"] = round(median(raw_runs), 1)
        result["raw_get_loop_runs_mib_s"] = [round(x, 1) for x in raw_runs]
    for mine, label in (("kvprefetch", ""), ("kvprefetch-valkey", "kvprefetch_valkey_")):
        ours = runs.get(mine)
        for other in ("lmcache-valkey", "lmcache-s3"):
            theirs = runs.get(other)
            if not ours or not theirs:
                continue
            key = f"{label}speedup_vs_lmcache_{other.removeprefix('lmcache-')}"
            result[key] = round(adapters[mine]["load_mib_s"] / adapters[other]["load_mib_s"], 3)
            result[f"{key}_paired"] = round(median(
                a["load_mib_s"] / b["load_mib_s"] for a, b in zip(ours, theirs, strict=True)), 3)
    mine_row, theirs_row = adapters.get("kvprefetch"), adapters.get("lmcache-valkey")
    if mine_row and theirs_row:  # the targets: lookup <= 1.2x, store >= 1.0x
        result["lookup_ratio_vs_lmcache_valkey"] = round(
            mine_row["lookup_ms"] / max(theirs_row["lookup_ms"], 1e-9), 3)
        result["store_ratio_vs_lmcache_valkey"] = round(
            mine_row["store_mib_s"] / max(theirs_row["store_mib_s"], 1e-9), 3)
    return result


def format_table(result: dict[str, Any]) -> str:
    """The result as a plain-text table."""
    cfg = result["config"]
    load = result.get("load_avg_1m", [])
    lines = [
        f"{cfg['num_keys']} keys x {cfg['data_size_kb']} KiB per task, {cfg['rounds']} rounds "
        f"(+{cfg['warmup_rounds']} warm-up) per run; {result['statistic']}; load "
        f"{'/'.join(f'{x:.2f}' for x in load)} on {result.get('cpus', '?')} CPUs",
        f"{'adapter':<18}{'store MiB/s':>12}{'load MiB/s':>12}{'best load':>11}"
        f"{'lookup ms':>11}{'lookup p99':>11}{'verified':>10}",
    ]
    for name, row in result["adapters"].items():
        lines.append(
            f"{name:<18}{row['store_mib_s']:>12.0f}{row['load_mib_s']:>12.0f}"
            f"{row['best_load_mib_s']:>11.0f}{row['lookup_ms']:>11.2f}"
            f"{row.get('lookup_p99_ms', 0.0):>11.2f}{'yes' if row['verified'] else 'NO':>10}")
    if "raw_get_loop_mib_s" in result:
        lines.append(f"{'raw GET loop':<16}{'':>12}{result['raw_get_loop_mib_s']:>12.0f}")
    for mine, label in (("kvprefetch", ""), ("kvprefetch-valkey", "kvprefetch_valkey_")):
        for tag in ("valkey", "s3"):
            key = f"{label}speedup_vs_lmcache_{tag}"
            if key in result:
                lines.append(f"{mine} load speedup vs lmcache-{tag}: {result[key]:.2f}x "
                             f"(paired {result[key + '_paired']:.2f}x)")
    if "lookup_ratio_vs_lmcache_valkey" in result:
        lookup_x = result["lookup_ratio_vs_lmcache_valkey"]
        store_x = result["store_ratio_vs_lmcache_valkey"]
        lines.append(f"kvprefetch vs lmcache-valkey: lookup {lookup_x:.2f}x the time, store "
                     f"{store_x:.2f}x the throughput")
    if "kvprefetch" in result["adapters"]:
        lines.append(f"kvprefetch: {result['kvprefetch_mode']}")
        wb = result["adapters"]["kvprefetch"].get("write_back")
        if wb:
            lines.append(
                f"kvprefetch write-back: backlog at exit {wb['backlog_at_exit_mib']:.0f} MiB "
                f"(median), drained by a restarted adapter in {wb['drain_s']:.2f} s (median, "
                f"max {wb['drain_s_max']:.2f}); {wb['lost_keys']} lost; "
                f"{wb['s3_alone_keys_ok']}/{wb['s3_alone_keys']} keys read back from S3 "
                "alone byte for byte after each run")
            final = wb.get("after_valkey_flush")
            if final:
                lines.append(
                    f"  at the end, Valkey flushed ({final['valkey_keys_flushed']} keys of "
                    f"ours): {final['s3_alone_keys_ok']}/{final['s3_alone_keys']} keys read "
                    "back from S3 alone byte for byte")
    return "\n".join(lines)


__all__ = [
    "ADAPTERS",
    "LMCacheBenchConfig",
    "adapter_specs",
    "bench_steps",
    "format_table",
    "run_lmcache_bench",
    "run_lmcache_bench_l2",
]
