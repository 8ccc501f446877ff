"""A scheduler with its HTTP API in a process of its own, for tests that measure the
server (its memory, its latency to other callers): ``python edge_server.py LIMITS_JSON``
prints ``URL <url>`` once it listens and serves until its stdin closes. Two tenants,
``acme`` and ``globex``, with the tokens of :data:`TOKENS`."""

from __future__ import annotations

import json
import sys

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.live.http_api import HttpServer, create_app
from kvprefetch.controlplane.live.limits import RequestLimits
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig
from kvprefetch.controlplane.live.tenants import TenantAuth

TOKENS = {"acme": "acme-token-0123456789", "globex": "globex-token-0123456789"}
GIB = 1 << 30


def main() -> None:
    limits = RequestLimits.model_validate(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    fleet = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 2 * GIB,
                                                  "dram_tier_bytes": 16 * GIB}})
    svc = SchedulerService(ServiceConfig(fleet=fleet, tenants=tuple(TOKENS),
                                         limits=limits)).start()
    try:
        app = create_app(svc, auth=TenantAuth(TOKENS), limits=limits)
        with HttpServer(app) as server:
            print(f"URL {server.url}", flush=True)
            sys.stdin.read()  # until the test closes it
    finally:
        svc.close()


if __name__ == "__main__":
    main()
