"""The transfer ledger: every in-flight P->D handoff and its one verdict.

Life cycle of a handoff:

  open      the router handed a prefilled request to a decode engine;
  report    decode reporting units (synthetic: each rank; vLLM: the engine,
            whose own aggregator already merged its ranks) send per-request
            outcomes; `KVOutputAggregator` (one per decode engine) turns them
            into one verdict when every unit has reported;
  rank_died a dead unit's last outputs are deferred and replayed, so the
            progress it made is not lost;
  verdict   ok or failed; it feeds the (decode, prefill) circuit breaker and
            closes the handoff;
  expire    a handoff with no verdict past its deadline is failed (its
            prefill blocks are released by the caller): no request waits
            forever for KV.

Pure: no Ray; the coordinator actor owns one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from actors.kv.aggregator import KVConnectorOutput, KVOutputAggregator
from actors.kv.breaker import CircuitBreaker


@dataclass(frozen=True)
class Verdict:
    req_id: str
    prefill_id: str | None
    decode_id: str
    ok: bool
    reason: str = ""
    invalid_block_ids: frozenset[int] = frozenset()


@dataclass
class Handoff:
    req_id: str
    prefill_id: str
    decode_id: str
    opened_at: float
    deadline: float


@dataclass
class BreakerSettings:
    failure_threshold: int = 3
    cooldown_s: float = 10.0
    probe_window_s: float = 5.0


@dataclass
class TransferLedger:
    deadline_s: float = 60.0
    breaker_settings: BreakerSettings = field(default_factory=BreakerSettings)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._handoffs: dict[str, Handoff] = {}
        self._aggregators: dict[str, KVOutputAggregator] = {}
        self._breakers: dict[tuple[str, str], CircuitBreaker] = {}
        self.verdicts = {"ok": 0, "failed": 0, "expired": 0}

    # -------------------------------------------------------------- breakers
    def breaker(self, decode_id: str, prefill_id: str) -> CircuitBreaker:
        key = (decode_id, prefill_id)
        if key not in self._breakers:
            s = self.breaker_settings
            self._breakers[key] = CircuitBreaker(
                f"{prefill_id}->{decode_id}", cooldown_s=s.cooldown_s,
                failure_threshold=s.failure_threshold, probe_window_s=s.probe_window_s, clock=self.clock,
            )
        return self._breakers[key]

    def is_open(self, decode_id: str, prefill_id: str) -> bool:
        b = self._breakers.get((decode_id, prefill_id))
        return b is not None and b.is_open

    def breaker_states(self) -> dict[str, dict]:
        return {f"{p}->{d}": b.snapshot() for (d, p), b in self._breakers.items()}

    def record_handshake_failure(self, decode_id: str, prefill_id: str) -> None:
        self.breaker(decode_id, prefill_id).record_failure()

    def forget_engine(self, engine_id: str) -> list[Handoff]:
        """An engine left: its breakers go, its open handoffs fail (returned)."""
        self._breakers = {k: b for k, b in self._breakers.items() if engine_id not in k}
        self._aggregators.pop(engine_id, None)
        gone = [h for h in self._handoffs.values() if engine_id in (h.prefill_id, h.decode_id)]
        for h in gone:
            del self._handoffs[h.req_id]
            self.verdicts["failed"] += 1
        return gone

    # -------------------------------------------------------------- handoffs
    def open(self, req_id: str, prefill_id: str, decode_id: str, deadline_s: float | None = None) -> Handoff:
        now = self.clock()
        handoff = Handoff(req_id, prefill_id, decode_id, now, now + (deadline_s or self.deadline_s))
        self._handoffs[req_id] = handoff
        return handoff

    def in_flight(self) -> list[Handoff]:
        return list(self._handoffs.values())

    def _aggregator(self, decode_id: str, expected: int) -> KVOutputAggregator:
        agg = self._aggregators.get(decode_id)
        if agg is None:
            agg = self._aggregators[decode_id] = KVOutputAggregator(max(1, expected))
        return agg

    def report(self, decode_id: str, outputs: list[KVConnectorOutput | None]) -> list[Verdict]:
        """Per-unit outputs of one step of a decode engine -> verdicts that became final."""
        expected = max((o.expected_finished_count for o in outputs if o), default=1) or 1
        merged = self._aggregator(decode_id, expected).aggregate(outputs)
        verdicts = []
        for req_id in sorted(merged.finished_recving):
            failed = req_id in merged.failed_recving
            verdicts.append(self._close(req_id, decode_id, not failed,
                                        "KV pull failed" if failed else "",
                                        frozenset(merged.invalid_block_ids) if failed else frozenset()))
        return verdicts

    def rank_died(self, decode_id: str, last_outputs: list[KVConnectorOutput | None]) -> None:
        """Keep what a dead unit reported; it is replayed with the next report."""
        agg = self._aggregators.get(decode_id)
        if agg is not None:
            agg.ft_defer_kv_connector_outputs(last_outputs)

    def _close(self, req_id: str, decode_id: str, ok: bool, reason: str,
               invalid: frozenset[int]) -> Verdict:
        handoff = self._handoffs.pop(req_id, None)
        prefill_id = handoff.prefill_id if handoff else None
        if prefill_id is not None:
            b = self.breaker(decode_id, prefill_id)
            b.record_success() if ok else b.record_failure()
        self.verdicts["ok" if ok else "failed"] += 1
        return Verdict(req_id, prefill_id, decode_id, ok, reason, invalid)

    def expire(self) -> list[Verdict]:
        """Fail every handoff past its deadline."""
        now = self.clock()
        late = [h for h in self._handoffs.values() if now >= h.deadline]
        out = []
        for h in late:
            del self._handoffs[h.req_id]
            agg = self._aggregators.get(h.decode_id)
            if agg is not None:
                agg.forget(h.req_id)
            self.breaker(h.decode_id, h.prefill_id).record_failure()
            self.verdicts["expired"] += 1
            out.append(Verdict(h.req_id, h.prefill_id, h.decode_id, False,
                               f"no verdict within {h.deadline - h.opened_at:.0f}s"))
        return out

    def snapshot(self) -> dict:
        return {"in_flight": len(self._handoffs), "verdicts": dict(self.verdicts),
                "breakers": self.breaker_states()}
