"""What the coordinator knows of one registered engine incarnation, and how a registration is
checked: every rank's handshake payload decoded (protocol, compatibility hash, sizes), the ranks
complete (tp x pp) and agreeing on the compatibility hash. Pure: no Ray.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from actors.kv.transfer_errors import HandshakeError
from actors.kv.handshake import RankHandshake, decode_handshake
from actors.protocol.registration import EngineInfo, EngineSummary

ROLES = ("prefill", "decode", "both")


class RegistrationError(ValueError):
    """An engine's registration was refused; the message says why."""


@dataclass(frozen=True)
class Registration:
    """The answer to `register_engine`: the incarnation's generation and its pair verdicts."""

    generation: int
    pairs: dict[str, str]  # "prefill->decode" -> "ok" or the reason the pair is refused


@dataclass
class EngineEntry:
    engine_id: str
    role: str
    ranks: dict[tuple[int, int], RankHandshake]  # (pp rank, tp rank) -> handshake
    raw: dict[tuple[int, int], bytes]
    handles: list[Any]  # actor handles whose death means this incarnation is dead
    info: EngineInfo
    generation: int
    registered_at: float = field(default_factory=time.time)
    evicted: asyncio.Event = field(default_factory=asyncio.Event)
    eviction_reason: str = ""
    watchers: list[asyncio.Task] = field(default_factory=list)
    draining: bool = False  # routers stop choosing it (the autoscaler is removing it)

    @property
    def head(self) -> RankHandshake:
        return self.ranks[min(self.ranks)]

    @property
    def serves_decode(self) -> bool:
        return self.role in ("decode", "both")

    def summary(self) -> EngineSummary:
        h = self.head
        return EngineSummary(self.engine_id, self.role, h.compat.model_id, h.compat.compat_hash(), h.tp_size,
                             h.pp_size, h.dcp_size, h.block_size, len(self.ranks), self.generation, self.draining,
                             self.info)


def decode_registration(engine_id: str, role: str, handshakes: list[bytes]
                ) -> tuple[dict[tuple[int, int], RankHandshake], dict[tuple[int, int], bytes]]:
    if not handshakes:
        raise RegistrationError(f"engine {engine_id!r} registered without handshake payloads")
    ranks: dict[tuple[int, int], RankHandshake] = {}
    raw: dict[tuple[int, int], bytes] = {}
    for data in handshakes:
        try:
            hs = decode_handshake(data)
        except HandshakeError as exc:
            raise RegistrationError(f"engine {engine_id!r}: {exc}") from None
        if hs.engine_id != engine_id or hs.role != role:
            raise RegistrationError(f"engine {engine_id!r} ({role}) sent the payload of {hs.engine_id!r} ({hs.role})")
        ranks[(hs.pp_rank, hs.tp_rank)] = hs
        raw[(hs.pp_rank, hs.tp_rank)] = data
    head = ranks[min(ranks)]
    expected = {(p, t) for p in range(head.pp_size) for t in range(head.tp_size)}
    if set(ranks) != expected:
        raise RegistrationError(
            f"engine {engine_id!r} must send tp x pp = {len(expected)} rank payloads, got {sorted(ranks)}")
    if len({hs.compat.compat_hash() for hs in ranks.values()}) != 1:
        raise RegistrationError(f"engine {engine_id!r}: ranks disagree on the compatibility hash")
    return ranks, raw
