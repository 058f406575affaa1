"""What a synthetic decode's pulls come to: a failed transfer, and the checksums its tokens derive from."""

from __future__ import annotations

from typing import Any


class TransferFailed(RuntimeError):
    """The KV pull of a request failed; `invalid_block_ids` were not (fully) received."""

    def __init__(self, req_id: str, reasons: list[str], invalid_block_ids: set[int]):
        super().__init__(f"KV transfer of {req_id} failed: {'; '.join(reasons)}")
        self.req_id, self.reasons, self.invalid_block_ids = req_id, reasons, invalid_block_ids


def is_handshake_failure(reason: str) -> bool:
    """A pull that failed at the handshake (bad payload, incompatible or unknown peer)."""
    return reason.startswith(("HandshakeError", "RegistrationError")) or "is not registered" in reason


def ordered_checksums(per_rank: Any) -> list[float]:
    """Sum the ranks' per-position checksums (ranks hold different heads, layers or positions)."""
    checksums: dict[int, float] = {}
    for sums in per_rank:
        for pos, value in sums.items():
            checksums[int(pos)] = checksums.get(int(pos), 0.0) + value
    return [checksums[p] for p in sorted(checksums)]
