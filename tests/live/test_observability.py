"""What a user scrapes and what the shipped dashboard and alert rules read.

The exported names come from the real components: the scheduler service with its HTTP API
(``GET /metrics`` on loopback: the scheduler's registry, the tenants' share counters and
the API's own) and the OpenAI-compatible gateway's registry. The agents export no registry
of their own: what their transfers do is counted by the scheduler
(``kvprefetch_transfer_bytes_total``, ``kvprefetch_ttlb_seconds``,
``kvprefetch_orders_failed_total``). Checked: every PromQL query in
examples/grafana-dashboard.json and examples/prometheus-alerts.yaml names only exported
series; every name has the one prefix; running totals are counters (``_total``); and a
gateway in front of a stand-in engine on loopback, routed by a real scheduler, counts a
session's second turn as a returning one in its TTFT histogram.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
yaml = pytest.importorskip("yaml")

from fastapi import FastAPI, Request  # noqa: E402  (module level: annotations are strings)
from fastapi.responses import StreamingResponse  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvprefetch.controlplane.base.config import fleet_from_dict  # noqa: E402
from kvprefetch.controlplane.base.types import SessionKey  # noqa: E402
from kvprefetch.controlplane.live.connect import connect  # noqa: E402
from kvprefetch.controlplane.live.gateway import (  # noqa: E402
    Gateway,
    GatewayConfig,
    serve_in_thread,
)
from kvprefetch.controlplane.live.gateway_metrics import GatewayMetrics  # noqa: E402
from kvprefetch.controlplane.live.http_api import HttpServer, create_app  # noqa: E402
from kvprefetch.controlplane.live.metrics import OTHER_TENANTS, PrometheusMetrics  # noqa: E402
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig  # noqa: E402

pytestmark = [pytest.mark.servers, pytest.mark.live]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 2 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
#: Series Prometheus makes itself (not exported by a component).
PROMETHEUS_SERIES = {"up"}
#: The gauges: levels and rates, each named here, so that a running total exported as a
#: gauge (it must be a counter, ``..._total``) fails the test.
LEVELS = {
    "kvprefetch_events_per_second", "kvprefetch_local_hit_rate",
    "kvprefetch_tenant_live_sessions", "kvprefetch_orders_in_flight",
    "kvprefetch_node_tier_quota_bytes", "kvprefetch_tenant_local_tier_bytes",
    "kvprefetch_gateway_in_flight", "kvprefetch_gateway_seen_sessions",
    "kvprefetch_gateway_node_routable",
}


# -- the exported names ---------------------------------------------------------------------


def _scheduler_families() -> list[Any]:
    """The scheduler's and its HTTP API's families, as ``GET /metrics`` serves them (tenant
    shares configured, so that the share counters are there too)."""
    metrics = PrometheusMetrics()
    config = ServiceConfig(fleet=FLEET, tenants=("acme", "globex"),
                           tenant_local_tier_share={"acme": 0.25},
                           tenant_prefetch_bandwidth_share={"acme": 0.1})
    svc = SchedulerService(config, metrics=metrics).start()
    try:
        with HttpServer(create_app(svc, bearer_token=None, metrics_registry=metrics)) as srv:
            text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    finally:
        svc.close()
    return list(text_string_to_metric_families(text))


def _gateway_families() -> list[Any]:
    gateway = Gateway(GatewayConfig(upstreams=["http://127.0.0.1:9"]))  # no I/O until start
    return list(gateway.registry.collect())


@pytest.fixture(scope="module")
def families() -> list[Any]:
    """Every component's families, less the creation times prometheus_client writes beside
    a histogram as a gauge family of its own (``..._created``)."""
    return [fam for fam in _scheduler_families() + _gateway_families()
            if not (fam.type == "gauge" and fam.name.endswith("_created"))]


def _series(families: Iterable[Any]) -> set[str]:
    """The series names a query may use: a counter's ``_total``, a histogram's
    ``_bucket``/``_sum``/``_count``, a gauge's own name."""
    out: set[str] = set()
    for fam in families:
        if fam.type == "counter":
            out.add(f"{fam.name}_total")
        elif fam.type == "histogram":
            out |= {f"{fam.name}_bucket", f"{fam.name}_sum", f"{fam.name}_count"}
        else:
            out.add(fam.name)
    return out


# -- the queries ----------------------------------------------------------------------------

_AGGREGATIONS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk",
                 "quantile", "count_values", "group", "limitk", "limit_ratio"}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
