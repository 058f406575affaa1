"""The typed objects that cross between a rank's owner and its `RankTransfer`.

No torch, no nixl: `actors.transfer_params` builds `PullRequest`s from here
without pulling the data plane into processes that only route requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

Shape = tuple[str, int, int, int]  # (remote engine id, tp, pp, dcp)

# Why a pull failed: `StepResult.failed` reasons begin with one of these (`failure_kind` labels them)
LEASE_ENDED = "the producer's lease had ended when the read was confirmed (its blocks may be reused)"
NO_LEASE_RECORD = "no lease record at the producer within"
INTEGRITY = "KV integrity check failed"
FAILURE_KINDS = {LEASE_ENDED: "lease_ended", NO_LEASE_RECORD: "no_lease_record", INTEGRITY: "integrity"}


def failure_kind(reason: str) -> str:
    """A failed pull's reason as a short label for counters: lease_ended (the producer's lease board
    said RELEASED after the data READ), no_lease_record, integrity, else transfer (READ errors,
    bad block ids, handshakes, injected faults)."""
    for prefix, kind in FAILURE_KINDS.items():
        if reason.startswith(prefix):
            return kind
    return "transfer"


@dataclass(frozen=True)
class RankIdentity:
    engine_id: str
    role: str
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    dcp_size: int = 1
    block_size: int = 16

    @property
    def reader_name(self) -> str:
        return f"{self.engine_id}:{self.pp_rank}:{self.tp_rank}"


@dataclass(frozen=True)
class PullRequest:
    """What a reader needs to know of a request prefilled elsewhere (`TransferParams.pull_request`)."""

    remote_engine_id: str
    remote_block_ids: Sequence[int]
    remote_tp_size: int
    remote_pp_size: int
    remote_dcp_size: int
    local_block_ids: Sequence[int]
    num_tokens: int
    # The producer's id of this request, when it differs from ours (vLLM suffixes ids
    # per engine): notices must name the producer's lease.
    remote_request_id: str | None = None

    @property
    def shape(self) -> Shape:
        return (self.remote_engine_id, self.remote_tp_size, self.remote_pp_size, self.remote_dcp_size)


@dataclass(frozen=True)
class PullTiming:
    """Where one finished pull's time went (`RankTransfer.timings`; the transfer benchmark reads it)."""

    data_s: float  # start -> every data READ done
    confirm_s: float  # -> every lease record seen HELD (retries included)
    verify_s: float  # checksum recomputation and comparison
    checked_blocks: int


@dataclass(frozen=True)
class StepResult:
    """Everything one `RankTransfer.step()` produced."""

    done: dict[str, float] = field(default_factory=dict)  # pulled request -> seconds
    failed: dict[str, str] = field(default_factory=dict)  # pulled request -> reason
    invalid_block_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)  # of failed pulls
    released: tuple[str, ...] = ()  # leases freed by readers, early notices or `release()`
    expired: tuple[str, ...] = ()  # leases freed because no reader came in time

    @property
    def finished_sending(self) -> set[str]:
        return set(self.released) | set(self.expired)

    @property
    def finished_recving(self) -> set[str]:
        return set(self.done) | set(self.failed)
