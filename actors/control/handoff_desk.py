"""The coordinator's handoff desk: decode engines' ledger records in, verdicts out, deadlines kept.

`apply(LedgerBatch)` takes one engine's records in the order the engine sent them, each O(1) in the
handoffs and pairs the ledger holds; verdicts feed the pair breakers; a handoff past its deadline
fails and its prefill engine is told to let go. Nothing ticks: the expiry task sleeps until the
earliest deadline. Pure asyncio: no Ray (the coordinator passes how to release and how to log).
The life cycle of a handoff at the desk: `HandoffDesk`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from actors.control.ledger import TransferLedger, Verdict
from actors.kv.aggregator import KVConnectorOutput
from actors.control.ledger_records import (
    HandoffAborted,
    HandoffOpened,
    HandshakeFailure,
    LedgerBatch,
    TransferOutcomes,
    UnitDied,
)

logger = logging.getLogger("raypd.coordinator")


class HandoffDesk:
    """Life cycle of a handoff at the desk:

      opened    a `HandoffOpened` record (or `open`): the ledger watches it; the expiry
                task is woken only when this deadline is earlier than the one it sleeps
                until (with one deadline for all, it never is while handoffs are open);
      reported  `TransferOutcomes` / `UnitDied` / `HandshakeFailure` records become
                verdicts in the ledger (they feed the pair breakers); a failed one is an
                event with the verdict's reason (the reader's own, when its unit said
                why); a handshake failure also lets the prefill engine go;
      aborted   `HandoffAborted`: closed, no breaker moves;
      expired   `run_expiry()` sleeps until the earliest deadline (nothing ticks); what
                is past it fails and the prefill engine is told to let go.

    `apply(LedgerBatch)` takes one engine's records in the order the engine sent
    them; the cost per record is O(1) in the handoffs and pairs the ledger holds.
    Pure asyncio: no Ray (the coordinator passes how to release and how to log).
    """

    def __init__(self, ledger: TransferLedger, release: Callable[[str | None, str], None],
                 event: Callable[..., None]):
        self.ledger = ledger
        self.release = release  # (prefill id, request id): ask the prefill engine to let go (best effort)
        self.event = event  # (kind, engine id, **fields): the coordinator's event log
        self.batches = 0
        self.records = 0
        self._opened = asyncio.Event()
        self._expiry_at: float | None = None  # the deadline run_expiry sleeps until (None: none)

    def apply(self, batch: LedgerBatch) -> int:
        """One decode engine's records, in its order; returns how many were applied."""
        d = batch.decode_id
        self.batches += 1
        self.records += len(batch.records)
        for rec in batch.records:
            kind = type(rec)
            if kind is TransferOutcomes:
                self.report(d, [u.output() if u is not None else None for u in rec.units])
            elif kind is HandoffOpened:
                self.open(rec.req_id, rec.prefill_id, d)
            elif kind is HandoffAborted:
                self.ledger.abort(rec.req_id)
            elif kind is UnitDied:
                self.unit_died(d, [u.output() if u is not None else None for u in rec.collected])
            elif kind is HandshakeFailure:
                self.handshake_failed(d, rec.prefill_id, rec.reason, rec.req_id)
            else:
                logger.warning("%s: unknown ledger record %s ignored", d, kind.__name__)
        return len(batch.records)

    def open(self, req_id: str, prefill_id: str, decode_id: str) -> None:
        handoff = self.ledger.open(req_id, prefill_id, decode_id)
        if self._expiry_at is None or handoff.deadline < self._expiry_at:
            self._opened.set()  # the expiry task sleeps past this deadline (or not at all): wake it

    def report(self, decode_id: str, outputs: list[KVConnectorOutput | None]) -> list[Verdict]:
        return self._verdicts(decode_id, self.ledger.report(decode_id, outputs))

    def unit_died(self, decode_id: str, collected: list[KVConnectorOutput | None]) -> list[Verdict]:
        self.event("unit_died", decode_id)
        return self._verdicts(decode_id, self.ledger.unit_died(decode_id, collected))

    def handshake_failed(self, decode_id: str, prefill_id: str, reason: str, req_id: str | None) -> None:
        verdict = self.ledger.handshake_failed(decode_id, prefill_id, reason, req_id)
        self.event("handshake_failed", decode_id, prefill_id=prefill_id, reason=reason)
        if verdict is not None:
            self.release(prefill_id, verdict.req_id)

    def _verdicts(self, decode_id: str, verdicts: list[Verdict]) -> list[Verdict]:
        for v in verdicts:
            if not v.ok:
                self.event("transfer_failed", decode_id, req_id=v.req_id, prefill_id=v.prefill_id, reason=v.reason)
        return verdicts

    async def run_expiry(self) -> Any:
        """Sleeps until the earliest handoff deadline (or until an earlier one is opened); nothing ticks."""
        while True:
            deadline = self._expiry_at = self.ledger.next_deadline()
            self._opened.clear()
            try:
                if deadline is None:
                    await self._opened.wait()
                else:
                    await asyncio.wait_for(self._opened.wait(), max(0.0, deadline - self.ledger.clock()) + 0.01)
            except asyncio.TimeoutError:
                pass
            for v in self.ledger.expire():
                self.event("handoff_expired", v.decode_id, req_id=v.req_id, prefill_id=v.prefill_id)
                self.release(v.prefill_id, v.req_id)
