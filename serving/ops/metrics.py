"""raypd's metrics, all named `raypd_*`: the replica's own registry and the cluster-wide copy.

The front records requests as they flow (`ServiceMetrics`); the router's state is read at scrape
time by a custom collector (`RouterCollector`), so nothing is copied on the hot path. Labels come
from the routing enums (`serving.routing.decisions`, `RouterCounter`, `ReadinessCode`,
`BreakerState`). Two exports of the same events: the front's `GET /metrics` (one registry per app)
and Ray's metrics (`serving.ops.cluster_metrics`), which add up across ingress replicas. What is
recorded and read: `ServiceMetrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from actors.routes import BreakerState
from serving.routing.pool import RouterCounter
from serving.routing.status import ReadinessCode, jsonable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BREAKER_STATES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}

# engine gauges: metric suffix -> (help, value of one engine's stats)
ENGINE_GAUGES: dict[str, tuple[str, Callable[[Any], float]]] = {
    "engine_running_requests": ("requests running on the engine", lambda s: s.running),
    "engine_free_blocks": ("free KV blocks", lambda s: s.backend.free_blocks),
    "engine_num_blocks": ("KV blocks in total", lambda s: s.backend.num_blocks),
    "leases_held": ("prefill requests whose blocks are held under a lease", lambda s: s.backend.held_leases),
    "kv_transfer_bytes": ("KV bytes transferred (as reported by the engine)", lambda s: s.backend.transfer_bytes),
    "handshakes": ("handshakes the engine completed", lambda s: s.backend.handshakes),
}


class RouterCollector(Collector):
    """Turns the router's snapshot (`serving.routing.status.RouterSnapshot`) into metric families."""

    def __init__(self, router_getter: Callable[[], Any]):
        self.router_getter = router_getter

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: the label sets depend on the engines

    def collect(self) -> Iterator[Metric]:
        router = self.router_getter()
        if router is None:
            return
        snap = router.snapshot()
        if snap.readiness is not None:  # a state set: 1 on the current state (ok: /health answers 200)
            ready = GaugeMetricFamily("raypd_ready", "1 on this front's readiness state, 0 on the others: ok (a "
                                      "P/D path or a permitted fallback, /health 200) or why not (/health 503)",
                                      labels=["reason"])
            for code in ReadinessCode:
                ready.add_metric([code], 1 if snap.readiness.code == code else 0)
            yield ready
        yield _labelled(CounterMetricFamily("raypd_engine_hangs", "engine incarnations the coordinator judged hung "
                                            "(no answer to its probe) and killed so that Ray restarts them",
                                            labels=["engine"]), snap.hangs)
        yield _labelled(CounterMetricFamily("raypd_deadline_misses", "engine calls that missed their deadline here "
                                            "(the engine was then treated as hung)", labels=["engine", "call"]),
                        snap.deadline_misses)
        yield _labelled(CounterMetricFamily("raypd_deadline_extensions", "engine calls past their deadline that "
                                            "went on: the engine was busy (it answered other calls meanwhile)",
                                            labels=["engine", "call"]), snap.deadline_extensions)
        pq = GaugeMetricFamily("raypd_prefill_queue_depth", "prefills in flight, per prefill engine",
                               labels=["engine"])
        for eid, load in snap.prefill_load.items():
            pq.add_metric([eid], load.requests)
        yield pq
        dq = GaugeMetricFamily("raypd_decode_queue_depth", "requests in flight, per decode engine",
                               labels=["engine"])
        dt = GaugeMetricFamily("raypd_decode_outstanding_tokens",
                               "tokens still owed by the requests in flight, per decode engine", labels=["engine"])
        for eid, load in snap.decode_load.items():
            dq.add_metric([eid], load.requests)
            dt.add_metric([eid], load.tokens)
        yield dq
        yield dt
        bs = GaugeMetricFamily("raypd_breaker_state",
                               "circuit breaker per (prefill, decode) pair, as the coordinator's ledger holds it: "
                               "0 closed, 1 half-open, 2 open", labels=["prefill", "decode"])
        bf = GaugeMetricFamily("raypd_breaker_failures", "consecutive failures of the pair (ledger)",
                               labels=["prefill", "decode"])
        bo = CounterMetricFamily("raypd_breaker_opened", "times the pair's breaker opened (ledger)",
                                 labels=["prefill", "decode"])
        for b in snap.breakers:
            bs.add_metric([b.prefill_id, b.decode_id], BREAKER_STATES.get(b.state, -1))
            bf.add_metric([b.prefill_id, b.decode_id], b.failures)
            bo.add_metric([b.prefill_id, b.decode_id], b.opened_count)
        yield bs
        yield bf
        yield bo
        yield _labelled(CounterMetricFamily("raypd_migrations", "streams moved to another decode engine after "
                                            "theirs failed", labels=["reason"]), snap.migrations)
        yield _labelled(CounterMetricFamily("raypd_kv_transfer_failures", "KV transfers that failed (error or "
                                            "recompute)", labels=["prefill", "decode"]), snap.transfer_failures)
        yield _labelled(CounterMetricFamily("raypd_prefill_failures", "prefill calls that failed",
                                            labels=["prefill"]), snap.prefill_failures)
        yield _labelled(CounterMetricFamily("raypd_fallbacks", "requests prefilled on their decode engine after a "
                                            "failed or impossible remote prefill", labels=["reason"]), snap.fallbacks)
        yield _labelled(CounterMetricFamily("raypd_disagg_decisions", "remote or local prefill per request, with "
                                            "the reason (serving/routing/policy.py)", labels=["decision", "reason"]),
                        snap.planner.decisions)
        if snap.planner.prefix_index_engines is not None:
            yield _labelled(GaugeMetricFamily("raypd_prefix_index_blocks", "KV blocks the router's prefix index "
                                              "holds per engine", labels=["engine"]), snap.planner.prefix_index_engines)
        yield CounterMetricFamily("raypd_prefill_retries", "prefills retried on another engine",
                                  value=snap.counters.get(RouterCounter.PREFILL_RETRIES, 0))
        yield CounterMetricFamily("raypd_aborts", "requests aborted on the engines (client went away)",
                                  value=snap.counters.get(RouterCounter.ABORTED, 0))
        yield from pool_metrics(snap.pools)
        up = GaugeMetricFamily("raypd_engine_up", "1 when the engine answered its last stats call",
                               labels=["engine"])
        for eid, status in snap.engines.items():
            up.add_metric([eid], 1 if status.up else 0)
        yield up
        for suffix, (help_text, value) in ENGINE_GAUGES.items():
            fam = GaugeMetricFamily(f"raypd_{suffix}", help_text, labels=["engine", "role"])
            for eid, status in snap.engines.items():
                if status.stats is not None:
                    fam.add_metric([eid, status.stats.role], float(value(status.stats)))
            yield fam


