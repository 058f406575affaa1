"""The Grafana dashboard names only metrics raypd and vLLM really export (as Ray's metrics port serves them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import vllm.v1.metrics.loggers as vllm_loggers
from prometheus_client.core import CounterMetricFamily

from actors.routes import PairState
from serving.cluster.autoscaler import AutoscalerStatus, RoleStatus
from serving.ops.metrics import FRONT_METRICS, RouterCollector
from serving.routing.pool import EngineStatus, Load
from serving.routing.status import PlannerSnapshot, RouterSnapshot
from typed_fakes import engine_stats, router_snapshot

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "raypd-pd.json"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def ray_names(name: str, kind: str) -> set[str]:
    """Ray's exporter: `ray_` prefix, characters outside [a-zA-Z0-9_] replaced (vLLM's `vllm:`)."""
    base = "ray_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)
    return {base + s for s in SUFFIXES[kind]}


class EveryFamilyRouter:
    """A router snapshot with every family populated."""

    def snapshot(self) -> RouterSnapshot:
        return router_snapshot(
            decode_load={"d0": Load()}, breakers=(PairState("p0", "d0", "closed", 1, 1),),
            transfer_failures={("p0", "d0"): 1}, prefill_failures={"p0": 1}, fallbacks={"no_prefill_engine": 1},
            migrations={"decode_died": 1}, counters={"prefill_retries": 1, "aborted": 1},
            planner=PlannerSnapshot({("local", "prefix_cached"): 1}, {"d0": 3}),
            pools=AutoscalerStatus("raypd", {"decode": RoleStatus(serving=["d0"], min=1, max=2)},
                                   {"decode_scaled_up": 1}, []),
            engines={"d0": EngineStatus(True, engine_stats(running=1, num_blocks=1, free_blocks=1, held_leases=1,
                                                           transfer_bytes=1, handshakes=1))})


def exported() -> set[str]:
    names: set[str] = set()
    for spec in FRONT_METRICS:
        names |= ray_names(spec.name, "counter" if spec.buckets is None else "histogram")
    for family in RouterCollector(lambda: EveryFamilyRouter()).collect():
        names |= ray_names(family.name, "counter" if isinstance(family, CounterMetricFamily) else "gauge")
    source = Path(vllm_loggers.__file__).read_text()
    for kind, name in re.findall(r"_(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[a-z_]+)\"", source):
        names |= ray_names(name, kind)
    return names


def test_dashboard_names_only_exported_metrics():
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bray_[a-zA-Z0-9_]+", e)}
    assert sorted(used - exported()) == []
