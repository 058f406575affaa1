"""Names of a deployment's Ray objects, so every process finds the same ones.

Engines are named, detached actors in the "raypd" namespace: actor
`raypd-<deployment>-<role>-<i>`, engine id `<deployment>-<role>-<i>`, placement
group `raypd-<deployment>-<role>-<i>-pg`; one launcher actor per deployment,
`raypd-<deployment>-launcher` (it owns engine start-up and, when enabled, the
autoscaler's loop).
"""

from __future__ import annotations

from actors.ray_names import COORDINATOR_NAME, ENGINE_ACTOR_PREFIX, NAMESPACE

__all__ = ["COORDINATOR_NAME", "NAMESPACE", "ROLES", "actor_name", "actor_name_of", "engine_id", "engine_index",
           "launcher_name", "placement_group_name"]

ROLES = ("prefill", "decode", "both")


def actor_name(deployment: str, role: str, index: int) -> str:
    return f"raypd-{deployment}-{role}-{index}"


def engine_id(deployment: str, role: str, index: int) -> str:
    return f"{deployment}-{role}-{index}"


def actor_name_of(engine: str) -> str:
    """The actor name of engine id `engine` (`<deployment>-<role>-<i>`)."""
    return f"{ENGINE_ACTOR_PREFIX}{engine}"


def placement_group_name(engine: str) -> str:
    return f"{actor_name_of(engine)}-pg"


def engine_index(deployment: str, role: str, engine: str) -> int | None:
    """`i` of engine id `<deployment>-<role>-<i>`, None for another deployment's or role's engine."""
    prefix = f"{deployment}-{role}-"
    tail = engine[len(prefix):] if engine.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def launcher_name(deployment: str) -> str:
    return f"raypd-{deployment}-launcher"