def _labelled(family: Any, values: dict) -> Any:
    """One sample per key (a tuple key gives one label value per element)."""
    for key, n in values.items():
        family.add_metric(list(key) if isinstance(key, tuple) else [key], n)
    return family


@dataclass(frozen=True)
class MetricSpec:
    """One front metric: the same name and labels in the replica's registry and in Ray's."""

    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # None: a counter


REQUESTS = MetricSpec("raypd_requests", "HTTP requests by endpoint and status", ("endpoint", "status"))
TTFT = MetricSpec("raypd_time_to_first_token_seconds", "time to first token, per P/D path",
                  ("endpoint", "path"), LATENCY_BUCKETS)
ITL = MetricSpec("raypd_inter_token_latency_seconds", "time between streamed chunks, per P/D path",
                 ("endpoint", "path"), ITL_BUCKETS)
HANDOFF = MetricSpec("raypd_pd_handoff_seconds", "prefill engine's first token -> decode engine's first token "
                     "(KV pull + one decode step)", ("endpoint",), LATENCY_BUCKETS)
E2E = MetricSpec("raypd_e2e_request_latency_seconds", "request latency, arrival to last token", ("endpoint",),
                 LATENCY_BUCKETS)
PROMPT_TOKENS = MetricSpec("raypd_prompt_tokens", "prompt tokens processed")
GENERATION_TOKENS = MetricSpec("raypd_generation_tokens", "tokens generated")
FRONT_METRICS = (REQUESTS, TTFT, ITL, HANDOFF, E2E, PROMPT_TOKENS, GENERATION_TOKENS)


