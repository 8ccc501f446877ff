"""``kvprefetch bench lmcache``: our L2 adapter against LMCache's own ``valkey`` and ``s3``
adapters, each measured by LMCache's benchmark (``lmcache bench l2 --no-skip-verify``) with
the same sizes, against the same real servers on loopback.

* ``kvprefetch``: :class:`~agents.lmcache.l2_adapter.KvPrefetchL2Adapter` over Valkey in
  front of S3 (write-through by default: a store returns once S3 and Valkey both hold the
  chunk; loads come from Valkey, received straight into LMCache's memory objects).
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

from agents.embedded import EmbeddedS3, EmbeddedValkey
from agents.lmcache.server import find_lmcache
from agents.stores.errors import StoreConfigError, StoreError

log = logging.getLogger(__name__)
MIB = 1 << 20
AdapterName = Literal["kvprefetch", "lmcache-valkey", "lmcache-s3", "kvprefetch-valkey"]
#: Run by default; ``kvprefetch-valkey`` (our adapter on Valkey alone, LMCache-valkey's scope
#: for stores too) on request.
ADAPTERS: tuple[AdapterName, ...] = ("kvprefetch", "lmcache-valkey", "lmcache-s3")
#: LMCache's s3 adapter bucket: the first label of ``127.0.0.1`` (see the module docstring).
VIRTUAL_HOST_BUCKET = "127"
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
    #: Runs of every adapter; the order rotates each repeat and figures are medians.
    repeats: int = Field(5, ge=1)
    adapters: tuple[AdapterName, ...] = ADAPTERS
    #: Our adapter's write policy (the store figure includes S3 only in write-through).
    write_mode: Literal["write-through", "write-back"] = "write-through"
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
                  write_mode: str = "write-through") -> dict[str, Any]:
    """The ``--l2-adapter`` JSON of one adapter against the bench's servers."""
    if adapter == "kvprefetch":
        from agents.lmcache.l2_adapter import plugin_adapter_json

        return plugin_adapter_json(
            valkey=valkey.store_config(key_prefix="kvp:"),
            s3=s3.store_config(key_prefix="kvp/"),
            tiered={"write_mode": write_mode},
        )
    if adapter == "kvprefetch-valkey":
        from agents.lmcache.l2_adapter import plugin_adapter_json

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
    import agents

    root = str(Path(agents.__file__).resolve().parent.parent)
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="kvp-lmcache-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            find_lmcache(), "bench", "l2", "--l2-adapter", json.dumps(spec),
            "--data-size-kb", str(cfg.data_size_kb), "--num-keys", str(cfg.num_keys),
            "--rounds", str(cfg.rounds), "--warmup-rounds", str(cfg.warmup_rounds),
            "--no-skip-verify", "--format", "json", "--output", str(out),
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
        "store_keys_ok": int(store["total_success"]),
        "load_keys_ok": int(load["total_success"]),
        "keys": int(load["total_keys"]),
        "verified": verified,
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
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
    return {
        "store_mib_s": round(median(r["store_mib_s"] for r in runs), 1),
        "load_mib_s": round(median(r["load_mib_s"] for r in runs), 1),
        "lookup_ms": round(median(r["lookup_ms"] for r in runs), 2),
        "verified": all(r["verified"] for r in runs),
        "best_load_mib_s": round(max(r["load_mib_s"] for r in runs), 1),
        "runs": runs,
    }


def bench_steps(config: LMCacheBenchConfig) -> int:
    """How many times ``on_step`` is called (for a progress bar)."""
    return 1 + config.repeats * (len(config.adapters) + int(config.raw_get_loop))


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
        for repeat in range(cfg.repeats):
            order = list(cfg.adapters[repeat % len(cfg.adapters):]
                         + cfg.adapters[: repeat % len(cfg.adapters)])
            for adapter in order:
                figures = run_lmcache_bench_l2(specs[adapter], cfg)
                figures["repeat"] = repeat
                runs[adapter].append(figures)
                step(f"{adapter} {figures['load_mib_s']:.0f} MiB/s")
            if raw is not None:
                raw_runs.append(raw.run())
                step(f"raw {raw_runs[-1]:.0f} MiB/s")
        load_after = os.getloadavg()
    adapters = {a: _summary(r) for a, r in runs.items()}
    result: dict[str, Any] = {
        "adapters": adapters,
        "config": cfg.model_dump(),
        "data_size_bytes": cfg.data_size_kb * 1024,
        "statistic": f"median of {cfg.repeats} interleaved runs per adapter (MiB/s = "
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
    return result


def format_table(result: dict[str, Any]) -> str:
    """The result as a plain-text table."""
    cfg = result["config"]
    load = result.get("load_avg_1m", [])
    lines = [
        f"{cfg['num_keys']} keys x {cfg['data_size_kb']} KiB per task, {cfg['rounds']} rounds "
        f"(+{cfg['warmup_rounds']} warm-up) per run; {result['statistic']}; load "
        f"{'/'.join(f'{x:.2f}' for x in load)} on {result.get('cpus', '?')} CPUs",
        f"{'adapter':<16}{'store MiB/s':>12}{'load MiB/s':>12}{'best load':>11}"
        f"{'lookup ms':>11}{'verified':>10}",
    ]
    for name, row in result["adapters"].items():
        lines.append(
            f"{name:<16}{row['store_mib_s']:>12.0f}{row['load_mib_s']:>12.0f}"
            f"{row['best_load_mib_s']:>11.0f}{row['lookup_ms']:>11.2f}"
            f"{'yes' if row['verified'] else 'NO':>10}")
    if "raw_get_loop_mib_s" in result:
        lines.append(f"{'raw GET loop':<16}{'':>12}{result['raw_get_loop_mib_s']:>12.0f}")
    for mine, label in (("kvprefetch", ""), ("kvprefetch-valkey", "kvprefetch_valkey_")):
        for tag in ("valkey", "s3"):
            key = f"{label}speedup_vs_lmcache_{tag}"
            if key in result:
                lines.append(f"{mine} load speedup vs lmcache-{tag}: {result[key]:.2f}x "
                             f"(paired {result[key + '_paired']:.2f}x)")
    if "kvprefetch" in result["adapters"]:
        lines.append(f"kvprefetch: {result['kvprefetch_mode']}")
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
