"""Who decides that an engine is hung, and what happens then: the coordinator's liveness probes.

Deaths are events (the coordinator's pending `watch()` calls fail at once); a hang is not: a frozen
process keeps its sockets and never answers. So the coordinator probes: a sweep every
`interval_s`, and at once when a router reports a missed deadline. Invariants: an engine is hung
only when it makes no progress (an engine heard from meanwhile is busy, not frozen), and only after
`failure_threshold` failed probes in a row; a hung incarnation is evicted as a dead one and killed
so that Ray restarts it. Counted per engine (`raypd_engine_hangs_total`). The rules: `Liveness`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray

from actors.control.registry import EngineEntry
from actors.protocol.registration import EngineInfo

logger = logging.getLogger("raypd.coordinator")

PONG = "pong"


def kill_for_restart(handle: Any) -> None:
    """Kill the actor so that Ray restarts it."""
    ray.kill(handle, no_restart=False)


@ray.remote(num_cpus=0, max_retries=0)
def _sigkill_engine_actor(pid: int) -> bool:
    """On the engine's node: SIGKILL `pid` if it is still an engine actor's worker process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read().startswith(b"ray::EngineActor"):
                return False  # gone, or the pid is another process's now
        os.kill(pid, signal.SIGKILL)
        return True
    except (OSError, ProcessLookupError):
        return False


def sigkill_on_node(info: EngineInfo) -> None:
    """Make sure a hung engine's process dies: Ray's kill goes through the actor's own RPC server,
    and a frozen (SIGSTOPped) process whose server no longer accepts connections was seen to survive
    it (the GCS took the failed RPC for a dead node and gave up) until the start-up deadline. A
    task on the engine's node SIGKILLs the process; Ray then restarts the actor as after a crash."""
    if not (info.pid and info.node_id and ray.is_initialized()):
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(info.node_id, soft=False)
    _sigkill_engine_actor.options(scheduling_strategy=strategy).remote(info.pid)  # fire and forget


@dataclass
class _Probe:
    """One probe of one incarnation in flight, and whether a router reported it meanwhile."""
    reported: str | None
    task: asyncio.Task | None = None


