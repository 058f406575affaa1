"""Get-or-create a deployment's coordinator and engine actors; tear them down.

Engines are named, detached actors in the "raypd" namespace
(`raypd-<deployment>-prefill-<i>`, `raypd-<deployment>-decode-<i>`), created
with `get_if_exists`, so every ingress replica, `raypd up` and `raypd status`
find the same engines; `EngineActor.start()` is idempotent, so each of them may
call it. Their engine ids are `<deployment>-prefill-<i>` / `<deployment>-decode-<i>`.

Ray's token authentication is left as Ray configures it: a local cluster
started here gets Ray's default (token mode, the token created in
~/.ray/auth_token or reused from it, RAY_AUTH_TOKEN(_PATH)); joining a cluster
follows Ray's client rules (`auto` picks up a local token; an explicit address
needs RAY_AUTH_MODE=token, as for any Ray client).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.control.coordinator import COORDINATOR_NAME, NAMESPACE, start_coordinator
from actors.engine.actor import EngineActor, engine_actor_options
from actors.engine.startup import STARTUP_GROUP, StartPhase
from serving.config import DeploymentConfig

logger = logging.getLogger("raypd.launcher")

DEFAULT_TEMP_DIR = "/tmp/raypd-ray"
ROLES = ("prefill", "decode")
PHASE_POLL_S = 1.0
_Engine = ray.remote(concurrency_groups={STARTUP_GROUP: 1})(EngineActor)


class RayAuthError(RuntimeError):
    """The cluster refused this client's Ray token (or the missing one)."""


def actor_name(deployment: str, role: str, index: int) -> str:
    return f"raypd-{deployment}-{role}-{index}"


def engine_id(deployment: str, role: str, index: int) -> str:
    return f"{deployment}-{role}-{index}"


def actor_name_of(deployment: str, engine: str) -> str:
    """The actor name of engine id `engine` (`<deployment>-<role>-<i>`)."""
    return f"raypd-{engine}"


@dataclass
class Deployment:
    """Handles of one deployment's actors."""

    name: str
    coordinator: Any
    prefills: dict[str, Any] = field(default_factory=dict)  # engine id -> EngineActor handle
    decodes: dict[str, Any] = field(default_factory=dict)
    start_info: dict[str, dict] = field(default_factory=dict)

    @property
    def engines(self) -> dict[str, Any]:
        return {**self.prefills, **self.decodes}


def init_ray(cfg: DeploymentConfig | None = None, address: str | None = None,
             temp_dir: str = DEFAULT_TEMP_DIR, log_to_driver: bool = False) -> bool:
    """Join `address` (or `cfg.ray.address`) or start a local cluster; True when we started it."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return False
    address = address or (cfg.ray.address if cfg is not None else None)
    if address:
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=log_to_driver)
        except (ConnectionError, RuntimeError) as exc:
            if not _refused_token(exc):
                raise
            raise RayAuthError(
                f"the Ray cluster at {address} refused this client's Ray token (missing or wrong; RAY_AUTH_MODE "
                f"here: {os.environ.get('RAY_AUTH_MODE', 'unset')}). An explicit address does not turn token mode "
                f"on by itself: set RAY_AUTH_MODE=token and provide the cluster's token in ~/.ray/auth_token, "
                f"RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN") from None
        return False
    num_cpus = (cfg.ray.num_cpus if cfg is not None else None) or 4
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, namespace=NAMESPACE,
             log_to_driver=log_to_driver)
    return True


def _refused_token(exc: BaseException) -> bool:
    """Did the GCS refuse our token? (ray.init reports it as a ConnectionError whose cause's text,
    not its type, carries the AuthenticationError.)"""
    from ray.exceptions import AuthenticationError

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, AuthenticationError) or "InvalidAuthToken" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def use_ray_token_auth() -> None:
    """Connect with Ray token authentication unless RAY_AUTH_MODE says otherwise.

    Ray reads RAY_AUTH_MODE into its config when it loads, so the config is
    refreshed the way Ray itself does it for a new local cluster.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()


def ray_auth_mode() -> str:
    """"token" or "disabled": the mode this (connected) process runs Ray with."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return "token" if is_token_auth_enabled() else "disabled"


def ray_logs_dir() -> str:
    """This node's Ray session log folder (engine and replica logs: worker-*.out / .err)."""
    node = ray._private.worker.global_worker.node
    return node.get_logs_dir_path()


