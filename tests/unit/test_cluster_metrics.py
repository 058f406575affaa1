"""The router's families recorded into Ray's metrics: counters as increments, gauges as values (fake Ray metrics)."""

from __future__ import annotations

import dataclasses

import ray.util.metrics

from serving.ops.cluster_metrics import RouterExporter
from test_dashboard import EveryFamilyRouter


class FakeMetric:
    made: dict[str, "FakeMetric"] = {}

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys, self.calls = name, tuple(tag_keys), []
        FakeMetric.made[name] = self

    def inc(self, value, tags=None):
        self.calls.append(("inc", value, tags))

    def set(self, value, tags=None):
        self.calls.append(("set", value, tags))


def test_counters_are_exported_as_increments_and_gauges_as_values(monkeypatch):
    monkeypatch.setattr(ray.util.metrics, "Counter", FakeMetric)
    monkeypatch.setattr(ray.util.metrics, "Gauge", FakeMetric)
    router = EveryFamilyRouter()
    exporter = RouterExporter(lambda: router)
    exporter.export_once()
    snap = router.snapshot()
    router.snapshot = lambda: dataclasses.replace(snap, fallbacks={"no_prefill_engine": 4})
    exporter.export_once()
    fallbacks = FakeMetric.made["raypd_fallbacks"].calls
    breaker = FakeMetric.made["raypd_breaker_state"].calls
    assert fallbacks == [("inc", 1.0, {"reason": "no_prefill_engine"}), ("inc", 3.0, {"reason": "no_prefill_engine"})]
    assert breaker == [("set", 0.0, {"decode": "d0", "prefill": "p0"})] * 2


def test_an_idle_router_does_not_ask_its_engines_for_stats_every_export():
    class Pool:
        counters = {"requests": 0}

    class Router:
        pool = Pool()
        asks = 0

    router, now = Router(), [0.0]
    exporter = RouterExporter(lambda: router, idle_refresh_s=60.0, clock=lambda: now[0])
    seen = []
    for t in (0, 5, 10, 15, 65, 70):  # every export interval, nothing served...
        now[0] = t
        seen.append(exporter._should_ask(router))
    assert seen == [True, False, False, False, True, False]  # ...only the first and one a minute later
    router.pool.counters["requests"] = 1  # a request came: the next export asks
    now[0] = 75
    assert exporter._should_ask(router) and not exporter._should_ask(router)
