"""A synthetic rank as a Ray actor: its directory is the coordinator, and it can be watched.

Life cycle: created by its `SyntheticEngine` (in the engine's placement group),
restarted by Ray when it dies (the engine's `rank_max_restarts`: the deployment's
`restarts.max_restarts`, `RANK_MAX_RESTARTS` by default; a restarted rank has an
empty cache and a fresh NIXL agent, so its engine becomes a new incarnation),
killed with its engine.
"""

from __future__ import annotations

import threading
from typing import Any

import ray

from actors.kv.faults import NO_FAULTS, FaultPolicy
from actors.engine.synthetic.rank import RankConfig, SyntheticRank


class SyntheticRankActor(SyntheticRank):
    """The Ray-actor face of a rank: the directory is the coordinator."""

    def __init__(self, cfg: RankConfig, coordinator: Any = None, faults: FaultPolicy = NO_FAULTS):
        directory = None
        if coordinator is not None:
            directory = lambda e, p, rs: ray.get(coordinator.handshake_payloads.remote(e, p, rs))  # noqa: E731
        super().__init__(cfg, directory=directory, faults=faults)

    def ping(self) -> str:
        return "pong"

    @ray.method(concurrency_group="liveness", max_task_retries=0)
    def watch(self) -> None:
        """Never returns (on its own thread): a caller's pending call fails when this rank dies."""
        threading.Event().wait()

    def pid(self) -> int:
        import os

        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


# Rank work is serial (one thread); `watch` calls park on threads of their own.
RankActor = ray.remote(concurrency_groups={"liveness": 4})(SyntheticRankActor)
RANK_MAX_RESTARTS = 5  # a SyntheticEngine built without a deployment (tests, benchmarks)
