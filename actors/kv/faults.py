"""Fault injection for transfer tests: a policy object given to a rank, never a wire field.

An engine built with `fault_rate > 0` (EngineConfig.transfer.fault_rate, a test knob)
gives each of its ranks a `FaultPolicy`; `RankTransfer.start_pull` asks it
whether a pull fails on purpose. `corrupt_rate` is the producer's half: that
fraction of held leases gets one byte of its first block flipped *after* the
lease's checksums were recorded (memory going bad between prefill and read),
which `transfer.verify` must catch. Verdicts are a hash of the request id, so
every rank of an engine agrees on which requests fail and the rate holds per
request, whatever the TP/PP size.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from actors.kv.transfer_errors import KVTransferError


class InjectedFault(KVTransferError):
    """A pull failed on purpose (fault injection)."""


@dataclass(frozen=True)
class FaultPolicy:
    rate: float = 0.0
    seed: int = 0
    corrupt_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rate", "corrupt_rate"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= 1.0):
                raise ValueError(f"fault {name} must be in [0, 1], got {value!r}")

    def _draw(self, salt: str, req_id: str, rate: float) -> bool:
        if rate <= 0.0:
            return False
        digest = hashlib.blake2b(f"{self.seed}:{salt}{req_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2.0**64 < rate

    def fails(self, req_id: str) -> bool:
        return self._draw("", req_id, self.rate)

    def corrupts(self, req_id: str) -> bool:
        """Flip a byte of this request's held blocks after their checksums were recorded."""
        return self._draw("corrupt:", req_id, self.corrupt_rate)


NO_FAULTS = FaultPolicy()