def placement_group_name(deployment: str, role: str, index: int) -> str:
    return f"{actor_name(deployment, role, index)}-pg"


def engine_placement_group(cfg: DeploymentConfig, role: str, index: int) -> Any:
    """One STRICT_PACK placement group per engine: the engine and every rank it starts share a node.

    The bundle carries the group's custom resources (e.g. `prefill: 1`), which is how
    prefill and decode pools are pinned to labelled nodes.
    """
    from ray.util.placement_group import get_placement_group, placement_group

    name = placement_group_name(cfg.name, role, index)
    try:
        return get_placement_group(name)
    except ValueError:
        pass
    ecfg = cfg.engine_config(role, index)
    bundle = {"CPU": max(ecfg.num_cpus, 0.01), **ecfg.resources}
    return placement_group([bundle], strategy="STRICT_PACK", name=name, lifetime="detached")


def _engine_handle(cfg: DeploymentConfig, role: str, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ecfg = cfg.engine_config(role, index, engine_id(cfg.name, role, index))
    # Ray restarts a crashed engine (bounded) in the same placement group: the group is the
    # engine's, not the process's, so a restart reuses it and strands nothing.
    opts = {k: v for k, v in engine_actor_options(ecfg, cfg.restarts.max_restarts).items() if v is not None}
    opts["num_cpus"] = max(ecfg.num_cpus, 0.01)
    opts.pop("resources", None)  # they are in the bundle
    pg = engine_placement_group(cfg, role, index)
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0,
                                                placement_group_capture_child_tasks=True)
    return _Engine.options(
        name=actor_name(cfg.name, role, index), namespace=NAMESPACE, lifetime="detached",
        get_if_exists=True, scheduling_strategy=strategy, **opts,
    ).remote(ecfg.model_dump(), COORDINATOR_NAME)


def default_start_timeout(cfg: DeploymentConfig) -> float:
    return 120.0 if cfg.backend == "synthetic" else 1200.0


def launch(cfg: DeploymentConfig, timeout_s: float | None = None,
           on_phase: Callable[[StartPhase], None] | None = None) -> Deployment:
    """Get or create the coordinator and every engine of `cfg`, and start them. Blocking.

    `on_phase` is called once per engine per start-up phase while the engines start.
    """
    restarts = cfg.restarts
    coordinator = start_coordinator(detached=True, on_head_node=True, max_restarts=restarts.max_restarts,
                                    breaker=cfg.breaker.model_dump(),
                                    handoff_deadline_s=cfg.transfer.handoff_deadline_s,
                                    hang_check_s=restarts.probe_interval_s, ping_timeout_s=restarts.probe_timeout_s)
    ray.get(coordinator.configure.remote(cfg.breaker.model_dump(), cfg.transfer.handoff_deadline_s,
                                         restarts.probe_interval_s, restarts.probe_timeout_s), timeout=60)
    if cfg.autoscaler.enabled:
        from serving.cluster.autoscaler import attach

        joined = attach(cfg, coordinator)
        if joined is not None:
            return joined
    dep = Deployment(cfg.name, coordinator)
    pgs = [engine_placement_group(cfg, role, i) for role in ROLES for i in range(getattr(cfg, role).count)]
    try:
        ray.get([pg.ready() for pg in pgs], timeout=timeout_s or default_start_timeout(cfg))
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"no node offers the resources of {cfg.name!r}'s engines (bundles: "
            f"{[pg.bundle_specs for pg in pgs]}); check the node labels/resources"
        ) from None
    for role in ROLES:
        group = getattr(cfg, role)
        for i in range(group.count):
            handles = dep.prefills if role == "prefill" else dep.decodes
            handles[engine_id(cfg.name, role, i)] = _engine_handle(cfg, role, i)
    timeout_s = timeout_s or default_start_timeout(cfg)
    t0 = time.monotonic()
    refs = {eid: h.start.remote() for eid, h in dep.engines.items()}
    try:
        if on_phase is not None:
            _report_phases(dep, list(refs.values()), t0 + timeout_s, on_phase)
        infos = ray.get(list(refs.values()), timeout=max(1.0, t0 + timeout_s - time.monotonic()))
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"engines of {cfg.name!r} did not start within {timeout_s:.0f}s") from None
    dep.start_info = dict(zip(refs, infos))
    logger.info("deployment %s: %d engines up in %.1fs", cfg.name, len(refs), time.monotonic() - t0)
    if cfg.autoscaler.enabled:
        from serving.cluster.autoscaler import start_autoscaler

        start_autoscaler(cfg)
    return dep


