"""Typed metadata between raypd's scheduler-side and worker-side connector halves.

Three messages per engine step: scheduler -> worker (`RayNixlMetadata`: what to pull, hold,
abandon and release), worker -> scheduler (`LeaseEnds`: leases a rank let expire or dropped, pulls
that failed and why), and scheduler -> the EngineActor (`LeaseEndStats`, in vLLM's connector
stats: how each lease ended, which pulls failed and why). Invariant: the EngineActor hears of a
step's lease ends and failed pulls before the outputs of any later step. Each message's fields:
`RayNixlMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from actors.engine.vllm.leases import LEASE_ENDS, PULL_FAILED
from actors.transfer_params import TransferParams


@dataclass(frozen=True)
class RecvSpec:
    params: TransferParams
    local_block_ids: tuple[int, ...]  # blocks to fill (prefix-cached blocks already skipped)
    remote_block_ids: tuple[int, ...]  # matching remote blocks
    num_tokens: int  # prompt tokens covered by these blocks
    sync: bool = False  # pulled before this step's forward (vLLM computes on these blocks in the step)


@dataclass(frozen=True)
class SendSpec:
    block_ids: tuple[int, ...]
    ttl_s: float


@dataclass
class RayNixlMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per engine step (`RayNixlMetadata`):
      recv     decode: requests whose prompt KV must be pulled now;
      send     prefill: requests whose blocks are now held for remote readers;
      abandon  decode: requests that will never pull (aborted before loading);
               the worker tells their producers so they free at once;
      release  prefill: held requests nobody will read; the worker drops their
               leases in this step, so vLLM frees the blocks.

    Worker -> scheduler, with a step's results (`LeaseEnds`, vLLM's worker metadata:
    its aggregator unites the ranks'): the leases this rank let expire or dropped
    for the release list in the step. Every other lease a rank reports in
    finished_sending ended by its readers' notices. A decode rank adds the pulls
    that failed in the step, with why (`RankTransfer`'s reason: vLLM itself only
    hears of failed receives and invalid blocks).

    Scheduler -> the EngineActor, once per engine step (`LeaseEndStats`, vLLM's
    connector stats): the leases vLLM heard were finished sending on every rank, by
    how they ended, and the pulls that failed, with why (`PULL_FAILED`). vLLM
    carries them to the process that holds the AsyncLLM client in the step's
    `SchedulerStats.kv_connector_stats`, where the actor's stat logger reads them
    (`actors.engine.vllm.leases`), before the outputs of any later step.
    """

    recv: dict[str, RecvSpec] = field(default_factory=dict)
    send: dict[str, SendSpec] = field(default_factory=dict)
    abandon: dict[str, TransferParams] = field(default_factory=dict)
    release: set[str] = field(default_factory=set)


@dataclass
class RankHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's encoded handshake payload (vLLM passes it to the scheduler side)."""

    payload: bytes


@dataclass
class LeaseEnds(KVConnectorWorkerMetadata):
    """What one step of a rank says of how its leases ended, besides readers' notices, and of the
    pulls that failed in it (vLLM ids)."""

    expired: frozenset[str] = frozenset()  # no reader finished within the TTL
    released: frozenset[str] = frozenset()  # dropped for the release list (nobody will read it)
    failed_pulls: tuple[tuple[str, str], ...] = ()  # (request, why) of this step's failed pulls

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "LeaseEnds":
        if not isinstance(other, LeaseEnds):
            return self
        return LeaseEnds(self.expired | other.expired, self.released | other.released,
                         self.failed_pulls + other.failed_pulls)


@dataclass
class LeaseEndStats(KVConnectorStats):
    """Leases finished sending on every rank since the last step's stats: `data` maps each way a
    lease ends (`LEASE_ENDS`: read, expired, released) to vLLM's ids of the requests, and
    `PULL_FAILED` to [vLLM's id, why] of the pulls that failed (lists: vLLM serializes the
    payload to the client with msgpack)."""

    def reset(self) -> None:
        self.data = {}

    def add(self, how: str, req_id: str) -> None:
        self.data.setdefault(how, []).append(req_id)

    def pull_failed(self, req_id: str, reason: str) -> None:
        self.data.setdefault(PULL_FAILED, []).append([req_id, reason])

    def aggregate(self, other: KVConnectorStats) -> "LeaseEndStats":
        merged = {k: list(v) for k, v in self.data.items()}
        for how, ids in (other.data or {}).items():
            merged.setdefault(how, []).extend(ids)
        return LeaseEndStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return {**{f"leases_{how}": len(self.data.get(how) or ()) for how in LEASE_ENDS},
                "pulls_failed": len(self.data.get(PULL_FAILED) or ())}

    def is_empty(self) -> bool:
        return not any(self.data.get(how) for how in (*LEASE_ENDS, PULL_FAILED))
