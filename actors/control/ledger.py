"""The transfer ledger: every in-flight P->D handoff, its one verdict, and the pair breakers.

The ledger is the only owner of the (prefill, decode) circuit breakers: routers
read their states with the routes and report prefill failures here; decode
engines report transfer outcomes here; nobody else keeps a breaker for a pair.

Life cycle of a handoff:

  open       a decode engine received a prefilled request (its transfer params);
  report     decode reporting units (synthetic: each rank; vLLM: the engine,
             whose own aggregator already merged its workers) send per-request
             outcomes; `KVOutputAggregator` (one per decode engine) turns them
             into one verdict once every unit has reported;
  unit_died  a step cut short by a dead unit: what the step had collected is
             stashed (`ft_defer_kv_connector_outputs`) and replayed at once, so
             the verdicts still complete;
  verdict    ok or failed; it feeds the pair breaker and closes the handoff;
  abort      the client went away: the handoff closes, no breaker is touched;
  expire     no verdict by the deadline: failed (the caller releases the
             prefill blocks); nobody waits forever for KV.

Breaker inputs: transfer verdicts, handshake failures, prefill failures the
routers report, expired handoffs, and an engine's death (which opens every
pair it is part of at once). Each pair keeps its last failure reason.

Pure: no Ray; the coordinator actor owns one.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from actors.kv.aggregator import KVConnectorOutput, KVOutputAggregator
from actors.kv.breaker import CircuitBreaker
from actors.protocol import PairState


class BreakerConfig(BaseModel):
    """Per (prefill, decode) pair; the deployment file's `breaker:` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    failure_threshold: int = Field(3, ge=1)
    cooldown_s: float = Field(10.0, gt=0)
    probe_window_s: float = Field(5.0, gt=0)


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


@dataclass(frozen=True)
class LedgerSnapshot:
    in_flight: int
    verdicts: dict[str, int]
    breakers: tuple[PairState, ...]
    awaiting_units: dict[str, int] = field(default_factory=dict)  # handoff -> units yet to report


