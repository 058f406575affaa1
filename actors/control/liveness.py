"""Who decides that an engine is hung, and what happens then: the coordinator's liveness probes.

Deaths are events (the coordinator's pending `watch()` calls fail at once); a hang is not:
a frozen process (SIGSTOP, a wedged driver call, a livelocked worker) keeps its sockets, so
nothing fails, it just never answers. So the coordinator probes:

  sweep      every `interval_s`, every registered engine is pinged once;
  reported   a router that saw an engine miss a deadline says so (`Coordinator.engine_hung`,
             fire and forget); that incarnation is probed at once (one probe per incarnation
             however many routers report it);
  probe      `ping()` with a timeout (`timeout_s`): a SIGSTOPped actor cannot answer, so the
             timeout is the evidence. An engine actor that answers checks its own engine core
             behind it (vLLM's: a utility call through the core's busy loop) and answers with
             the problem when the core is stuck;
  strikes    a probe the sweep started is routine, and one slow answer from a healthy engine on
             busy cores (a starved process, a long step) must not kill it with its streams: the
             sweep decides after `failure_threshold` consecutive failed probes of one incarnation
             (as Serve's replica health check and Kubernetes' liveness probe count failures);
             an answer resets the count. A router's report is evidence of its own (a missed
             deadline), so a reported incarnation is decided by the probe it triggers;
  verdict    no answer, or a stuck core, reported or `failure_threshold` times in a row: hung.
             The incarnation is evicted as a dead one (its
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
from dataclasses import dataclass
from typing import Any

import ray

from actors.control.registry import EngineEntry

logger = logging.getLogger("raypd.coordinator")

PONG = "pong"


def kill_for_restart(handle: Any) -> None:
    """Kill the actor so that Ray restarts it (a SIGSTOPped process is killed too)."""
    ray.kill(handle, no_restart=False)


@dataclass
class _Probe:
    """One probe of one incarnation in flight, and whether a router reported it meanwhile."""
    reported: str | None
    task: asyncio.Task | None = None


class Liveness:
    def __init__(self, remove: Callable[[EngineEntry, str], Awaitable[None]], timeout_s: float = 10.0,
                 interval_s: float = 10.0, kill: Callable[[Any], None] = kill_for_restart,
                 failure_threshold: int = 2):
        self.remove = remove  # evict an incarnation as dead (the coordinator's `_remove`)
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.failure_threshold = failure_threshold
        self.kill = kill
        self.hangs: Counter[str] = Counter()
        self._probes: dict[tuple[str, int], _Probe] = {}  # (engine, generation) -> its probe
        self._strikes: Counter[tuple[str, int]] = Counter()  # failed probes in a row, per incarnation

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
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = _Probe(reported)
            probe.task = asyncio.get_running_loop().create_task(self._judge(entry, live, probe))
            probe.task.add_done_callback(lambda _: self._probes.pop(key, None))
        elif probe.reported is None:
            probe.reported = reported  # a report during a sweep's probe: that probe decides it
        return await asyncio.shield(probe.task)

    async def _judge(self, entry: EngineEntry, live: Callable[[], bool], probe: _Probe) -> str | None:
        key = (entry.engine_id, entry.generation)
        problem = await self.probe(entry)
        reported = probe.reported
        if problem is None:
            self._strikes.pop(key, None)
            if reported is not None:
                logger.info("engine %s (generation %d) was reported hung (%s) but answers its probe",
                            entry.engine_id, entry.generation, reported)
            return None
        kind, why = problem
        if not live():  # evicted or replaced while we probed: nothing left to do
            self._strikes.pop(key, None)
            return kind
        if kind == "died":
            self._strikes.pop(key, None)
            logger.warning("engine %s (generation %d) is dead: %s", entry.engine_id, entry.generation, why)
            await self.remove(entry, why)
            return kind
        self._strikes[key] += 1
        strikes = self._strikes[key]
        if reported is None and strikes < self.failure_threshold:
            logger.warning("engine %s (generation %d) failed a probe (%s): %d of %d in a row decide it is hung",
                           entry.engine_id, entry.generation, why, strikes, self.failure_threshold)
            return None
        self._strikes.pop(key, None)
        reason = f"hung: {why}" + (f" (reported: {reported})" if reported else f" ({strikes} probes in a row)")
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
        """Probe every engine once; the ids of those found hung (the last of `failure_threshold`
        failed probes in a row) or dead."""
        current = {(e.engine_id, e.generation) for e in entries}
        for key in [k for k in self._strikes if k not in current]:  # incarnations gone meanwhile
            del self._strikes[key]
        verdicts = await asyncio.gather(*(self.judge(e, lambda e=e: live(e)) for e in entries))
        return [e.engine_id for e, v in zip(entries, verdicts) if v is not None]
