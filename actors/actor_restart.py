"""Whether the running Ray actor is a restart (Ray reconstructed it after its process died)."""

from __future__ import annotations

import ray


def reconstructed() -> bool:
    try:  # not asked outside Ray (unit tests): asking would start a local Ray
        return ray.is_initialized() and bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not inside an actor
        return False
