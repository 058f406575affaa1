"""The launcher: the one owner of a deployment's engine start-up (and, when enabled, its scaling).

One named, detached `Launcher` actor per deployment (`raypd-<deployment>-launcher`). Invariants:
nobody else creates engines; concurrent and later launches wait for the same launch and get the
same `Deployment`; with the autoscaler on, a later launch attaches to the engines serving now; a
restarted launcher finds the engines by name. The life cycle of a deployment: `Launcher`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from actors.control.coordinator_actor import start_coordinator
from actors.engine.startup import StartPhase
from serving.cluster.autoscaler import Autoscaler, AutoscalerStatus
from serving.cluster.engines import (
    Deployment,
    default_start_timeout,
    engine_placement_group,
    find_engines,
    handle_of,
    remove_placement_groups,
    report_phases,
    start_engine,
    startup_deadline,
    stop_engine,
)
from serving.cluster.node_loss import NodeLossEvent, NodeLossWatch
from serving.cluster.names import COORDINATOR_NAME, NAMESPACE, ROLES, engine_id, engine_index, launcher_name
from serving.config import DeploymentConfig
from serving.placement_config import MeasuredRates

logger = logging.getLogger("raypd.launcher")


def engine_groups(cfg: DeploymentConfig) -> list[tuple[str, int]]:
    """(role, count) of every engine group the deployment asks for."""
    return [(role, group.count) for role in ROLES if (group := getattr(cfg, role, None)) is not None and group.count]


class Launcher:
    """Life cycle of a deployment:

      1. launch    `launch(cfg)` (`raypd up`, tests) and `attach(cfg)` (every ingress
                   replica) get or create the launcher and await its `launch()`: the
                   first call gets or creates the coordinator, every engine's placement
                   group and actor, and starts them; concurrent and later calls wait for
                   that same launch and get the same `Deployment`. Nobody else creates
                   engines;
      2. scale     with `autoscaler.enabled` the launcher runs the autoscaler's loop
                   (`serving.cluster.autoscaler`), which starts and stops engines through
                   the launcher's own `start_engine` / `stop_engine`; a later launch
                   (another replica, a restarted launcher) then attaches to the engines
                   serving now instead of creating `count` of them;
      3. recover   the launcher restarts (bounded) like the coordinator; its next launch
                   finds the engines by name (`get_if_exists`); an engine whose node died is
                   started again as a new placement group (`serving.cluster.node_loss`);
      4. shutdown  `shutdown_deployment(name)` stops the loop, then the engines, their
                   placement groups, the launcher and, when no other deployment's engine
                   is registered, the coordinator.
    """

    def __init__(self, config: dict):
        self.cfg = DeploymentConfig.from_dict(config)
        self._launch: asyncio.Task | None = None
        self.autoscaler: Autoscaler | None = None
        self._failed_phases: list[StartPhase] = []  # start-up phases of engines whose start failed
        self.startup = startup_deadline(self.cfg)  # how long a start may take: follows the starts measured
        self.measured_start_s: float | None = None  # the longest start this launcher measured
        self.node_loss = NodeLossWatch(self.cfg.name, self.start_engine)  # engines whose node died

    async def failed_phases(self) -> list[StartPhase]:
        """Start-up phases of engines whose start failed (their actors are gone)."""
        return list(self._failed_phases)

    async def launch(self) -> Deployment:
        """The deployment, launched once (see the module docstring); a failed launch is tried again."""
        if self._launch is None or (self._launch.done() and self._launch.exception() is not None):
            self._launch = asyncio.get_running_loop().create_task(self._launch_once())
        return await asyncio.shield(self._launch)

    async def _launch_once(self) -> Deployment:
        cfg = self.cfg
        restarts = cfg.restarts
        # a restarted engine must register again within this (the coordinator kills a stranded restart)
        coordinator = start_coordinator(detached=True, on_head_node=True, max_restarts=restarts.max_restarts,
                                        breaker=cfg.breaker.model_dump(),
                                        handoff_deadline_s=cfg.transfer.handoff_deadline_s,
                                        hang_check_s=restarts.probe_interval_s,
                                        ping_timeout_s=restarts.probe_timeout_s,
                                        probe_failure_threshold=restarts.probe_failure_threshold,
                                        startup=self.startup)
        await asyncio.wait_for(coordinator.configure.remote(cfg.breaker.model_dump(), cfg.transfer.handoff_deadline_s,
                                                            restarts.probe_interval_s, restarts.probe_timeout_s,
                                                            restarts.probe_failure_threshold, startup=self.startup), 60)
        dep = await self._serving_pools(coordinator) if cfg.autoscaler.enabled else None
        if dep is None:
            dep = await self._start_all(coordinator)
        if cfg.autoscaler.enabled and self.autoscaler is None:
            self.autoscaler = Autoscaler(cfg, self)
            self.autoscaler.start()
        self.node_loss.run()
        return dep

    async def _start_all(self, coordinator: Any) -> Deployment:
        """Every engine of the config, placed, created and started (in parallel)."""
        cfg = self.cfg
        timeout_s = default_start_timeout(cfg)
        wanted = [(role, i) for role, count in engine_groups(cfg) for i in range(count)]
        pgs = [engine_placement_group(cfg, role, i) for role, i in wanted]
        try:
            await asyncio.wait_for(asyncio.gather(*(pg.ready() for pg in pgs)), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no node offers the resources of {cfg.name!r}'s engines (bundles: "
                               f"{[pg.bundle_specs for pg in pgs]}); check the node labels/resources") from None
        t0 = time.monotonic()
        handles = await asyncio.gather(*(start_engine(cfg, role, i, timeout_s, on_failed=self._failed_phases.extend)
                                         for role, i in wanted))
        dep = Deployment(cfg.name, coordinator)
        for (role, i), handle in zip(wanted, handles):
            dep.add(role, engine_id(cfg.name, role, i), handle)
        self._measured(time.monotonic() - t0)  # (in parallel: the longest start)
        logger.info("deployment %s: %d engines up in %.1fs", cfg.name, len(wanted), time.monotonic() - t0)
        return dep

    def _measured(self, start_s: float) -> None:
        self.measured_start_s = max(start_s, self.measured_start_s or 0.0)

    async def _serving_pools(self, coordinator: Any) -> Deployment | None:
        """Once the autoscaler owns the pool sizes, the engines serving now (None before any served:
        the first launch starts `count` of each)."""
        dep = Deployment(self.cfg.name, coordinator)
        for e in await coordinator.engines.remote():
            for role in ROLES:
                if engine_index(self.cfg.name, role, e.engine_id) is not None and not e.draining:
                    handle = handle_of(e.engine_id)
                    if handle is not None:
                        dep.add(role, e.engine_id, handle)
        return dep if dep.decodes else None

    # ------------------------------------------------ the autoscaler's hands
    async def start_engine(self, role: str, index: int, measured: MeasuredRates | None = None) -> Any:
        """The autoscaler's start: within the start-up deadline derived from the starts measured so far."""
        t0 = time.monotonic()
        timeout_s = self.startup.derive(self.measured_start_s)
        handle = await start_engine(self.cfg, role, index, timeout_s, measured=measured)
        self._measured(time.monotonic() - t0)
        return handle

    async def stop_engine(self, engine: str) -> None:
        await stop_engine(engine, handle_of(engine))

    # ---------------------------------------------------------------- status
    async def node_loss_events(self) -> list[NodeLossEvent]:
        """The last steps of replacing engines whose node died (`serving.cluster.node_loss`)."""
        return list(self.node_loss.events)

    async def autoscaling(self) -> bool:
        return self.autoscaler is not None

    async def status(self) -> AutoscalerStatus | None:
        return await self.autoscaler.status() if self.autoscaler is not None else None

    async def stop(self) -> None:
        """Stop deciding (before the deployment is torn down); drains in progress are left to shutdown."""
        self.node_loss.stop()
        if self.autoscaler is not None:
            self.autoscaler.stop()


