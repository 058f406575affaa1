"""Typed metadata between raypd's scheduler-side and worker-side connector halves.

Scheduler -> worker, once per engine step (`RayNixlMetadata`):
  recv     decode: requests whose prompt KV must be pulled now;
  send     prefill: requests whose blocks are now held for remote readers;
  abandon  decode: requests that will never pull (aborted before loading);
           the worker tells their producers so they free at once;
  release  prefill: held requests nobody will read; the worker drops their
           leases in this step, so vLLM frees the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

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
    recv: dict[str, RecvSpec] = field(default_factory=dict)
    send: dict[str, SendSpec] = field(default_factory=dict)
    abandon: dict[str, TransferParams] = field(default_factory=dict)
    release: set[str] = field(default_factory=set)


@dataclass
class RankHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's encoded handshake payload (vLLM passes it to the scheduler side)."""

    payload: bytes
