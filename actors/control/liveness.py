"""Who decides that an engine is hung, and what happens then: the coordinator's liveness probes.

Deaths are events (the coordinator's pending `watch()` calls fail at once); a hang is not:
a frozen process (SIGSTOP, a wedged driver call, a livelocked worker) keeps its sockets, so
nothing fails, it just never answers. So the coordinator probes:

  sweep      every `interval_s`, every registered engine is pinged once;
  reported   a router that saw an engine miss a deadline says so (`Coordinator.engine_hung`,
             fire and forget); that incarnation is probed at once (one probe per incarnation
             however many routers report it);
  probe      `ping()` with a timeout (`timeout_s`): a SIGSTOPped actor cannot answer, so the
             timeout is the verdict. An engine actor that answers checks its own engine core
             behind it (vLLM's: a utility call through the core's busy loop) and answers with
             the problem when the core is stuck;
  verdict    no answer, or a stuck core: hung. The incarnation is evicted as a dead one (its
             pairs' breakers open in the ledger, its handoffs end, decode engines drop its
             agents) and its actor is killed with `ray.kill(no_restart=False)`, so that Ray
             restarts it (within `restarts.max_restarts`; a restart it has no budget left for
             leaves it dead, as a crash would) as a new incarnation that registers by itself.
             A probe that finds the actor gone is a death (evicted, not killed: Ray restarts it).

Counted per engine (`hangs`, exported as `raypd_engine_hangs_total` with the routes).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from actors.control.registry import EngineEntry

logger = logging.getLogger("raypd.coordinator")

PONG = "pong"


def kill_for_restart(handle: Any) -> None:
    """Kill the actor so that Ray restarts it (a SIGSTOPped process is killed too)."""
    ray.kill(handle, no_restart=False)


class Liveness:
    def __init__(self, remove: Callable[[EngineEntry, str], Awaitable[None]], timeout_s: float = 10.0,
                 interval_s: float = 10.0, kill: Callable[[Any], None] = kill_for_restart):
        self.remove = remove  # evict an incarnation as dead (the coordinator's `_remove`)
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.kill = kill
        self.hangs: Counter[str] = Counter()
        self._probes: dict[tuple[str, int], asyncio.Task] = {}  # (engine, generation) -> its probe

    async def probe(self, entry: EngineEntry) -> tuple[str, str] | None:
        """None when the engine answered; else ("hung" | "died", why)."""
        try:
            answer = await asyncio.wait_for(entry.handles[0].ping.remote(), self.timeout_s)
        except asyncio.TimeoutError:
            return "hung", f"no answer to a ping in {self.timeout_s:.0f} s"
        except ray.exceptions.RayError as exc:
            return "died", f"actor died ({type(exc).__name__})"
        if answer != PONG:
            return "hung", str(answer)
        return None

    async def judge(self, entry: EngineEntry, live: Callable[[], bool], reported: str | None = None) -> str | None:
        """Probe one incarnation (once, however many ask) and act on the verdict; returns it."""
        key = (entry.engine_id, entry.generation)
        task = self._probes.get(key)
        if task is None:
            task = self._probes[key] = asyncio.get_running_loop().create_task(self._judge(entry, live, reported))
            task.add_done_callback(lambda _: self._probes.pop(key, None))
        return await asyncio.shield(task)

    async def _judge(self, entry: EngineEntry, live: Callable[[], bool], reported: str | None) -> str | None:
        problem = await self.probe(entry)
        if problem is None:
            if reported is not None:
                logger.info("engine %s (generation %d) was reported hung (%s) but answers its probe",
                            entry.engine_id, entry.generation, reported)
            return None
        kind, why = problem
        if not live():  # evicted or replaced while we probed: nothing left to do
            return kind
        if kind == "died":
            logger.warning("engine %s (generation %d) is dead: %s", entry.engine_id, entry.generation, why)
            await self.remove(entry, why)
            return kind
        reason = f"hung: {why}" + (f" (reported: {reported})" if reported else "")
        logger.warning("engine %s (generation %d) is %s; evicting it and killing it so that Ray restarts it",
                       entry.engine_id, entry.generation, reason)
        self.hangs[entry.engine_id] += 1
        await self.remove(entry, reason)
        try:
            self.kill(entry.handles[0])
        except Exception as exc:  # noqa: BLE001 - already gone: nothing to restart
            logger.warning("killing hung engine %s failed: %s", entry.engine_id, exc)
        return kind

    async def sweep(self, entries: list[EngineEntry], live: Callable[[EngineEntry], bool]) -> list[str]:
        """Probe every engine once; the ids of those found hung or dead."""
        verdicts = await asyncio.gather(*(self.judge(e, lambda e=e: live(e)) for e in entries))
        return [e.engine_id for e, v in zip(entries, verdicts) if v is not None]