# ------------------------------------------------------------ driver side
def launcher_options(cfg: DeploymentConfig) -> dict[str, Any]:
    """Ray options of the launcher actor (and so of the autoscaler inside it): restarted by Ray like
    every raypd actor, at most `restarts.max_restarts` times."""
    return dict(name=launcher_name(cfg.name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_concurrency=64, max_restarts=cfg.restarts.max_restarts,
                resources={"node:__internal_head__": 0.001})  # beside the coordinator: lives as long as the cluster


def _launcher(cfg: DeploymentConfig) -> Any:
    return ray.remote(Launcher).options(**launcher_options(cfg)).remote(cfg.model_dump(mode="json"))


def launch(cfg: DeploymentConfig, timeout_s: float | None = None,
           on_phase: Callable[[StartPhase], None] | None = None) -> Deployment:
    """Get or create the deployment's launcher and wait for its launch. Blocking.

    `on_phase` is called once per engine per start-up phase while the engines start.
    """
    timeout_s = timeout_s or default_start_timeout(cfg)
    launcher = _launcher(cfg)
    ref = launcher.launch.remote()
    deadline = time.monotonic() + timeout_s
    seen = set()
    if on_phase is not None:
        seen = report_phases(cfg.name, lambda: bool(ray.wait([ref], timeout=0)[0]), deadline, on_phase)
    try:
        return ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"engines of {cfg.name!r} did not start within {timeout_s:.0f}s") from None
    except ray.exceptions.RayTaskError as exc:
        if on_phase is not None:  # a failed engine's last phases: its actor was gone before the last poll
            for phase in ray.get(launcher.failed_phases.remote(), timeout=30):
                if (phase.engine_id, phase.phase, phase.at) not in seen:
                    on_phase(phase)
        raise exc.as_instanceof_cause() from None


