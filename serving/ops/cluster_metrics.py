"""raypd's metrics through Ray's metrics agent: they add up across ingress replicas.

Every ingress replica records its request events (`ClusterFrontMetrics`, at
event time) and exports its router's view (`RouterExporter`, every
`interval_s`: the same families `serving.ops.metrics.RouterCollector` renders,
counters as increments since the last export, gauges as values) with
`ray.util.metrics`. Ray's agent on each node serves what the node's processes
recorded on the node's metrics port (`scrape_urls()`); names gain Ray's `ray_`
prefix (`ray_raypd_requests_total`). Series are per recording process, so a
cluster total is `sum()` over series; engine gauges (every replica reports the
same engine) are read with `max by (engine)`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.ops.metrics import MetricSpec, RouterCollector
from serving.routing.pool import RouterCounter

logger = logging.getLogger("raypd.metrics")

EXPORT_INTERVAL_S = 5.0  # Ray's agent itself exports every few seconds: finer is not seen


class ClusterFrontMetrics:
    """The front's request metrics as Ray metrics (same names, labels and buckets)."""

    def __init__(self) -> None:
        self._metrics: dict[str, Any] = {}

    def _metric(self, spec: MetricSpec) -> Any:
        m = self._metrics.get(spec.name)
        if m is None:
            from ray.util.metrics import Counter, Histogram

            if spec.buckets is None:
                m = Counter(spec.name, spec.help, tag_keys=spec.labels)
            else:
                m = Histogram(spec.name, spec.help, boundaries=list(spec.buckets), tag_keys=spec.labels)
            self._metrics[spec.name] = m
        return m

    def inc(self, spec: MetricSpec, values: tuple[str, ...], n: float) -> None:
        self._metric(spec).inc(n, tags=dict(zip(spec.labels, values)) or None)

    def observe(self, spec: MetricSpec, values: tuple[str, ...], seconds: float) -> None:
        self._metric(spec).observe(seconds, tags=dict(zip(spec.labels, values)) or None)


class RouterExporter:
    """Periodically records the router's families into Ray metrics (one per ingress replica).

    The engines' stats are asked for only when this router has served requests since
    the last ask (or once every `idle_refresh_s`): an idle service makes no calls to its
    engines, whose stats do not change without requests (a death shows in the directory
    and in the next ask). `/metrics` and `raypd status` still ask at once."""

    def __init__(self, router_getter: Any, interval_s: float = EXPORT_INTERVAL_S, idle_refresh_s: float = 60.0,
                 clock: Any = time.monotonic):
        self.collector = RouterCollector(router_getter)
        self.router_getter = router_getter
        self.interval_s = interval_s
        self.idle_refresh_s = idle_refresh_s
        self.clock = clock
        self._metrics: dict[str, Any] = {}
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._task: asyncio.Task | None = None
        self._asked: tuple[int, float] | None = None  # (router requests, when) at the last ask of the engines

    def _metric(self, family: Any, label_keys: tuple[str, ...]) -> Any:
        m = self._metrics.get(family.name)
        if m is None:
            from ray.util.metrics import Counter, Gauge

            cls = Counter if isinstance(family, CounterMetricFamily) else Gauge
            m = self._metrics[family.name] = cls(family.name, family.documentation, tag_keys=label_keys)
        return m

    def export_once(self) -> None:
        for family in self.collector.collect():
            is_counter = isinstance(family, CounterMetricFamily)
            if not is_counter and not isinstance(family, GaugeMetricFamily):
                continue
            for sample in family.samples:
                if is_counter and not sample.name.endswith("_total"):
                    continue  # the "_created" timestamps
                tags = dict(sample.labels)
                metric = self._metric(family, tuple(sorted(tags)))
                if is_counter:
                    key = (family.name, tuple(sorted(tags.items())))
                    delta = sample.value - self._last.get(key, 0.0)
                    self._last[key] = sample.value
                    if delta > 0:
                        metric.inc(delta, tags=tags or None)
                else:
                    metric.set(sample.value, tags=tags or None)

    def _should_ask(self, router: Any) -> bool:
        requests = getattr(getattr(router, "pool", None), "counters", {}).get(RouterCounter.REQUESTS, 0)
        now = self.clock()
        if self._asked is not None and self._asked[0] == requests and now - self._asked[1] < self.idle_refresh_s:
            return False
        self._asked = (requests, now)
        return True

    async def run(self) -> None:
        while True:
            try:
                router = self.router_getter()
                if router is not None and self._should_ask(router):
                    await asyncio.wait_for(router.refresh_engine_stats(), self.interval_s)
                self.export_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - an engine away must not stop the export
                logger.info("router metrics export: %s", exc)
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def scrape_urls() -> list[str]:
    """One URL per live node: Ray's metrics agent there serves the node's raypd_* and vllm:* series."""
    import ray

    urls = []
    for node in ray.nodes():
        if node.get("Alive") and node.get("MetricsExportPort"):
            urls.append(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics")
    return sorted(urls)
