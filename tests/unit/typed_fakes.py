"""Typed stats and snapshots for unit tests of the front, the metrics and the dashboard."""

from __future__ import annotations

from actors.protocol.stats import BackendStats, EngineStats, LoadSnapshot
from actors.routes import PairState
from serving.routing.pool import EngineStatus, Load
from serving.routing.status import PlannerSnapshot, RouterSnapshot

IDLE = LoadSnapshot(0, 0.0, 0, 0.0, None, None)


def engine_stats(engine_id: str = "d0", role: str = "decode", running: int = 0, **backend: int) -> EngineStats:
    return EngineStats(engine_id, role, pid=1, generation=1, restarted=False, running=running, requests=0,
                       finished=0, errors=0, aborted=0, recomputed=0,
                       backend=BackendStats("synthetic", **backend), load=IDLE)


def router_snapshot(**fields) -> RouterSnapshot:
    base = dict(
        decode_load={"d0": Load(1, 4)}, prefill_load={"p0": Load()},
        breakers=(PairState("p0", "d0", "open", 3, 1),), counters={"prefill_retries": 1},
        fallbacks={"no_prefill_engine": 3}, migrations={}, transfer_failures={("p0", "d0"): 2},
        prefill_failures={}, routes={"d0": ("p0",)}, planner=PlannerSnapshot(),
        engines={"d0": EngineStatus(True, engine_stats(free_blocks=5))},
    )
    base.update(fields)
    return RouterSnapshot(**base)