async def attach(cfg: DeploymentConfig) -> Deployment:
    """An ingress replica's way in: the launched deployment (launched now if nobody did yet)."""
    return await _launcher(cfg).launch.remote()


def find_launcher(name: str) -> Any | None:
    try:
        return ray.get_actor(launcher_name(name), namespace=NAMESPACE)
    except ValueError:
        return None


def find_autoscaler(name: str) -> Any | None:
    """The launcher of `name` when it runs an autoscaler (its `status()` is the autoscaler's), else None."""
    handle = find_launcher(name)
    if handle is None:
        return None
    try:
        return handle if ray.get(handle.autoscaling.remote(), timeout=10) else None
    except ray.exceptions.RayError:
        return None


def shutdown_deployment(name: str, keep_coordinator: bool = False, timeout_s: float = 20.0) -> list[str]:
    """Shut down and kill deployment `name`'s engines, its launcher, then the coordinator if nothing
    else uses it. Returns the engine actor names that were stopped."""
    launcher = find_launcher(name)
    if launcher is not None:  # first: it must not start or drain engines while they go
        try:
            ray.get(launcher.stop.remote(), timeout=timeout_s)
        except ray.exceptions.RayError as exc:
            logger.info("launcher stop: %s", exc)
        ray.kill(launcher)
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
    remove_placement_groups(name)
    if not keep_coordinator:
        _stop_coordinator_unless_shared(name)
    return sorted(engines)


def _stop_coordinator_unless_shared(name: str) -> None:
    try:
        coordinator = ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return
    try:
        others = ray.get(coordinator.engines.remote(), timeout=10)
    except ray.exceptions.RayError:
        others = []
    others = [e for e in others if not any(engine_index(name, r, e.engine_id) is not None for r in ROLES)]
    if others:
        logger.info("keeping the coordinator: %d other engines still registered", len(others))
    else:
        ray.kill(coordinator)
