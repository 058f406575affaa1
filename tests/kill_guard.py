"""No false kills: a test that injects no fault must not see the coordinator kill an engine.

The coordinator kills an engine it found hung (`actors.control.liveness`) or one that missed its
start-up deadline (`actors.control.startup_watch`), and counts both per engine (`Coordinator.kills`).
The suite-wide fixture in tests/conftest.py reads the counts of every live coordinator actor (found
by class in Ray's actor table, whatever its name or namespace) before and after each test, and fails
a test whose counts grew unless it is marked `injects_faults`. It reads nothing where Ray was never
initialized in this process: unit tests start no Ray for it.
"""

from __future__ import annotations

import logging
import sys

from actors.control.ledger_records import EngineKills

logger = logging.getLogger(__name__)

COORDINATOR_CLASS = "Coordinator"
READ_TIMEOUT_S = 10.0

Counts = dict[str, EngineKills]  # coordinator actor id -> its kills so far


def new_kills(before: Counts, after: Counts) -> dict[str, dict[str, int]]:
    """Kills that happened between the two readings: reason -> engine -> how many. A coordinator
    first seen after counts from zero; one whose counts went down restarted (a new incarnation
    counts from zero) and counts from zero too."""
    grown: dict[str, dict[str, int]] = {}
    for actor_id, now in after.items():
        was = before.get(actor_id, EngineKills())
        if now.total() < was.total():
            was = EngineKills()
        for reason in ("hung", "startup_timeout"):
            old, new = getattr(was, reason), getattr(now, reason)
            for engine, n in new.items():
                if n > old.get(engine, 0):
                    grown.setdefault(reason, {})[engine] = grown.get(reason, {}).get(engine, 0) + n - old.get(engine, 0)
    return grown


def false_kills(before: Counts, after: Counts, injects_faults: bool) -> str | None:
    """Why the test fails (engines killed though it injected no fault), or None."""
    grown = new_kills(before, after)
    if not grown or injects_faults:
        return None
    return (f"the coordinator killed engines in a test that injects no fault (mark it injects_faults if "
            f"it does): {grown}")


def ray_running() -> bool:
    """Whether this process has a Ray session (without importing Ray for tests that never did)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def read_kills() -> Counts:
    """Every live coordinator actor's kills so far; {} without a Ray session. A coordinator that does
    not answer in time (frozen by a test, restarting) is left out."""
    if not ray_running():
        return {}
    import ray
    import ray._private.state as gcs

    try:
        rows = gcs.actors(actor_state_name="ALIVE").values()
    except Exception as exc:  # noqa: BLE001 - the session is going away: nothing to compare
        logger.info("reading Ray's actor table failed: %s", exc)
        return {}
    ids = {row["ActorID"]: row["Name"] for row in rows if row.get("ActorClassName") == COORDINATOR_CLASS}
    handles = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):  # a handle needs the name and namespace
        if entry["name"] in ids.values():
            try:
                handle = ray.get_actor(entry["name"], namespace=entry["namespace"])
            except ValueError:  # gone meanwhile
                continue
            if handle._actor_id.hex() in ids:
                handles[handle._actor_id.hex()] = handle
    refs = {a: h.kills.remote() for a, h in handles.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=READ_TIMEOUT_S) if refs else ([], [])
    out: Counts = {}
    for actor_id, ref in refs.items():
        if ref in ready:
            try:
                out[actor_id] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - died meanwhile
                logger.info("coordinator %s: %s", actor_id, exc)
    return out