class TransferLedger:
    def __init__(self, breaker: BreakerConfig | None = None, deadline_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.breaker_config = breaker or BreakerConfig()
        self.deadline_s = deadline_s
        self.clock = clock
        self._handoffs: dict[str, Handoff] = {}
        self._aggregators: dict[str, KVOutputAggregator] = {}
        self._breakers: dict[tuple[str, str], CircuitBreaker] = {}  # (decode, prefill)
        self._reasons: dict[tuple[str, str], str] = {}
        self.verdicts = {"ok": 0, "failed": 0, "expired": 0, "aborted": 0}

    # -------------------------------------------------------------- breakers
    def breaker(self, decode_id: str, prefill_id: str) -> CircuitBreaker:
        key = (decode_id, prefill_id)
        if key not in self._breakers:
            c = self.breaker_config
            self._breakers[key] = CircuitBreaker(
                f"{prefill_id}->{decode_id}", cooldown_s=c.cooldown_s,
                failure_threshold=c.failure_threshold, probe_window_s=c.probe_window_s, clock=self.clock,
            )
        return self._breakers[key]

    def is_open(self, decode_id: str, prefill_id: str) -> bool:
        """True when the pair may not take a request now (cooling down, or its probe is out)."""
        b = self._breakers.get((decode_id, prefill_id))
        return b is not None and b.is_open

    def route_state(self, decode_id: str, prefill_id: str) -> str:
        b = self._breakers.get((decode_id, prefill_id))
        return "closed" if b is None else b.state

    def admit_probe(self, decode_id: str, prefill_id: str) -> bool:
        """A router asks to send the half-open pair's probe; granted once cluster-wide."""
        return self.breaker(decode_id, prefill_id).allow()

    def record_failure(self, decode_id: str, prefill_id: str, reason: str) -> None:
        self.breaker(decode_id, prefill_id).record_failure()
        self._reasons[(decode_id, prefill_id)] = reason

    def record_success(self, decode_id: str, prefill_id: str) -> None:
        self.breaker(decode_id, prefill_id).record_success()

    def prefill_failed(self, decode_id: str, prefill_id: str, reason: str) -> None:
        """A router's prefill call failed for a reason of the engine's (never a client error)."""
        self.record_failure(decode_id, prefill_id, f"prefill failed: {reason}")

    def handshake_failed(self, decode_id: str, prefill_id: str, reason: str, req_id: str | None = None
                         ) -> Verdict | None:
        """The decode side could not handshake with the prefill engine (bad payload,
        incompatible peer, dead peer at connect). The request's handoff, if open, is
        decided by it: one failure per request, whoever reports it first."""
        why = f"handshake failed: {reason}"
        handoff = self._handoffs.get(req_id) if req_id else None
        if handoff is not None and handoff.decode_id == decode_id:
            self._forget_counts(handoff)
            return self._close(req_id, decode_id, False, why, frozenset())
        self.record_failure(decode_id, prefill_id, why)
        return None

    def engine_died(self, engine_id: str, reason: str, pairs: list[tuple[str, str]]) -> list[Handoff]:
        """An engine incarnation is gone: every pair it is part of, `(decode, prefill)`, opens
        at once (its next incarnation earns its traffic back through a probe), and its open
        handoffs end without a verdict (returned, so the caller can release the prefill side)."""
        why = f"engine {engine_id} died: {reason}"
        for d, p in pairs:
            self._trip(d, p, why)
        return self._drop_handoffs(engine_id)

    def engine_left(self, engine_id: str) -> list[Handoff]:
        """An engine shut down on purpose: its breakers go, its open handoffs end (returned)."""
        for key in [k for k in self._breakers if engine_id in k]:
            self._breakers.pop(key)
            self._reasons.pop(key, None)
        return self._drop_handoffs(engine_id)

    def _drop_handoffs(self, engine_id: str) -> list[Handoff]:
        self._aggregators.pop(engine_id, None)
        gone = [h for h in self._handoffs.values() if engine_id in (h.prefill_id, h.decode_id)]
        for h in gone:
            del self._handoffs[h.req_id]
            self._forget_counts(h)
            self.verdicts["failed"] += 1
        return gone

    def _trip(self, decode_id: str, prefill_id: str, reason: str) -> None:
        b = self.breaker(decode_id, prefill_id)
        for _ in range(b.failure_threshold + 1):
            if b.state == "open":
                break
            b.record_failure()  # the breaker's own rule opens it: threshold failures, or a failed probe
        self._reasons[(decode_id, prefill_id)] = reason

    def pair_states(self) -> tuple[PairState, ...]:
        out = []
        for (d, p), b in sorted(self._breakers.items()):
            s = b.snapshot()
            out.append(PairState(p, d, s["state"], s["consecutive_failures"], s["opened_count"],
                                 self._reasons.get((d, p), ""), s["probe_in_flight"]))
        return tuple(out)

    # -------------------------------------------------------------- handoffs
    def open(self, req_id: str, prefill_id: str, decode_id: str, deadline_s: float | None = None) -> Handoff:
        now = self.clock()
        handoff = Handoff(req_id, prefill_id, decode_id, now, now + (deadline_s or self.deadline_s))
        self._handoffs[req_id] = handoff
        return handoff

    def in_flight(self) -> list[Handoff]:
        return list(self._handoffs.values())

    def next_deadline(self) -> float | None:
        return min((h.deadline for h in self._handoffs.values()), default=None)

    def abort(self, req_id: str) -> Handoff | None:
        """The client went away: close the handoff; no breaker is touched."""
        handoff = self._handoffs.pop(req_id, None)
        if handoff is not None:
            self._forget_counts(handoff)
            self.verdicts["aborted"] += 1
        return handoff

    def _aggregator(self, decode_id: str, expected: int) -> KVOutputAggregator:
        agg = self._aggregators.get(decode_id)
        if agg is None:
            agg = self._aggregators[decode_id] = KVOutputAggregator(max(1, expected))
        return agg

    def _forget_counts(self, handoff: Handoff) -> None:
        agg = self._aggregators.get(handoff.decode_id)
        if agg is not None:
            agg.forget(handoff.req_id)

    def _open_only(self, outputs: list[KVConnectorOutput | None]) -> list[KVConnectorOutput | None]:
        """Outcomes of requests with an open handoff: nothing is counted for aborted, expired or
        already decided requests (a count nobody completes would stay forever)."""
        def keep(o: KVConnectorOutput) -> KVConnectorOutput:
            return dataclasses.replace(o, finished_recving={r for r in o.finished_recving if r in self._handoffs},
                                       failed_recving={r for r in o.failed_recving if r in self._handoffs})
        return [keep(o) if o is not None else None for o in outputs]

    def report(self, decode_id: str, outputs: list[KVConnectorOutput | None]) -> list[Verdict]:
        """Per-unit outputs of one step of a decode engine -> verdicts that became final."""
        expected = max((o.expected_finished_count for o in outputs if o), default=1) or 1
        merged = self._aggregator(decode_id, expected).aggregate(self._open_only(outputs))
        verdicts = []
        for req_id in sorted(merged.finished_recving):
            failed = req_id in merged.failed_recving
            if req_id not in self._handoffs:
                continue  # aborted, expired or decided by a handshake failure: nothing left to decide
            verdicts.append(self._close(req_id, decode_id, not failed,
                                        "KV pull failed" if failed else "",
                                        frozenset(merged.invalid_block_ids) if failed else frozenset()))
        return verdicts

    def unit_died(self, decode_id: str, collected: list[KVConnectorOutput | None]) -> list[Verdict]:
        """A unit died mid-step: the step's collected outputs (the dead unit's own failures
        included) are stashed and replayed at once, so no unit's progress is lost."""
        agg = self._aggregator(decode_id, max((o.expected_finished_count for o in collected if o), default=1))
        agg.ft_defer_kv_connector_outputs(self._open_only(collected))
        return self.report(decode_id, [])

    def _close(self, req_id: str, decode_id: str, ok: bool, reason: str,
               invalid: frozenset[int]) -> Verdict:
        handoff = self._handoffs.pop(req_id)
        if ok:
            self.record_success(decode_id, handoff.prefill_id)
        else:
            self.record_failure(decode_id, handoff.prefill_id, reason)
        self.verdicts["ok" if ok else "failed"] += 1
        return Verdict(req_id, handoff.prefill_id, decode_id, ok, reason, invalid)

    def expire(self) -> list[Verdict]:
        """Fail every handoff past its deadline."""
        now = self.clock()
        late = [h for h in self._handoffs.values() if now >= h.deadline]
        out = []
        for h in late:
            del self._handoffs[h.req_id]
            self._forget_counts(h)
            reason = f"no verdict within {h.deadline - h.opened_at:.0f}s"
            self.record_failure(h.decode_id, h.prefill_id, reason)
            self.verdicts["expired"] += 1
            out.append(Verdict(h.req_id, h.prefill_id, h.decode_id, False, reason))
        return out

    def snapshot(self) -> LedgerSnapshot:
        awaiting = {}
        for agg in self._aggregators.values():
            awaiting.update({r: n for r, n in agg.pending().recving.items() if r in self._handoffs})
        return LedgerSnapshot(len(self._handoffs), dict(self.verdicts), self.pair_states(), awaiting)
