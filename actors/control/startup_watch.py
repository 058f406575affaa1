"""Engines the coordinator expects back: a start-up deadline per restarted engine.

The coordinator probes registered incarnations only (`actors.control.liveness`), and a ping cannot
tell "starting" from "hung". So every engine it lost (evicted as dead or hung, not leaving on
purpose) must register again within its deadline (`StartupDeadline`: fixed, or a multiple of the
longest measured start); one that does not is killed so that Ray restarts it (bounded by
`restarts.max_restarts`), counted (`startup_timeouts`), and awaited anew. Invariant: no engine
stays stranded between a restart and its registration. The life cycle of one engine's deadline:
`StartupWatch`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Container
from dataclasses import dataclass, replace
from typing import Any

import ray

from actors.actor_restart import reconstructed
from actors.control.liveness import kill_for_restart
from actors.ray_names import COORDINATOR_NAME, ENGINE_ACTOR_PREFIX, NAMESPACE

logger = logging.getLogger("raypd.coordinator")

# The launcher passes its engine start timeout (serving.cluster.engines.default_start_timeout) or
# `restarts.startup_deadline_s`; without one, the longest start (a vLLM engine's).
DEFAULT_STARTUP_DEADLINE_S = 1200.0
DEAD = "DEAD"  # Ray's state of an actor that will not be restarted
ENGINE_CLASS = "EngineActor"  # Ray's class name of an engine actor (actors.engine.actor)


@dataclass(frozen=True)
class StartupDeadline:
    """How long an engine the coordinator lost may take to register again (see the module docstring)."""

    fixed_s: float | None = None  # the operator's restarts.startup_deadline_s: used as it is
    fallback_s: float = DEFAULT_STARTUP_DEADLINE_S  # before any start was measured
    factor: float = 3.0  # x the longest start measured
    floor_s: float = 120.0

    def derive(self, measured_s: float | None) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        if not measured_s:
            return self.fallback_s
        return max(self.floor_s, self.factor * measured_s)


async def engine_actors() -> dict[str, Any]:
    """Engine id -> handle of every launched engine actor Ray has and will not give up on (alive,
    restarting or being created), read from the GCS's actor table; {} when it cannot be read, or
    when the caller is not the cluster's coordinator (launched engines register with that one)."""
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_name() != COORDINATOR_NAME:
        return {}
    try:
        import ray._private.state as gcs

        rows = list((await asyncio.to_thread(gcs.actors)).values())
    except Exception as exc:  # noqa: BLE001 - nothing adopted: the engines' own restarts still register
        logger.info("reading Ray's actor table failed: %s", exc)
        return {}
    out = {}
    for row in rows:
        name = row.get("Name") or ""
        launched = name.startswith(ENGINE_ACTOR_PREFIX) and row.get("ActorClassName") == ENGINE_CLASS
        if launched and row.get("State") != DEAD:
            try:
                out[name[len(ENGINE_ACTOR_PREFIX):]] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # gone meanwhile
                continue
    return out


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

    A restarted coordinator starts with nothing pending; once settled, it awaits every engine
    actor Ray still has that did not register again (`adopt`, `engine_actors`).
    """

    def __init__(self, deadline_s: float | None = None,
                 kill: Callable[[Any], None] = kill_for_restart,
                 state: Callable[[Any], Awaitable[str | None]] = actor_state,
                 clock: Callable[[], float] = time.monotonic,
                 on_event: Callable[..., None] | None = None,
                 policy: StartupDeadline | None = None,
                 actors: Callable[[], Awaitable[dict[str, Any]]] = engine_actors,
                 registered: Container[str] | None = None, settle_s: float = 10.0,
                 restarted: Callable[[], bool] = reconstructed):
        self.policy = replace(policy or StartupDeadline(), **({"fixed_s": deadline_s} if deadline_s else {}))
        self.measured_s: float | None = None  # the longest start an engine reported (its registration)
        # a restarted coordinator's registered engines (live) and the engine actors Ray has: once `settle_s`
        # after it started, those that did not register are adopted (`adopt_once`). A first coordinator
        # adopts nothing: engines in their first start are the launcher's to time out.
        self.registered_ids, self.actors, self.settle_s = registered, actors, settle_s
        self.started_at = clock()
        self._adopted = registered is None or not restarted()
        self.kill, self.state, self.clock = kill, state, clock
        self.on_event = on_event  # the coordinator's event log: on_event(kind, engine_id, **fields)
        self.timeouts: Counter[str] = Counter()  # engine -> start-up deadlines missed (and killed)
        self._pending: dict[str, PendingStart] = {}

    @property
    def deadline_s(self) -> float:
        return self.policy.derive(self.measured_s)

    @deadline_s.setter
    def deadline_s(self, value: float) -> None:
        """A fixed deadline (the operator's)."""
        self.policy = replace(self.policy, fixed_s=value)

    def expect(self, engine_id: str, handle: Any, reason: str, since: float | None = None) -> None:
        """Armed: the engine's incarnation went (`reason`; at `since`, default now) and Ray restarts its actor."""
        self._pending[engine_id] = PendingStart(engine_id, handle, reason, self.clock() if since is None else since)

    def registered(self, engine_id: str, start_s: float = 0.0) -> None:
        """Cleared: a new incarnation registered; its start took `start_s` (0: not measured)."""
        self._pending.pop(engine_id, None)
        if start_s > (self.measured_s or 0.0):
            self.measured_s = start_s

    def adopt(self, actors: dict[str, Any], registered: Container[str], since: float) -> list[str]:
        """A restarted coordinator's pending starts: every engine actor Ray still has (`actors`,
        from `engine_actors`) that has not registered is awaited from `since` (the coordinator's
        return). Returns the ids adopted."""
        adopted = [e for e in actors if e not in registered and e not in self._pending]
        for e in adopted:
            self.expect(e, actors[e], "not registered again after the coordinator restarted", since)
        return adopted

    async def adopt_once(self) -> list[str]:
        """`adopt` once, `settle_s` after the coordinator started: every engine registers again within
        ~1 s of its return. Returns the ids adopted."""
        if self._adopted or self.clock() - self.started_at < self.settle_s:
            return []
        self._adopted = True
        actors = await self.actors()
        adopted = self.adopt(actors, self.registered_ids or (), self.started_at)  # (live: registered meanwhile)
        if adopted:
            logger.warning("engines %s have actors but did not register again: awaiting them (start-up deadline "
                           "%.0f s from the coordinator's start)", adopted, self.deadline_s)
        return adopted

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
        deadline (first, once settled, adopting the engine actors that did not register). Returns the ids killed."""
        await self.adopt_once()
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
