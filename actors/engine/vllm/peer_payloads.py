"""The producer handshake payloads a vLLM decode engine attaches to its requests' transfer params.

A decode engine fetches the payloads of exactly the producer ranks its own ranks read from
(`TransferTopology.handshake_target_ranks`), once per (producer engine, pp rank), from the
coordinator; it validates them before any worker sees them, and remembers which producer
incarnation they belong to. Params stamped by an incarnation that is no longer registered are
refused: their block ids name memory of a dead process, and the restarted producer's memory at
those ids holds other KV.
"""

from __future__ import annotations

import base64
from typing import Any

import ray

from actors.kv.transfer_errors import HandshakeError
from actors.kv.handshake import decode_handshake
from actors.kv.plan.topology import TransferTopology
from actors.transfer_params import TransferParams, agent_incarnation


class PeerPayloads:
    def __init__(self, engine_id: str, tp_size: int):
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.own: Any = None  # decoded handshake of our rank 0 (set once our workers registered)
        self._payloads: dict[str, dict[int, list[str]]] = {}  # engine -> pp -> base64 payloads
        self._incarnation: dict[str, str] = {}  # engine -> incarnation its payloads belong to

    def drop(self, engine_id: str) -> None:
        """Forget an engine (it died or restarted); its next request fetches fresh payloads."""
        self._payloads.pop(engine_id, None)
        self._incarnation.pop(engine_id, None)

    async def attach(self, p: TransferParams, coordinator: Any) -> dict:
        """The params as vLLM's connector reads them (its own boundary, a dict), with the payloads our
        ranks need. Raises HandshakeError when the producer cannot be met: not registered (dead, or
        restarted since it stamped the params), or a payload that is malformed or incompatible."""
        engine, stamped = p.remote_engine_id, p.remote_incarnation
        if stamped and self._incarnation.get(engine, stamped) != stamped:
            self._payloads.pop(engine, None)  # cached before the producer restarted: fetch again
        payloads: list[str] = []
        for pp_rank in range(p.pp_size):
            cached = self._payloads.get(engine, {}).get(pp_rank)
            if cached is None:
                cached = self._payloads.setdefault(engine, {})[pp_rank] = await self._fetch(p, pp_rank, coordinator)
            payloads.extend(cached)
        if stamped and self._incarnation.get(engine) != stamped:
            raise HandshakeError("remote_incarnation", f"{engine} restarted since this prefill "
                                 f"({stamped} -> {self._incarnation.get(engine)})")
        # (vLLM's own remote_prefill_cached_tokens is not carried: vLLM would report the
        # producer's prefix hits instead of what we pulled.)
        return {**p.model_dump(mode="json"), "do_remote_prefill": True, "handshakes": payloads}

    async def _fetch(self, p: TransferParams, pp_rank: int, coordinator: Any) -> list[str]:
        own = self.own
        targets: set[int] = set()
        for rank in range(self.tp_size):
            topo = TransferTopology(rank, self.tp_size, own.block_size, self.engine_id,
                                    own.compat.is_mla, False, own.compat.num_kv_heads)
            targets.update(topo.handshake_target_ranks(p.tp_size, p.dcp_size))
        try:
            raw = await coordinator.handshake_payloads.remote(p.remote_engine_id, pp_rank, sorted(targets))
        except ray.exceptions.RayError as exc:
            raise HandshakeError("engine_id", str(getattr(exc, "cause", None) or exc)) from None
        for data in raw:  # bad payload or incompatible peer: refused before any worker sees it
            hs = decode_handshake(data, expect_compat_hash=own.compat.compat_hash())
            self._incarnation[p.remote_engine_id] = agent_incarnation(hs.agent_name)
        return [base64.b64encode(b).decode() for b in raw]