def pool_metrics(pools: Any) -> Iterator[Metric]:
    """The autoscaler's view (`serving.cluster.autoscaler.AutoscalerStatus`), when it runs."""
    if not pools:
        return
    pools = jsonable(pools)
    engines = GaugeMetricFamily("raypd_pool_engines", "engines per role: serving, starting, draining",
                                labels=["role", "state"])
    bounds = GaugeMetricFamily("raypd_pool_bounds", "autoscaler bounds per role", labels=["role", "bound"])
    for role, st in pools["roles"].items():
        for state in ("serving", "starting", "draining"):
            engines.add_metric([role, state], len(st[state]))
        bounds.add_metric([role, "min"], st["min"])
        bounds.add_metric([role, "max"], st["max"])
    yield engines
    yield bounds
    events = CounterMetricFamily("raypd_autoscaler_events", "scale-ups, scale-downs, unschedulable, "
                                 "failed starts and drain timeouts, per role", labels=["role", "event"])
    for key, n in pools["counters"].items():
        role, _, event = key.partition("_")
        events.add_metric([role, event], n)
    yield events


class ServiceMetrics:
    """The front's events, recorded into the replica's registry and (optionally) Ray's metrics.

    Recorded by the front as requests flow (`ServiceMetrics`): request counts by
    endpoint and status, time to first token and inter-token latency per P/D path
    (pd | local | fallback), the P/D handoff (prefill's token -> decode engine's
    first token: KV pull + one decode step), end-to-end latency, tokens.
    Read from the router at scrape time (a custom collector, so nothing is copied
    on the hot path): prefill / decode queue depths, the breaker of every
    (prefill, decode) pair as the coordinator's ledger holds it (the one owner of
    breakers; the router reads it with its routes), KV transfer failures the
    router saw, prefill failures, retries, fallbacks, stream migrations, readiness
    (`raypd_ready{reason}`: what `/health` answers), deadlines the engines missed and
    the hangs the coordinator judged (`raypd_engine_hangs_total`), and the
    engines' own stats (free blocks, leases held, running requests, transfer
    bytes and handshakes when the backend reports them).

    Two exports of the same events:
      - the front's `GET /metrics`: this replica's registry (one per app, so tests
        and several replicas in one process never collide);
      - Ray's metrics (`serving.ops.cluster_metrics`, when the process is connected to
        Ray): every replica records into Ray's per-node metrics agent, so a scrape
        of each node's metrics port (`raypd status` prints them) adds up across
        ingress replicas. Ray prefixes the names: `ray_raypd_requests_total`.
    """

    def __init__(self, router_getter: Callable[[], Any] | None = None, registry: CollectorRegistry | None = None,
                 cluster: Any = None):
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.cluster = cluster  # serving.ops.cluster_metrics.ClusterFrontMetrics, or None
        self._local: dict[str, Any] = {}
        for spec in FRONT_METRICS:
            if spec.buckets is None:
                self._local[spec.name] = Counter(spec.name, spec.help, list(spec.labels), registry=self.registry)
            else:
                self._local[spec.name] = Histogram(spec.name, spec.help, list(spec.labels), buckets=spec.buckets,
                                                   registry=self.registry)
        self._children: dict[tuple, Any] = {}
        if router_getter is not None:
            self.registry.register(RouterCollector(router_getter))

    def _child(self, spec: MetricSpec, values: tuple[str, ...]) -> Any:
        key = (spec.name, values)
        child = self._children.get(key)
        if child is None:
            metric = self._local[spec.name]
            child = self._children[key] = metric.labels(*values) if values else metric
        return child

    def _count(self, spec: MetricSpec, values: tuple[str, ...], n: float = 1.0) -> None:
        if n:
            self._child(spec, values).inc(n)
            if self.cluster is not None:
                self.cluster.inc(spec, values, n)

    def _observe(self, spec: MetricSpec, values: tuple[str, ...], seconds: float) -> None:
        self._child(spec, values).observe(seconds)
        if self.cluster is not None:
            self.cluster.observe(spec, values, seconds)

    def request(self, endpoint: str, status: str) -> None:
        self._count(REQUESTS, (endpoint, status))

    def ttft(self, endpoint: str, path: str, seconds: float) -> None:
        self._observe(TTFT, (endpoint, path), seconds)

    def itl(self, endpoint: str, path: str, seconds: float) -> None:
        self._observe(ITL, (endpoint, path), seconds)

    def handoff(self, endpoint: str, seconds: float) -> None:
        self._observe(HANDOFF, (endpoint,), seconds)

    def e2e(self, endpoint: str, seconds: float) -> None:
        self._observe(E2E, (endpoint,), seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        self._count(PROMPT_TOKENS, (), prompt)
        self._count(GENERATION_TOKENS, (), generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)
