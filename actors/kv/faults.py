"""Fault injection for transfer tests: a policy object given to a rank, never a wire field.

An engine built with `fault_rate > 0` (EngineConfig.fault_rate, a test knob)
gives each of its ranks a `FaultPolicy`; `RankTransfer.start_pull` asks it
whether a pull fails on purpose. The verdict is a hash of the request id, so
every rank of an engine agrees on which requests fail and the rate holds per
request, whatever the TP/PP size.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from actors.kv.errors import KVTransferError


class InjectedFault(KVTransferError):
    """A pull failed on purpose (fault injection)."""


@dataclass(frozen=True)
class FaultPolicy:
    rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.rate, (int, float)) and math.isfinite(self.rate) and 0.0 <= self.rate <= 1.0):
            raise ValueError(f"fault rate must be in [0, 1], got {self.rate!r}")

    def fails(self, req_id: str) -> bool:
        if self.rate <= 0.0:
            return False
        digest = hashlib.blake2b(f"{self.seed}:{req_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2.0**64 < self.rate


NO_FAULTS = FaultPolicy()