def _report_phases(dep: Deployment, starts: list, deadline: float, on_phase: Callable[[StartPhase], None]) -> None:
    """Poll the engines' start-up phases until every start() returned (or the deadline)."""
    seen: set[tuple[str, str, float]] = set()
    polls: dict[str, Any] = {}
    pending, final = list(starts), False
    while True:
        for eid, handle in dep.engines.items():
            if eid not in polls:  # at most one poll in flight per engine (a busy node answers late)
                polls[eid] = handle.start_phases.options(concurrency_group=STARTUP_GROUP).remote()
        ready, _ = ray.wait(list(polls.values()), num_returns=len(polls), timeout=5.0 if final else PHASE_POLL_S / 2)
        for eid, ref in list(polls.items()):
            if ref not in ready:
                continue
            del polls[eid]
            try:
                phases = ray.get(ref)
            except ray.exceptions.RayError:
                continue  # the start ref reports the engine's failure
            for phase in phases:
                if (phase.engine_id, phase.phase, phase.at) not in seen:
                    seen.add((phase.engine_id, phase.phase, phase.at))
                    on_phase(phase)
        if final or time.monotonic() > deadline:
            return
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=PHASE_POLL_S / 2)
        final = not pending  # one last poll shows the last phases


def _remove_placement_groups(name: str) -> None:
    from ray.util.placement_group import get_placement_group, remove_placement_group

    prefix = f"raypd-{name}-"
    for info in ray.util.placement_group_table().values():
        pg_name = info.get("name") or ""
        if pg_name.startswith(prefix) and pg_name.endswith("-pg") and info.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(pg_name))
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


def shutdown_deployment(name: str, keep_coordinator: bool = False, timeout_s: float = 20.0) -> list[str]:
    """Shut down and kill deployment `name`'s engines, then the coordinator if nothing else uses it.

    Returns the actor names that were stopped.
    """
    from serving.cluster.autoscaler import stop_autoscaler

    stop_autoscaler(name)  # first: it must not start or drain engines while they go
    engines = find_engines(name)
    refs = {n: h.shutdown.remote() for n, h in engines.items()}
    if refs:
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                logger.warning("engine shutdown failed: %s", exc)
    for h in engines.values():
        try:
            ray.kill(h)
        except Exception as exc:  # noqa: BLE001 - already gone
            logger.info("kill: %s", exc)
    _remove_placement_groups(name)
    if not keep_coordinator:
        try:
            coordinator = ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
        except ValueError:
            coordinator = None
        if coordinator is not None:
            try:
                others = ray.get(coordinator.engines.remote(), timeout=10)
            except ray.exceptions.RayError:
                others = []
            mine = {engine_id(name, r, 0).rsplit("-", 1)[0] for r in ROLES}
            others = [e for e in others if e.engine_id.rsplit("-", 1)[0] not in mine]
            if others:
                logger.info("keeping the coordinator: %d other engines still registered", len(others))
            else:
                ray.kill(coordinator)
    return sorted(engines)


# ------------------------------------------------- one engine at a time (the autoscaler)
class Unschedulable(RuntimeError):
    """No node offers the resources of one more engine of this role."""


async def start_engine(cfg: DeploymentConfig, role: str, index: int, timeout_s: float,
                       place_timeout_s: float = 60.0) -> Any:
    """Create and start engine `index` of `role` in its own placement group; nothing is left behind
    when it cannot be placed (within `place_timeout_s`) or does not start (within `timeout_s`)."""
    from ray.util.placement_group import remove_placement_group

    pg = engine_placement_group(cfg, role, index)
    try:
        await asyncio.wait_for(pg.ready(), place_timeout_s)
    except asyncio.TimeoutError:
        remove_placement_group(pg)
        raise Unschedulable(f"no node offers {pg.bundle_specs} for {role} engine {index}") from None
    handle = _engine_handle(cfg, role, index)
    try:
        await asyncio.wait_for(handle.start.remote(), timeout_s)
    except BaseException:
        ray.kill(handle)
        remove_placement_group(pg)
        raise
    return handle


async def stop_engine(cfg: DeploymentConfig, engine: str, handle: Any | None, timeout_s: float = 30.0) -> None:
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
        remove_placement_group(get_placement_group(f"{actor_name_of(cfg.name, engine)}-pg"))  # = placement_group_name
    except ValueError:
        pass
