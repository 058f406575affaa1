"""One engine on the cluster: its placement group, its actor, its start and its stop.

The mechanics only; who decides to start or stop an engine is the launcher
(`serving.cluster.launcher`, the one owner of start-up) and the autoscaler it
runs. Each engine gets one STRICT_PACK placement group: the engine, its rank
actors and vLLM's worker processes share a node, and the bundle carries the
role's custom resources (e.g. `prefill: 1`), which is how pools are pinned to
labelled nodes. Ray restarts a crashed engine (bounded) in the same group, so a
restart reuses it and strands nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.control.startup_watch import StartupDeadline
from actors.engine.actor import EngineActor
from actors.engine.options import engine_actor_options
from actors.engine.startup import STARTUP_GROUP, StartPhase
from serving.cluster.names import COORDINATOR_NAME, NAMESPACE, ROLES, actor_name, actor_name_of, engine_id, placement_group_name
from serving.config import DeploymentConfig
from serving.placement_config import MeasuredRates

logger = logging.getLogger("raypd.launcher")

PHASE_POLL_S = 1.0
_Engine = ray.remote(concurrency_groups={STARTUP_GROUP: 1})(EngineActor)


class Unschedulable(RuntimeError):
    """No node offers the resources of one more engine of this role."""


@dataclass
class Deployment:
    """Handles of one deployment's actors (an engine of role `both` is in both pools)."""

    name: str
    coordinator: Any
    prefills: dict[str, Any] = field(default_factory=dict)  # engine id -> EngineActor handle
    decodes: dict[str, Any] = field(default_factory=dict)

    @property
    def engines(self) -> dict[str, Any]:
        return {**self.prefills, **self.decodes}

    def add(self, role: str, engine: str, handle: Any) -> None:
        if role in ("prefill", "both"):
            self.prefills[engine] = handle
        if role in ("decode", "both"):
            self.decodes[engine] = handle


def default_start_timeout(cfg: DeploymentConfig) -> float:
    """An engine's start timeout before any start was measured (then: `startup_deadline`)."""
    return 120.0 if cfg.backend == "synthetic" else 1200.0


def startup_deadline(cfg: DeploymentConfig) -> StartupDeadline:
    """How long an engine may take to start: `restarts.startup_deadline_s` when set, else a multiple of
    the longest start measured (with a floor); before any, `default_start_timeout`."""
    r = cfg.restarts
    return StartupDeadline(r.startup_deadline_s, default_start_timeout(cfg), r.startup_deadline_factor,
                           r.startup_deadline_floor_s)


def engine_placement_group(cfg: DeploymentConfig, role: str, index: int) -> Any:
    """Get or create the engine's placement group (detached: it outlives its creator)."""
    from ray.util.placement_group import get_placement_group, placement_group

    name = placement_group_name(engine_id(cfg.name, role, index))
    try:
        return get_placement_group(name)
    except ValueError:
        pass
    ecfg = cfg.engine_config(role, index)
    bundle = {"CPU": max(ecfg.num_cpus, 0.01), **ecfg.resources}
    return placement_group([bundle], strategy="STRICT_PACK", name=name, lifetime="detached")


