"""Engines whose node died: started again as new placement groups, not left for Ray to reschedule.

Every engine lives in a one-bundle placement group (`serving.cluster.engines`). When its node dies,
Ray marks the group RESCHEDULING. While no node offers the bundle, Ray 2.60's GCS tries such a group
again on every pass of its scheduler (ray-project/ray#65007): a busy loop on the GCS's one thread,
which then starves its health checks and RPCs, and floods the head's metrics agent. A new group that
cannot be placed waits PENDING with back-off instead. So the launcher watches its engines' groups:

  1. watch     every `interval_s`, the deployment's groups in Ray's placement group table;
  2. replace   a RESCHEDULING group is removed, and the engine's actor killed for good: Ray keeps an
               actor it is restarting (RESTARTING) after its group went, bound to that group, and
               the start below would get it back by name (`get_if_exists`) and wait on it until
               its start-up deadline (docs/multi-node.md). Its node is gone, so is everything the
               incarnation held there;
  3. restart   the engine is started again as a new group and actor (`start`: the launcher's own
               start, which waits up to a minute for a node to offer the group, then its start-up
               deadline), tried again `retry_s` (5 s) after a failed start, until it starts or the
               watch stops (a node that returns just after a failed wait costs at most that gap).

Invariants: one replacement per engine at a time; a group in any other state is left alone; the
watch never blocks its event loop on Ray (table reads run in a thread).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from serving.cluster.names import NAMESPACE, ROLES, actor_name_of, engine_id, engine_index, placement_group_name

logger = logging.getLogger("raypd.launcher")

RESCHEDULING = "RESCHEDULING"


@dataclass(frozen=True)
class NodeLossEvent:
    """One step of an engine's replacement: replaced, starting, started or start_failed (why)."""

    t: float  # wall clock (time.time())
    engine: str
    step: str
    detail: str = ""


def engines_to_replace(table: Mapping[str, Mapping[str, Any]], deployment: str) -> list[tuple[str, int]]:
    """(role, index) of the deployment's engines whose group Ray is rescheduling (its node died).
    `table`: `ray.util.placement_group_table()`."""
    found = []
    for info in table.values():
        engine = _engine_of(info.get("name") or "") if info.get("state") == RESCHEDULING else None
        for role in ROLES if engine else ():
            index = engine_index(deployment, role, engine)
            if index is not None:
                found.append((role, index))
    return sorted(found)


def _engine_of(pg_name: str) -> str | None:
    """The engine id of a group named by `placement_group_name`, None for any other group."""
    head, tail = actor_name_of(""), "-pg"
    return pg_name[len(head):-len(tail)] if pg_name.startswith(head) and pg_name.endswith(tail) else None


class NodeLossWatch:
    """The launcher's watch over its engines' placement groups (see the module docstring)."""

    def __init__(self, deployment: str, start: Callable[[str, int], Awaitable[Any]],
                 table: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
                 remove: Callable[[str], None] | None = None, kill: Callable[[str], None] | None = None,
                 interval_s: float = 5.0, retry_s: float = 5.0):
        self.deployment = deployment
        self.start = start
        self.table = table or _ray_table
        self.remove = remove or _remove_group
        self.kill = kill or _kill_actor
        self.interval_s, self.retry_s = interval_s, retry_s
        self.replacing: dict[tuple[str, int], asyncio.Task] = {}
        self.replaced = 0  # groups removed because their node died
        self.restarted = 0  # engines started again after that
        self.events: list[NodeLossEvent] = []  # the last 100 steps of replacements, for status and benchmarks
        self._task: asyncio.Task | None = None

    def _note(self, engine: str, step: str, detail: str = "") -> None:
        self.events.append(NodeLossEvent(time.time(), engine, step, detail))
        del self.events[:-100]

    def run(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        for task in [self._task, *self.replacing.values()]:
            if task is not None:
                task.cancel()
        self._task = None

    async def check(self) -> list[tuple[str, int]]:
        """One look at the table: the engines whose replacement started now."""
        table = await asyncio.to_thread(self.table)
        started = []
        for key in engines_to_replace(table, self.deployment):
            if key not in self.replacing:
                self.replacing[key] = asyncio.get_running_loop().create_task(self._replace(*key))
                started.append(key)
        return started

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception as exc:  # noqa: BLE001 - the GCS may be away for a moment: look again later
                logger.info("placement group table unavailable: %s", exc)

    async def _replace(self, role: str, index: int) -> None:
        engine = engine_id(self.deployment, role, index)
        try:
            logger.warning("engine %s: its node died (placement group rescheduling); removing the group and "
                           "starting the engine again as a new one", engine)
            await asyncio.to_thread(self.remove, placement_group_name(engine))
            await asyncio.to_thread(self.kill, actor_name_of(engine))
            self.replaced += 1
            self._note(engine, "replaced")
            while True:
                try:
                    self._note(engine, "starting")
                    await self.start(role, index)
                    self.restarted += 1
                    self._note(engine, "started")
                    logger.info("engine %s started again after its node died", engine)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - no node offers it yet: later
                    self._note(engine, "start_failed", f"{type(exc).__name__}: {str(exc)[:200]}")
                    logger.warning("engine %s not started again (%s); next try in %.0f s", engine, exc, self.retry_s)
                    await asyncio.sleep(self.retry_s)
        finally:
            self.replacing.pop((role, index), None)


def _ray_table() -> Mapping[str, Mapping[str, Any]]:
    import ray

    return ray.util.placement_group_table()


def _remove_group(name: str) -> None:
    from ray.util.placement_group import get_placement_group, remove_placement_group

    try:
        remove_placement_group(get_placement_group(name))
    except ValueError:
        pass  # gone already


def _kill_actor(name: str) -> None:
    import ray

    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass  # gone already
