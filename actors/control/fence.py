"""Incarnations Ray declared dead are never registered again.

An engine's process on a host that was cut off outlives Ray's verdict until its raylet reaches the
GCS and exits. Meanwhile the process may call the coordinator (its calls were queued through the
cut): a registration from it would put an engine whose actor Ray declared dead back in the route
table, be removed at once by the coordinator's watch (the actor is dead), and come again, in a loop.
So the coordinator remembers each incarnation whose own actor's watch ended with Ray's
`ActorDiedError` (its engine id, process and node: a restart by Ray is a new process; a rank's death
is not the registering process's) and refuses its registrations.
Bounded: the last `capacity` incarnations. Pure: no Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from actors.control.registry import RegistrationError
from actors.protocol.registration import EngineInfo


class DeadIncarnations:
    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._dead: OrderedDict[tuple[str, int, str], None] = OrderedDict()
        self.refused = 0  # registrations refused so far

    @staticmethod
    def _key(engine_id: str, info: EngineInfo) -> tuple[str, int, str] | None:
        return (engine_id, info.pid, info.node_id) if info.pid and info.actor_id else None

    def died(self, engine_id: str, info: EngineInfo) -> None:
        """Ray declared this incarnation's actor dead."""
        key = self._key(engine_id, info)
        if key is not None:
            self._dead[key] = None
            while len(self._dead) > self.capacity:
                self._dead.popitem(last=False)

    def watch_failed(self, engine_id: str, info: EngineInfo, handle: Any, exc: BaseException) -> None:
        """The coordinator's watch on `handle` failed with `exc`: fenced when Ray declared the
        registering actor itself dead (`ActorDiedError`; a rank's death is not its process's)."""
        if info.actor_id and any(c.__name__ == "ActorDiedError" for c in type(exc).__mro__) \
                and actor_id_of(handle) == info.actor_id:
            self.died(engine_id, info)

    def check(self, engine_id: str, info: EngineInfo | None) -> None:
        """Raises RegistrationError for a registration from a fenced incarnation."""
        if self.refuses(engine_id, info):
            raise RegistrationError(f"engine {engine_id!r}: this incarnation (pid {info.pid}) is dead in Ray's view")

    def refuses(self, engine_id: str, info: EngineInfo | None) -> bool:
        """The registration comes from an incarnation Ray declared dead (counted)."""
        key = self._key(engine_id, info) if info is not None else None
        if key is not None and key in self._dead:
            self.refused += 1
            return True
        return False


def actor_id_of(handle: Any) -> str:
    """A Ray actor handle's id (hex), "" for anything else."""
    try:
        found = handle._actor_id.hex()
    except Exception:  # noqa: BLE001 - not a Ray actor handle
        return ""
    return found if isinstance(found, str) else ""
