"""``/metrics`` of a sharded scheduler: every shard's samples under one family each, told
apart by a ``shard`` label; and the scheduler's gauges read when scraped, not per event."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from kvprefetch.controlplane.live.metrics import PrometheusMetrics, merge_shard_metrics
from kvprefetch.controlplane.live.ports import SchedulerGauges


def _shard(orders: int, events: int) -> PrometheusMetrics:
    m = PrometheusMetrics()
    m.scheduler_gauges_from(lambda: SchedulerGauges({"node-0": orders, "node-1": 0},
                                                    wasted_bytes=orders, useful_bytes=2,
                                                    over_budget=0))
    for _ in range(events):
        m.event("route")
    return m


def test_shards_metrics_merge_into_one_exposition_labelled_by_shard() -> None:
    text = merge_shard_metrics([_shard(3, 1).render(), _shard(5, 4).render()]).decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # each family once
    by_name = {f.name: f for f in families}
    inflight = {(s.labels["node"], s.labels["shard"]): s.value
                for s in by_name["kvprefetch_orders_in_flight"].samples}
    assert inflight == {("node-0", "0"): 3, ("node-1", "0"): 0,
                        ("node-0", "1"): 5, ("node-1", "1"): 0}
    events = {s.labels["shard"]: s.value for s in by_name["kvprefetch_events"].samples
              if s.name == "kvprefetch_events_total"}
    assert events == {"0": 1, "1": 4}


def test_the_gauges_are_read_at_scrape_time() -> None:
    seen = {"orders": 1}
    m = PrometheusMetrics()
    m.scheduler_gauges_from(lambda: SchedulerGauges({"node-0": seen["orders"]}, 0, 0, 0,
                                                    warmup_bytes=seen["orders"] << 30))
    assert b'kvprefetch_orders_in_flight{node="node-0"} 1.0' in m.render()
    assert b"kvprefetch_warmup_bytes_total 1.073741824e+09" in m.render()
    seen["orders"] = 7
    assert b'kvprefetch_orders_in_flight{node="node-0"} 7.0' in m.render()