#: An identifier not inside a number, a duration or a Grafana variable.
_IDENT = re.compile(r"(?<![\w.$])[A-Za-z_:][\w:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: every identifier that is not a
    function, an aggregation, a keyword, a label name or inside a label matcher."""
    text = _MATCHERS.sub("", _STRING.sub('""', expr))
    text = _GROUPING.sub(r"\1", text)
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group()
        if text[match.end():].lstrip().startswith("(") or word in _AGGREGATIONS | _KEYWORDS:
            continue  # a function or aggregation call, or an operator
        names.add(word)
    return names


def _dashboard_queries() -> Iterator[tuple[str, str]]:
    dashboard = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"dashboard panel {panel['title']!r}", target["expr"]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            match = re.match(r"label_values\(([^,]+),", query["query"])
            assert match, query
            yield f"dashboard variable {var['name']!r}", match.group(1).strip()


def _alert_queries() -> Iterator[tuple[str, str]]:
    rules = yaml.safe_load((EXAMPLES / "prometheus-alerts.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            yield f"alert {rule['alert']}", rule["expr"]


def test_the_query_parser_finds_metric_names_and_nothing_else() -> None:
    expr = ('histogram_quantile(0.9, sum by (le, node) (rate(a_seconds_bucket{x="y{z}",'
            'deployment=~"$deployment"}[$__rate_interval]))) / on (job) group_left '
            'clamp_min(sum(rate(b_total[5m])) + c, 1e-3) > 0.5 and up{job=~"k.*"} == 0')
    assert metric_names(expr) == {"a_seconds_bucket", "b_total", "c", "up"}


def test_every_query_of_the_dashboard_and_the_alerts_reads_exported_metrics(
        families: list[Any]) -> None:
    exported = _series(families) | PROMETHEUS_SERIES
    queries = [*_dashboard_queries(), *_alert_queries()]
    assert len(queries) >= 20
    read: set[str] = set()
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{where}: {sorted(unknown)} exported by no component"
        read |= names
    for needed in ("kvprefetch_gateway_ttft_seconds_bucket",
                   "kvprefetch_gateway_route_seconds_bucket",
                   "kvprefetch_gateway_requests_total", "kvprefetch_wasted_bytes_total",
                   "kvprefetch_useful_bytes_total", "kvprefetch_transfer_bytes_total",
                   "kvprefetch_prefetches_over_budget_total",
                   "kvprefetch_gateway_scheduler_unavailable_total",
                   "kvprefetch_orders_failed_total"):
        assert needed in read


def test_alert_rules_are_complete() -> None:
    rules = yaml.safe_load((EXAMPLES / "prometheus-alerts.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert {"alert", "expr", "for", "labels", "annotations"} <= rule.keys(), rule
            assert rule["labels"]["severity"] in ("warning", "critical")
            assert rule["annotations"]["summary"]


def test_one_prefix_and_running_totals_are_counters(families: list[Any]) -> None:
    names = {fam.name for fam in families}
    assert "kvprefetch_gateway_ttft_seconds" in names
    assert "kvprefetch_tenant_tier_share_evictions" in names  # the share counters too
    for fam in families:
        assert fam.name.startswith("kvprefetch_"), fam.name
        assert fam.type in ("counter", "gauge", "histogram"), (fam.name, fam.type)
        if fam.type == "gauge":
            assert fam.name in LEVELS, f"{fam.name}: a gauge not named as a level"
        for sample in fam.samples:
            if fam.type == "counter":
                assert sample.name.endswith(("_total", "_created")), sample.name


# -- the gateway's TTFT ---------------------------------------------------------------------


def _engine() -> FastAPI:
    """vLLM's answers in shape: ``/tokenize`` (a byte per token), a completion and a
    streamed chat."""
    app = FastAPI()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await request.json()
        text = "".join(m["content"] for m in body["messages"]) if "messages" in body else (
            body["prompt"])
        return {"tokens": list(text.encode())}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        return {"id": "c1", "object": "text_completion",
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            yield "data: " + json.dumps({"choices": [
                {"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {
                "prompt_tokens": 9, "completion_tokens": 1}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _sample(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def test_a_session_s_second_turn_is_a_returning_one_in_the_ttft_histogram() -> None:
    svc = SchedulerService(ServiceConfig(fleet=FLEET, tenants=("acme",)),
                           metrics=PrometheusMetrics()).start()
    try:
        with HttpServer(create_app(svc, bearer_token=None)) as scheduler, \
                HttpServer(_engine()) as engine:
            config = GatewayConfig(upstreams=[engine.url, engine.url], tenant="acme",
                                   deployment="chat-a", route_deadline_s=2.0)
            gateway = Gateway(config, scheduler=connect(scheduler.url, tenant="acme"))
            with serve_in_thread(gateway) as url:
                first = httpx.post(f"{url}/v1/completions", timeout=10,
                                   json={"model": "m", "prompt": "hello"},
                                   headers={"X-Session-ID": "s1"})
                assert first.status_code == 200
                with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=10,
                                  json={"model": "m", "stream": True,
                                        "messages": [{"role": "user", "content": "hello"}]},
                                  headers={"X-Session-ID": "s1"}) as second:
                    assert second.status_code == 200
                    node = second.headers["x-kvp-node"]
                    assert "data: [DONE]" in list(second.iter_lines())
                text = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        svc.close()
    ttft = "kvprefetch_gateway_ttft_seconds_bucket"
    labels = {"deployment": "chat-a", "tenant": "acme", "le": "+Inf"}
    assert _sample(text, ttft, returning="true", node=node, **labels) == 1
    assert _sample(text, ttft, returning="false", **labels) == 1
    assert _sample(text, "kvprefetch_gateway_ttft_seconds_count", returning="true") == 1
    # both turns asked the scheduler where to run
    assert sum(_sample(text, "kvprefetch_gateway_route_seconds_count", node=str(n),
                       deployment="chat-a", tenant="acme") for n in (0, 1)) == 2
    assert _sample(text, "kvprefetch_gateway_routed_total", by="scheduler") == 2


def test_the_gateway_s_label_sets_and_session_memory_are_bounded() -> None:
    m = GatewayMetrics("default", max_tenants=2, max_sessions=2)
    for tenant in ("a", "b", "c"):
        m.ttft(0.01, node=0, tenant=tenant, returning=False)
    tenants = {s.labels["tenant"] for fam in m.registry.collect() for s in fam.samples
               if s.name == "kvprefetch_gateway_ttft_seconds_count"}
    assert tenants == {"a", "b", OTHER_TENANTS}
    assert not m.returning(SessionKey("a", "s1"))
    assert not m.returning(SessionKey("a", "s2"))
    assert m.returning(SessionKey("a", "s1"))  # s1 is now the most recent
    assert not m.returning(SessionKey("a", "s3"))  # s2, the least recent, is forgotten
    assert not m.returning(SessionKey("a", "s2"))
    assert m.registry.get_sample_value("kvprefetch_gateway_seen_sessions") == 2
