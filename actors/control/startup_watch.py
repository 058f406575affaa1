"""Engines the coordinator expects back: a start-up deadline per restarted engine.

The coordinator probes registered incarnations only (`actors.control.liveness`), and a ping cannot
tell "starting" from "hung". So every engine it lost (evicted as dead or hung, not leaving on
purpose) must register again within `deadline_s`; one that does not is killed so that Ray restarts
it (bounded by `restarts.max_restarts`), counted (`startup_timeouts`), and awaited anew. Invariant:
no engine stays stranded between a restart and its registration. The life cycle of one engine's
deadline: `StartupWatch`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray

from actors.control.liveness import kill_for_restart

logger = logging.getLogger("raypd.coordinator")

# The launcher passes its engine start timeout (serving.cluster.engines.default_start_timeout) or
# `restarts.startup_deadline_s`; without one, the longest start (a vLLM engine's).
DEFAULT_STARTUP_DEADLINE_S = 1200.0
DEAD = "DEAD"  # Ray's state of an actor that will not be restarted


async def actor_state(handle: Any) -> str | None:
    """Ray's state of the actor behind `handle` (ALIVE, RESTARTING, DEAD...), read from the GCS's
    actor table (no dashboard needed); None when it cannot be known."""
    if not ray.is_initialized():
        return None
    try:
        import ray._private.state as gcs

        info = await asyncio.to_thread(gcs.actors, handle._actor_id.hex())
    except Exception as exc:  # noqa: BLE001 - unknown: the deadline decides
        logger.info("reading the state of actor %s failed: %s", handle, exc)
        return None
    return info.get("State") if info else None


@dataclass
class PendingStart:
    """An engine the coordinator lost and expects to register again."""

    engine_id: str
    handle: Any  # its actor (the same actor across Ray's restarts)
    reason: str  # why its last incarnation went, or the last deadline it missed
    armed_at: float  # monotonic
    missed: int = 0  # deadlines missed in a row


class StartupWatch:
    """Life cycle of one engine's deadline (`StartupWatch`, keyed by engine id):

      armed     the coordinator evicted an incarnation as dead (its watch ended, a probe found it
                gone) or hung (killed for restart): Ray restarts the actor, and the engine (same id,
                same actor) is expected to register again within `deadline_s`;
      cleared   it registered (a new incarnation): nothing is pending for it any more;
      dropped   nothing to wait for: it left on purpose (unregistered: shutdown, the autoscaler's
                stop), it was draining when it went (the autoscaler is removing it), or Ray says the
                actor is dead for good (no restart left, killed without restart);
      expired   no registration by the deadline (checked by the coordinator's periodic sweep, every
                `restarts.probe_interval_s`): the actor is killed so that Ray restarts it
                (`kill_for_restart`; Ray bounds it with `restarts.max_restarts`), the miss is counted
                per engine (`startup_timeouts`) and logged, and the deadline is armed again for the
                next incarnation.
    """

    def __init__(self, deadline_s: float = DEFAULT_STARTUP_DEADLINE_S,
                 kill: Callable[[Any], None] = kill_for_restart,
                 state: Callable[[Any], Awaitable[str | None]] = actor_state,
                 clock: Callable[[], float] = time.monotonic,
                 on_event: Callable[..., None] | None = None):
        self.deadline_s = deadline_s
        self.kill, self.state, self.clock = kill, state, clock
        self.on_event = on_event  # the coordinator's event log: on_event(kind, engine_id, **fields)
        self.timeouts: Counter[str] = Counter()  # engine -> start-up deadlines missed (and killed)
        self._pending: dict[str, PendingStart] = {}

    def expect(self, engine_id: str, handle: Any, reason: str) -> None:
        """Armed: the engine's incarnation went (`reason`) and Ray restarts its actor."""
        self._pending[engine_id] = PendingStart(engine_id, handle, reason, self.clock())

    def registered(self, engine_id: str) -> None:
        """Cleared: a new incarnation registered."""
        self._pending.pop(engine_id, None)

    def drop(self, engine_id: str, why: str) -> None:
        """Dropped: the engine is not coming back (`why`)."""
        if self._pending.pop(engine_id, None) is not None:
            logger.info("engine %s: no longer awaiting its start-up (%s)", engine_id, why)

    def pending(self) -> dict[str, float]:
        """Engine -> seconds left before its start-up deadline."""
        now = self.clock()
        return {e: p.armed_at + self.deadline_s - now for e, p in self._pending.items()}

    async def sweep(self) -> list[str]:
        """Drop the engines Ray will not restart; kill (for a restart) and re-arm the ones past their
        deadline. Returns the ids killed."""
        waiting = list(self._pending.values())
        states = await asyncio.gather(*(self.state(p.handle) for p in waiting))
        killed = []
        for p, state in zip(waiting, states):
            if self._pending.get(p.engine_id) is not p:
                continue  # registered (or lost again) while we asked Ray
            if state == DEAD:
                self.drop(p.engine_id, "its actor is dead for good")
                continue
            waited = self.clock() - p.armed_at
            if waited < self.deadline_s:
                continue
            reason = (f"no registration {waited:.0f} s after its last incarnation went ({p.reason}); "
                      f"start-up deadline {self.deadline_s:.0f} s, actor {state or 'state unknown'}")
            logger.warning("engine %s: %s; killing it so that Ray restarts it", p.engine_id, reason)
            self.timeouts[p.engine_id] += 1
            if self.on_event is not None:
                self.on_event("startup_timeout", p.engine_id, reason=reason, missed=p.missed + 1)
            try:
                self.kill(p.handle)
            except Exception as exc:  # noqa: BLE001 - already gone: nothing to restart
                logger.warning("killing engine %s failed (%s): no longer awaiting it", p.engine_id, exc)
                del self._pending[p.engine_id]
                continue
            killed.append(p.engine_id)
            self._pending[p.engine_id] = PendingStart(p.engine_id, p.handle, "start-up deadline missed",
                                                      self.clock(), p.missed + 1)
        return killed
