"""What a router reports about itself, typed: readiness (the front's `/health`) and its snapshot
(`raypd status`, `/metrics`). `to_json()` is the one place they become plain dicts (HTTP, CLI)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from actors.routes import PairState, RouteTable
from serving.routing.pool import EnginePool, EngineStatus, Load


def jsonable(obj: Any) -> Any:
    """Dataclasses, tuples and tuple-keyed dicts as JSON values (pair keys become "a->b")."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {("->".join(k) if isinstance(k, tuple) else str(k)): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    return obj


class ReadinessCode(StrEnum):
    """Why a router can or cannot place a request; the values are `raypd_ready`'s `reason` labels.
    `PD_DEGRADED` is ready (colocated serving goes on) with no P/D path; the others but `OK` are not."""

    OK = "ok"
    PD_DEGRADED = "pd_degraded"
    NO_DECODE_ENGINE = "no_decode_engine"
    DECODE_ENGINES_HUNG = "decode_engines_hung"
    NO_PREFILL_ENGINE = "no_prefill_engine"


@dataclass(frozen=True)
class Readiness:
    """Whether the router can place a request now, and why not."""

    ready: bool
    reason: str | None = None
    decode_engines: tuple[str, ...] = ()
    pd_paths: dict[str, tuple[str, ...]] = field(default_factory=dict)  # decode -> usable prefill engines
    decode_local: bool = False  # decode engines may prefill themselves
    directory_error: str | None = None
    code: ReadinessCode = ReadinessCode.OK
    hung: tuple[str, ...] = ()  # engines held back: they missed a deadline (serving/routing/deadlines.py)

    @classmethod
    def of(cls, pool: EnginePool, routes: RouteTable, hung: tuple[str, ...], decode_local: bool,
           directory_error: str | None) -> "Readiness":
        """What `routes` allow now: live decode engines, their usable prefill engines, or a local
        prefill (`decode_local`: the fallback allows it, or there are no prefill engines)."""
        live = pool.live_decodes(routes)
        pd_paths = {d: tuple(pool.usable_prefills(d, routes)) for d in live}
        local_ok = bool(live) and (decode_local or not pool.prefills)
        ready = any(pd_paths.values()) or local_ok
        reason, code = None, ReadinessCode.OK
        if not live and any(d in routes.decodes for d in hung):
            reason, code = (f"no decode engine can take a request: {', '.join(hung)} missed their deadlines "
                            "(treated as hung; the coordinator restarts them)"), ReadinessCode.DECODE_ENGINES_HUNG
        elif not live:
            reason, code = "no decode engine is alive", ReadinessCode.NO_DECODE_ENGINE
        elif not ready:
            reason, code = ("no compatible prefill engine with a closed breaker, and the fallback is reject",
                            ReadinessCode.NO_PREFILL_ENGINE)
        elif (pool.prefills or _lost_prefills(routes)) and not any(pd_paths.values()):
            reason, code = cls._pd_degraded(pool, routes), ReadinessCode.PD_DEGRADED
        return cls(ready, reason, tuple(live), pd_paths, local_ok, directory_error, code, hung)

    @staticmethod
    def _pd_degraded(pool: EnginePool, routes: RouteTable) -> str:
        """Why no decode engine has a prefill engine to pull from (serving goes on colocated)."""
        why = [f"breaker {b.prefill_id}->{b.decode_id} {b.state}" + (f" ({b.last_reason})" if b.last_reason else "")
               for b in routes.breakers if b.state != "closed"]
        missing = {*pool.prefills, *_lost_prefills(routes)} - set(routes.generations)
        why += [f"{p} not registered (dead or restarting)" for p in sorted(missing)]
        return ("P/D degraded: no decode engine can pull from a prefill engine"
                + (f" ({'; '.join(why)})" if why else "") + "; requests are prefilled on their decode engine")

    def to_json(self) -> dict[str, Any]:
        return jsonable(self)


def _lost_prefills(routes: RouteTable) -> list[str]:
    """Engines that could prefill for another and died, not back yet (the pool may have forgotten
    them: their actor is gone while the launcher starts them again elsewhere)."""
    return [e for e, role in routes.lost.items() if role in ("prefill", "both")]


@dataclass(frozen=True)
class PullRate:
    """A pair's KV pull as a router learned it: seconds = overhead_s + tokens / tokens_per_s, where
    overhead_s includes `failure_penalty_s`, what is left of a failed pull's cost."""

    tokens_per_s: float
    overhead_s: float
    failure_penalty_s: float = 0.0


@dataclass(frozen=True)
class PlannerSnapshot:
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)  # (decision, reason) -> requests
    prefix_index_engines: dict[str, int] | None = None  # engine -> blocks (cache-aware routing only)
    prefix_index_error: str | None = None


@dataclass(frozen=True)
class RouterSnapshot:
    decode_load: dict[str, Load]
    prefill_load: dict[str, Load]
    breakers: tuple[PairState, ...]
    counters: dict[str, int]
    fallbacks: dict[str, int]
    migrations: dict[str, int]
    transfer_failures: dict[tuple[str, str], int]  # (prefill, decode) -> failures this router saw
    prefill_failures: dict[str, int]
    routes: dict[str, tuple[str, ...]]  # decode -> usable prefill engines (the directory's view)
    planner: PlannerSnapshot = PlannerSnapshot()
    pools: Any = None  # serving.cluster.autoscaler.AutoscalerStatus when an autoscaler runs
    engines: dict[str, EngineStatus] = field(default_factory=dict)
    readiness: Readiness | None = None  # as the cached view of the directory says
    deadline_misses: dict[tuple[str, str], int] = field(default_factory=dict)  # (engine, call) -> misses seen here
    # (engine, call) -> waits past their deadline let run on here: the engine was busy, not hung
    deadline_extensions: dict[tuple[str, str], int] = field(default_factory=dict)
    hangs: dict[str, int] = field(default_factory=dict)  # engine -> incarnations the coordinator judged hung
    # (prefill, decode) -> the pull rate this router learned from its streams (pairs it measured)
    pull_rates: dict[tuple[str, str], PullRate] = field(default_factory=dict)

    @classmethod
    def of(cls, pool: EnginePool, routes: RouteTable, planner: PlannerSnapshot, pools: Any,
           readiness: Readiness | None = None) -> "RouterSnapshot":
        return cls(
            decode_load={d: dataclasses.replace(x) for d, x in pool.decode_load.items()},
            prefill_load={p: dataclasses.replace(x) for p, x in pool.prefill_load.items()},
            breakers=routes.breakers, counters=dict(pool.counters), fallbacks=dict(pool.fallbacks),
            migrations=dict(pool.migrations),
            transfer_failures={(p, d): n for (d, p), n in pool.transfer_failures.items()},
            prefill_failures=dict(pool.prefill_failures),
            routes={d: tuple(r.prefill_id for r in rs) for d, rs in routes.decodes.items()},
            planner=planner, pools=pools, engines=dict(pool.engine_stats), readiness=readiness,
            deadline_misses=dict(pool.deadlines.misses), deadline_extensions=dict(pool.deadlines.extended),
            hangs=dict(routes.hangs),
            pull_rates={pair: PullRate(round(t.tokens_per_s, 1), round(t.overhead_s, 4),
                                       round(pool.rates.failure_penalty_s(*pair), 4))
                        for pair, t in pool.rates.pairs().items()},
        )

    def to_json(self) -> dict[str, Any]:
        return jsonable(self)
