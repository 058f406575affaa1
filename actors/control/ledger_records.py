"""What a decode engine sends the coordinator's ledger, and what the coordinator reports about itself.

Life cycle of the records of one handoff (`actors.engine.ledger_reporter` sends them, coalesced;
`actors.control.handoff_desk` applies them, in the engine's order):

  1. `HandoffOpened`     the decode engine received a prefilled request;
  2. `TransferOutcomes`  per step, each reporting unit's `UnitOutcome` (the receive side of a
                         `KVConnectorOutput`): the ledger's aggregator turns them into one verdict
                         once every unit reported; or `UnitDied` (a unit died mid-step: what the
                         step collected), or `HandshakeFailure` (the pull could not even start);
  3. `HandoffAborted`    instead, when the client went away first.

`LedgerBatch` carries one engine's records since its previous batch. `ControlStats` is what the
coordinator absorbed (the control-plane benchmark reads it), and the restarts it awaits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Union

from actors.kv.aggregator import KVConnectorOutput


# Records are NamedTuples: the ledger's hot wire format (one record per handoff and step), and a
# NamedTuple unpickles several times faster than a dataclass holding sets.
class HandoffOpened(NamedTuple):
    """The decode engine received a prefilled request: the ledger watches its handoff."""

    req_id: str
    prefill_id: str


class HandoffAborted(NamedTuple):
    """The client went away before a verdict: the handoff closes, no breaker moves."""

    req_id: str


class UnitOutcome(NamedTuple):
    """One reporting unit's receive outcomes in one step: a `KVConnectorOutput`'s receive side."""

    finished: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()  # finished, but the pull failed
    invalid_block_ids: tuple[int, ...] = ()
    expected: int = 0  # units that must report a request (0: no opinion)
    reasons: tuple[tuple[str, str], ...] = ()  # (failed request, why) where the unit knows

    @classmethod
    def of(cls, out: KVConnectorOutput) -> "UnitOutcome":
        return cls(tuple(out.finished_recving), tuple(out.failed_recving), tuple(out.invalid_block_ids),
                   out.expected_finished_count, tuple(out.failure_reasons.items()))

    def output(self) -> KVConnectorOutput:
        return KVConnectorOutput(finished_recving=set(self.finished), failed_recving=set(self.failed),
                                 invalid_block_ids=set(self.invalid_block_ids), expected_finished_count=self.expected,
                                 failure_reasons=dict(self.reasons))


class TransferOutcomes(NamedTuple):
    """One step's per-unit outcomes (vLLM: one unit, its merged workers; synthetic: a rank each)."""

    units: tuple[UnitOutcome | None, ...]


class UnitDied(NamedTuple):
    """A decode unit died mid-step: what the step collected (salvaged and replayed by the ledger)."""

    collected: tuple[UnitOutcome | None, ...]


class HandshakeFailure(NamedTuple):
    """The decode side could not handshake with a prefill engine (decides `req_id`'s handoff, if open)."""

    prefill_id: str
    reason: str
    req_id: str | None = None


LedgerRecord = Union[HandoffOpened, HandoffAborted, TransferOutcomes, UnitDied, HandshakeFailure]


@dataclass(frozen=True)
class LedgerBatch:
    """A decode engine's ledger records since its last batch, in the order they happened."""

    decode_id: str
    records: tuple[LedgerRecord, ...]


@dataclass(frozen=True)
class ControlStats:
    """What the coordinator absorbed since it started (`raypd status`; the control-plane benchmark)."""

    engines: int
    pairs: int
    handoffs_in_flight: int
    verdicts: dict[str, int]
    ledger_batches: int
    ledger_records: int
    kv_calls: int
    kv_events: int  # events as the engines' relays delivered them (vLLM's BlockStored/Removed/Cleared)
    kv_blocks: int  # block hashes those events carried
    index_blocks: int  # blocks the prefix index holds now
    route_builds: int  # RouteTables built (once per change)
    route_calls: int
    route_unchanged: int  # route calls answered "your copy is current"
    startup_timeouts: dict[str, int] = field(default_factory=dict)  # engine -> start-up deadlines it missed
    # restarted engines not registered again yet -> seconds left to their start-up deadline (`startup_watch`)
    startups_awaited: dict[str, float] = field(default_factory=dict)
    probe_failures: int = 0  # liveness probes unanswered (or a stuck core), hung or not in the end
    probes_busy: int = 0  # probes unanswered while the engine called the coordinator: busy, not hung
    startup_deadline_s: float = 0.0  # a restarted engine's start-up deadline now (fixed, or derived: `startup_watch`)
    measured_start_s: float | None = None  # the longest start an engine reported at its registration


@dataclass(frozen=True)
class EngineKills:
    """Engines this coordinator incarnation killed, per engine, by reason (`Coordinator.kills`)."""

    hung: dict[str, int] = field(default_factory=dict)  # found hung by its probes (`liveness`)
    startup_timeout: dict[str, int] = field(default_factory=dict)  # no registration by the start-up deadline

    def total(self) -> int:
        return sum(self.hung.values()) + sum(self.startup_timeout.values())
