"""The coordinator as a Ray actor: its options (a waiting actor Ray restarts, bounded, on the head node
if asked), get-or-create, and the handle by name."""

from __future__ import annotations

from typing import Any

import ray

from actors.control.coordinator import Coordinator
from actors.ray_names import COORDINATOR_NAME, NAMESPACE


def coordinator_options(name: str = COORDINATOR_NAME, detached: bool = False, on_head_node: bool = False,
                        max_restarts: int = 5) -> dict[str, Any]:
    """Ray options of the coordinator: a waiting actor (no CPU) that Ray restarts (bounded);
    its calls are retried on the new incarnation unless they say otherwise (`watch*`)."""
    options: dict[str, Any] = dict(
        name=name, namespace=NAMESPACE, num_cpus=0, get_if_exists=True, max_concurrency=10_000,
        max_restarts=max_restarts, max_task_retries=3 if max_restarts else 0,
    )
    if detached:
        options["lifetime"] = "detached"
    if on_head_node:  # Ray's marker resource of the head node: the directory lives as long as the cluster
        options["resources"] = {"node:__internal_head__": 0.001}
    return options


def start_coordinator(detached: bool = False, on_head_node: bool = False, name: str = COORDINATOR_NAME,
                      max_restarts: int = 5, **kwargs: Any) -> Any:
    """Get or create the cluster's coordinator actor (on the head node if asked)."""
    options = coordinator_options(name, detached, on_head_node, max_restarts)
    return ray.remote(Coordinator).options(**options).remote(**kwargs)


def get_coordinator() -> Any:
    return ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