def create_engine(cfg: DeploymentConfig, role: str, index: int, pg: Any, measured: MeasuredRates | None = None) -> Any:
    """Get or create engine `index` of `role` in its placement group (not started yet). `measured`:
    the rates the role's live engines measured (its chunk budget comes from them, not the priors).
    The actor's options are fixed here: when Ray restarts it, it keeps the budget it was created with."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ecfg = cfg.engine_config(role, index, engine_id(cfg.name, role, index), measured)
    if measured is not None:
        logger.info("%s engine %d: chunk budget %s tokens from its role's measured %.0f prompt tokens/s and "
                    "%.4f s per step", role, index, cfg.chunk_budget(role, measured),
                    measured.prefill_tokens_per_s, measured.step_s)
    opts = {k: v for k, v in engine_actor_options(ecfg, cfg.restarts.max_restarts).items() if v is not None}
    opts["num_cpus"] = max(ecfg.num_cpus, 0.01)
    opts.pop("resources", None)  # they are in the bundle
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0,
                                                placement_group_capture_child_tasks=True)
    return _Engine.options(
        name=actor_name(cfg.name, role, index), namespace=NAMESPACE, lifetime="detached",
        get_if_exists=True, scheduling_strategy=strategy, **opts,
    ).remote(ecfg.model_dump(), COORDINATOR_NAME)


async def start_engine(cfg: DeploymentConfig, role: str, index: int, timeout_s: float,
                       place_timeout_s: float = 60.0,
                       on_failed: Callable[[list[StartPhase]], None] | None = None,
                       measured: MeasuredRates | None = None) -> Any:
    """Create and start engine `index` of `role`; nothing is left behind when it cannot be placed
    (within `place_timeout_s`) or does not start (within `timeout_s`). `on_failed` gets a failed
    engine's start-up phases (its last says why) before its actor goes; `measured`: see `create_engine`."""
    from ray.util.placement_group import remove_placement_group

    pg = engine_placement_group(cfg, role, index)
    try:
        await asyncio.wait_for(pg.ready(), place_timeout_s)
    except asyncio.TimeoutError:
        remove_placement_group(pg)
        raise Unschedulable(f"no node offers {pg.bundle_specs} for {role} engine {index}") from None
    handle = create_engine(cfg, role, index, pg, measured)
    try:
        await asyncio.wait_for(handle.start.remote(), timeout_s)
    except BaseException:
        if on_failed is not None:
            try:
                ref = handle.start_phases.options(concurrency_group=STARTUP_GROUP).remote()
                on_failed(await asyncio.wait_for(ref, 5.0))
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                pass  # the actor itself died: the launch's error says why
        ray.kill(handle)
        remove_placement_group(pg)
        raise
    return handle


async def stop_engine(engine: str, handle: Any | None, timeout_s: float = 30.0) -> None:
    """Shut engine `engine` down (it unregisters), kill its actor and remove its placement group."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    if handle is not None:
        try:
            await asyncio.wait_for(handle.shutdown.remote(), timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            logger.warning("engine %s did not shut down cleanly: %s", engine, exc)
        try:
            ray.kill(handle)
        except Exception as exc:  # noqa: BLE001 - already gone
            logger.info("kill %s: %s", engine, exc)
    try:
        remove_placement_group(get_placement_group(placement_group_name(engine)))
    except ValueError:
        pass


def find_engines(name: str) -> dict[str, Any]:
    """Engine actors of deployment `name` that exist now: actor name -> handle."""
    prefixes = tuple(f"raypd-{name}-{role}-" for role in ROLES)
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and entry["name"].startswith(prefixes):
            try:
                found[entry["name"]] = ray.get_actor(entry["name"], namespace=NAMESPACE)
            except ValueError:
                pass  # died meanwhile
    return found


def handle_of(engine: str) -> Any | None:
    """The engine's actor, None when it is gone."""
    try:
        return ray.get_actor(actor_name_of(engine), namespace=NAMESPACE)
    except ValueError:
        return None


def remove_placement_groups(name: str) -> None:
    from ray.util.placement_group import get_placement_group, remove_placement_group

    prefix = f"raypd-{name}-"
    for info in ray.util.placement_group_table().values():
        pg_name = info.get("name") or ""
        if pg_name.startswith(prefix) and pg_name.endswith("-pg") and info.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(pg_name))
            except ValueError:
                pass


def report_phases(name: str, done: Callable[[], bool], deadline: float,
                  on_phase: Callable[[StartPhase], None]) -> set[tuple[str, str, float]]:
    """Poll the deployment's engines' start-up phases until `done()` (or the deadline); each phase once.
    Returns the phases reported (engine, phase, time)."""
    seen: set[tuple[str, str, float]] = set()
    polls: dict[str, Any] = {}
    final = False
    while True:
        for actor, handle in find_engines(name).items():
            if actor not in polls:  # at most one poll in flight per engine (a busy node answers late)
                polls[actor] = handle.start_phases.options(concurrency_group=STARTUP_GROUP).remote()
        ready, _ = ray.wait(list(polls.values()), num_returns=len(polls),
                            timeout=5.0 if final else PHASE_POLL_S / 2) if polls else ([], [])
        for actor, ref in list(polls.items()):
            if ref not in ready:
                continue
            del polls[actor]
            try:
                phases = ray.get(ref)
            except ray.exceptions.RayError:
                continue  # the launch reports the engine's failure
            for phase in phases:
                if (phase.engine_id, phase.phase, phase.at) not in seen:
                    seen.add((phase.engine_id, phase.phase, phase.at))
                    on_phase(phase)
        if final or time.monotonic() > deadline:
            return seen
        final = done()  # one last poll shows the last phases
        if not final:
            time.sleep(PHASE_POLL_S / 2)