class Liveness:
    """The coordinator's probes of every registered engine:

      sweep      every `interval_s`, every registered engine is pinged once;
      reported   a router that saw an engine miss a deadline says so (`Coordinator.engine_hung`,
                 fire and forget); that incarnation is probed at once (one probe per incarnation
                 however many routers report it);
      probe      `ping()` with a timeout (`timeout_s`): a SIGSTOPped actor cannot answer, so the
                 timeout is the evidence. An engine actor that answers checks its own engine core
                 behind it (vLLM's: a utility call through the core's busy loop) and answers with
                 the problem when the core is stuck;
      evidence   an engine is hung only when it makes no progress: a probe that times out while the
                 engine called the coordinator meanwhile (its rates, KV events, ledger records: `heard`) found a
                 busy engine, not a frozen one, and is no failure; an engine actor whose core is slow to
                 answer says "pong" when the core stepped while it waited (`EngineActor.ping`);
      strikes    one slow answer from a healthy engine on busy cores (a starved process, a long step)
                 must not kill it with its streams: an incarnation is judged hung after
                 `failure_threshold` failed probes in a row, the same for a router's report and the
                 sweep (as Serve's replica health check and Kubernetes' liveness probe count failures);
                 an answer resets the count. The sweep's probes are `interval_s` apart; a router's report
                 (a missed deadline: its own evidence of silence) probes again at once after a failure,
                 so a reported hang is decided within `failure_threshold` x `timeout_s`;
      verdict    no answer, or a stuck core, `failure_threshold` times in a row: hung.
                 The incarnation is evicted as a dead one (its
                 pairs' breakers open in the ledger, its handoffs end, decode engines drop its
                 agents) and its actor is killed with `ray.kill(no_restart=False)` and its process SIGKILLed on
                 its node (`sigkill_on_node`: Ray's kill did not reach a frozen one), so that Ray
                 restarts it (within `restarts.max_restarts`; a restart it has no budget left for
                 leaves it dead, as a crash would) as a new incarnation that registers by itself.
                 A probe that finds the actor gone is a death (evicted, not killed: Ray restarts it).

    Counted per engine (`hangs`, exported as `raypd_engine_hangs_total` with the routes).
    """

    def __init__(self, remove: Callable[[EngineEntry, str], Awaitable[None]], timeout_s: float = 10.0,
                 interval_s: float = 10.0, kill: Callable[[Any], None] = kill_for_restart,
                 failure_threshold: int = 2, clock: Callable[[], float] = time.monotonic,
                 reap: Callable[[EngineInfo], None] = sigkill_on_node):
        self.remove = remove  # evict an incarnation as dead (the coordinator's `_remove`)
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.failure_threshold = failure_threshold
        self.kill = kill
        self.reap = reap  # the hung engine's process, on its node, in case the kill does not reach it
        self.hangs: Counter[str] = Counter()
        self._probes: dict[tuple[str, int], _Probe] = {}  # (engine, generation) -> its probe
        self._strikes: Counter[tuple[str, int]] = Counter()  # failed probes in a row, per incarnation
        self._heard_at: dict[str, float] = {}  # engine -> when it last called the coordinator
        self.clock = clock
        self.probe_failures = 0  # probes unanswered or finding a stuck core
        self.busy_timeouts = 0  # probes that timed out on an engine that was calling us meanwhile

    def heard(self, engine_id: str) -> None:
        """The engine called the coordinator (evidence that its actor is not frozen)."""
        self._heard_at[engine_id] = self.clock()

    def forget(self, engine_id: str) -> None:
        self._heard_at.pop(engine_id, None)

    async def probe(self, entry: EngineEntry) -> tuple[str, str] | None:
        """None when the engine answered (or, silent, called the coordinator meanwhile: busy, not
        frozen); else ("hung" | "died", why)."""
        started = self.clock()
        try:
            answer = await asyncio.wait_for(entry.handles[0].ping.remote(), self.timeout_s)
        except asyncio.TimeoutError:
            if self._heard_at.get(entry.engine_id, float("-inf")) >= started:
                self.busy_timeouts += 1
                logger.warning("engine %s (generation %d) did not answer a ping in %.0f s but called the "
                               "coordinator meanwhile: busy, not hung", entry.engine_id, entry.generation,
                               self.timeout_s)
                return None
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
        while True:
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
            self.probe_failures += 1
            self._strikes[key] += 1
            strikes = self._strikes[key]
            if strikes >= self.failure_threshold:
                break
            logger.warning("engine %s (generation %d) failed a probe (%s): %d of %d in a row decide it is hung%s",
                           entry.engine_id, entry.generation, why, strikes, self.failure_threshold,
                           "; reported, so probing again now" if reported else "")
            if reported is None:
                return None  # the next sweep probes it again
        self._strikes.pop(key, None)
        reason = f"hung: {why} ({strikes} probes in a row" + (f"; reported: {reported})" if reported else ")")
        logger.warning("engine %s (generation %d) is %s; evicting it and killing it so that Ray restarts it",
                       entry.engine_id, entry.generation, reason)
        self.hangs[entry.engine_id] += 1
        await self.remove(entry, reason)
        try:
            self.kill(entry.handles[0])
        except Exception as exc:  # noqa: BLE001 - already gone: nothing to restart
            logger.warning("killing hung engine %s failed: %s", entry.engine_id, exc)
        try:
            self.reap(entry.info)
        except Exception as exc:  # noqa: BLE001 - the start-up deadline kills it again later
            logger.warning("killing hung engine %s's process failed: %s", entry.engine_id, exc)
        return kind

    async def sweep(self, entries: list[EngineEntry], live: Callable[[EngineEntry], bool]) -> list[str]:
        """Probe every engine once; the ids of those found hung (the last of `failure_threshold`
        failed probes in a row) or dead."""
        current = {(e.engine_id, e.generation) for e in entries}
        for key in [k for k in self._strikes if k not in current]:  # incarnations gone meanwhile
            del self._strikes[key]
        verdicts = await asyncio.gather(*(self.judge(e, lambda e=e: live(e)) for e in entries))
        return [e.engine_id for e, v in zip(entries, verdicts) if v is not None]
