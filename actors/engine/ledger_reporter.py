"""A decode engine's ledger traffic to the coordinator, coalesced: one `report_batch` call carries every
record since the previous call, in the order they happened, with one call in flight at a time.

Invariants: nothing on a request's path waits for the ledger (recording returns at once); under
load batches grow, calls do not multiply (at most one per `max_delay_s` per engine); a lost call's
records are not resent (their handoffs expire at the coordinator and fail there: fail closed); past
`max_pending` waiting records new ones are dropped and counted. The coordinator handle is asked for
at each call, so one found again after a restart is used at once. The life cycle of a record:
`LedgerReporter`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.kv.aggregator import KVConnectorOutput
from actors.control.ledger_records import (
    HandoffAborted,
    HandoffOpened,
    HandshakeFailure,
    LedgerBatch,
    LedgerRecord,
    TransferOutcomes,
    UnitDied,
    UnitOutcome,
)

logger = logging.getLogger("raypd.engine")

DEFAULT_MAX_DELAY_S = 0.02  # what a verdict may wait to reach the breakers (off every request's path)


@dataclass
class ReporterStats:
    batches: int = 0
    records: int = 0
    lost_batches: int = 0
    lost_records: int = 0
    dropped: int = 0  # records refused because `max_pending` were waiting


class LedgerReporter:
    """Life cycle of a record:

      recorded   `opened` / `aborted` / `outcomes` / `unit_died` / `handshake_failed` append a
                 typed record (`actors.control.ledger_records`) and return at once: nothing on a request's
                 path waits for the ledger;
      flushed    `max_delay_s` after the first pending record (0: at the end of this event-loop
                 tick); while a batch is in flight, records wait for its answer and go in the
                 next one, no sooner than `max_delay_s` after it: under load batches grow,
                 calls do not multiply (at most one per `max_delay_s` per engine);
      applied    the coordinator applies a batch in order (`Coordinator.report_batch`);
      lost       a call that fails or passes `call_timeout_s` (the coordinator restarting
                 beyond Ray's retries) is counted, its records are not resent: a handoff
                 whose verdict was lost expires at the coordinator and fails there (fail
                 closed: only the breaker learns it late);
      bounded    past `max_pending` waiting records new ones are dropped and counted;
      flushed    `flush(timeout_s)` waits until everything recorded was answered (shutdown,
                 tests).

    The coordinator handle is asked for at each call (`coordinator()`), so a coordinator
    found again by name after a restart is used at once.
    """

    def __init__(self, engine_id: str, coordinator: Callable[[], Any], max_delay_s: float = DEFAULT_MAX_DELAY_S,
                 max_pending: int = 100_000, call_timeout_s: float = 30.0):
        self.engine_id = engine_id
        self.coordinator = coordinator
        self.max_delay_s, self.max_pending, self.call_timeout_s = max_delay_s, max_pending, call_timeout_s
        self.stats = ReporterStats()
        self._pending: list[LedgerRecord] = []
        self._timer: asyncio.Handle | None = None
        self._sender: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------- records
    def opened(self, req_id: str, prefill_id: str) -> None:
        self._add(HandoffOpened(req_id, prefill_id))

    def aborted(self, req_id: str) -> None:
        self._add(HandoffAborted(req_id))

    def outcomes(self, outputs: list[KVConnectorOutput | None]) -> None:
        """One step's per-unit outputs (their receive side travels, compact)."""
        self._add(TransferOutcomes(tuple(UnitOutcome.of(o) if o is not None else None for o in outputs)))

    def unit_died(self, collected: list[KVConnectorOutput | None]) -> None:
        self._add(UnitDied(tuple(UnitOutcome.of(o) if o is not None else None for o in collected)))

    def handshake_failed(self, prefill_id: str, reason: str, req_id: str | None = None) -> None:
        self._add(HandshakeFailure(prefill_id, reason, req_id))

    @property
    def pending(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------ delivery
    def _add(self, record: LedgerRecord) -> None:
        if len(self._pending) >= self.max_pending:
            self.stats.dropped += 1
            return
        self._pending.append(record)
        self._idle.clear()
        if self._sender is None and self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = (loop.call_later(self.max_delay_s, self._start) if self.max_delay_s > 0
                           else loop.call_soon(self._start))

    def _start(self) -> None:
        self._timer = None
        if self._sender is None and self._pending:
            self._sender = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        try:
            while self._pending:
                batch = LedgerBatch(self.engine_id, tuple(self._pending))
                self._pending = []
                sent_at = time.monotonic()
                try:
                    handle = self.coordinator()
                    if handle is None:
                        raise RuntimeError("no coordinator")
                    await asyncio.wait_for(handle.report_batch.remote(batch), self.call_timeout_s)
                    self.stats.batches += 1
                    self.stats.records += len(batch.records)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the coordinator is away: its deadlines decide
                    self.stats.lost_batches += 1
                    self.stats.lost_records += len(batch.records)
                    logger.warning("%s: %d ledger records not delivered: %s", self.engine_id, len(batch.records), exc)
                wait = sent_at + self.max_delay_s - time.monotonic()
                if self._pending and wait > 0:
                    await asyncio.sleep(wait)  # at most one call per max_delay_s: what arrives meanwhile joins
        finally:
            self._sender = None
            if not self._pending:  # (cancelled with records left: the next record sends them)
                self._idle.set()

    async def flush(self, timeout_s: float = 10.0) -> bool:
        """Send what is pending now and wait for every answer; False when `timeout_s` passed first."""
        if self._timer is not None:
            self._timer.cancel()
            self._start()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
