"""The transfer ledger: every in-flight P->D handoff, its one verdict, and the pair breakers.

The ledger is the only owner of the (prefill, decode) circuit breakers: routers read their states
with the routes and report prefill failures here; decode engines report transfer outcomes here;
nobody else keeps a breaker for a pair. Invariants: a handoff gets exactly one verdict (or ends
aborted, expired, evicted or left), nobody waits forever for KV (a handoff without a verdict by its
deadline fails), and a report costs O(1) in the number of handoffs and pairs. Pure: no Ray; the
coordinator actor owns one. The life cycle of a handoff: `TransferLedger`.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from actors.control.breaker_config import BreakerConfig
from actors.kv.aggregator import KVConnectorOutput, KVOutputAggregator
from actors.control.breaker import CircuitBreaker
from actors.routes import BreakerState, PairState

Pair = tuple[str, str]  # (decode, prefill)


@dataclass(frozen=True)
class Verdict:
    req_id: str
    prefill_id: str | None
    decode_id: str
    ok: bool
    reason: str = ""
    invalid_block_ids: frozenset[int] = frozenset()
    source: str = "report"  # report | salvage | handshake | expired: what decided it


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
    ended_by: dict[str, int] = field(default_factory=dict)  # how handoffs ended (see `TransferLedger`)


class TransferLedger:
    """Life cycle of a handoff:

      open       a decode engine received a prefilled request (its transfer params);
      report     decode reporting units (synthetic: each rank; vLLM: the engine,
                 whose own aggregator already merged its workers) send per-request
                 outcomes; `KVOutputAggregator` (one per decode engine) turns them
                 into one verdict once every unit has reported;
      unit_died  a step cut short by a dead unit (synthetic engines: a rank actor;
                 vLLM has no such step, its workers die with their engine core):
                 what the step had collected is stashed
                 (`ft_defer_kv_connector_outputs`) and replayed at once, so the
                 verdicts still complete;
      verdict    ok or failed; it feeds the pair breaker and closes the handoff;
                 it records what decided it (`Verdict.source`; counted in
                 `ended_by`): report | salvage | handshake, and the handoffs that
                 end without one: aborted | expired | eviction (its engine died) |
                 left (its engine shut down);
      abort      the client went away: the handoff closes, no breaker is touched;
      expire     no verdict by the deadline: failed (the caller releases the
                 prefill blocks); nobody waits forever for KV.

    Breaker inputs: transfer verdicts, handshake failures, prefill failures the
    routers report, expired handoffs, and an engine's death (which opens every
    pair it is part of at once). Each pair keeps its last failure reason.

    Cost per report is O(1) in the number of handoffs and pairs: deadlines sit in a
    heap (stale entries skipped, compacted when they outnumber the live ones),
    open handoffs are counted per engine, and every pair's `PairState` is kept
    ready and refreshed only when its breaker moves (a report, a probe, or time:
    cooldowns and probe windows that end are due in a second heap). `changes`
    counts visible moves, so the coordinator rebuilds the routers' table only then.

    Pure: no Ray; the coordinator actor owns one.
    """

    def __init__(self, breaker: BreakerConfig | None = None, deadline_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.breaker_config = breaker or BreakerConfig()
        self.deadline_s = deadline_s
        self.clock = clock
        self._handoffs: dict[str, Handoff] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap of (deadline, req id); stale entries skipped
        self._per_engine: Counter[str] = Counter()  # engine -> open handoffs it is part of
        self._aggregators: dict[str, KVOutputAggregator] = {}
        self._breakers: dict[Pair, CircuitBreaker] = {}
        self._reasons: dict[Pair, str] = {}
        self._states: dict[Pair, PairState] = {}  # every pair's breaker as routers see it, kept current
        self._sorted_states: tuple[PairState, ...] | None = None
        self._sorted_keys: list[Pair] | None = None  # re-sorted only when pairs come or go
        self.moved: set[Pair] = set()  # pairs whose state changed since the route book last took them
        self._timed: list[tuple[float, Pair]] = []  # heap: when a breaker moves by time alone
        self.changes = 0  # visible breaker moves so far (the routers' table is rebuilt only on a change)
        self.verdicts = {"ok": 0, "failed": 0, "expired": 0, "aborted": 0}
        self.ended_by: Counter[str] = Counter()

    # -------------------------------------------------------------- breakers
    def breaker(self, decode_id: str, prefill_id: str) -> CircuitBreaker:
        key = (decode_id, prefill_id)
        b = self._breakers.get(key)
        if b is None:
            c = self.breaker_config
            b = self._breakers[key] = CircuitBreaker(
                f"{prefill_id}->{decode_id}", cooldown_s=c.cooldown_s,
                failure_threshold=c.failure_threshold, probe_window_s=c.probe_window_s, clock=self.clock,
            )
            self._moved(key)
        return b

    def state_of(self, decode_id: str, prefill_id: str) -> PairState | None:
        """The pair's breaker as of the last `advance()` (None: no breaker yet, i.e. closed)."""
        return self._states.get((decode_id, prefill_id))

    def advance(self) -> None:
        """Apply the moves time alone made (cooldowns over, probes unanswered) to the kept states."""
        now = self.clock()
        while self._timed and self._timed[0][0] <= now:
            self._moved(heapq.heappop(self._timed)[1])

    def _moved(self, key: Pair) -> None:
        """The pair's breaker may have moved: refresh its kept state; count the change if it did."""
        b = self._breakers.get(key)
        new = None
        if b is not None:
            s = b.snapshot()
            d, p = key
            new = PairState(p, d, s["state"], s["consecutive_failures"], s["opened_count"],
                            self._reasons.get(key, ""), s["probe_in_flight"])
            if new.state == BreakerState.OPEN:  # its cooldown ends by time: due then
                heapq.heappush(self._timed, (self.clock() + s["retry_in_s"] + 1e-3, key))
        old = self._states.get(key)
        if old != new:
            if new is None:
                self._states.pop(key, None)
            else:
                self._states[key] = new
            if old is None or new is None:
                self._sorted_keys = None
            self.changes += 1
            self._sorted_states = None
            self.moved.add(key)

    def is_open(self, decode_id: str, prefill_id: str) -> bool:
        """True when the pair may not take a request now (cooling down, or its probe is out)."""
        b = self._breakers.get((decode_id, prefill_id))
        return b is not None and b.is_open

    def route_state(self, decode_id: str, prefill_id: str) -> BreakerState:
        b = self._breakers.get((decode_id, prefill_id))
        return BreakerState.CLOSED if b is None else b.state

    def admit_probe(self, decode_id: str, prefill_id: str) -> bool:
        """A router asks to send the half-open pair's probe; granted once cluster-wide."""
        b = self.breaker(decode_id, prefill_id)
        granted = b.allow()
        if granted and b.state == BreakerState.HALF_OPEN:  # the probe is out until it reports or its window ends
            heapq.heappush(self._timed, (self.clock() + b.probe_window_s + 1e-3, (decode_id, prefill_id)))
        self._moved((decode_id, prefill_id))
        return granted

    def record_failure(self, decode_id: str, prefill_id: str, reason: str) -> None:
        self.breaker(decode_id, prefill_id).record_failure()
        self._reasons[(decode_id, prefill_id)] = reason
        self._moved((decode_id, prefill_id))

    def record_success(self, decode_id: str, prefill_id: str) -> None:
        b = self.breaker(decode_id, prefill_id)
        if b.consecutive_failures == 0 and b.state == BreakerState.CLOSED:
            return  # a healthy pair stays as it is (the common case: nothing to refresh)
        b.record_success()
        self._moved((decode_id, prefill_id))

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
            return self._close(req_id, decode_id, False, why, frozenset(), "handshake")
        self.record_failure(decode_id, prefill_id, why)
        return None

    def engine_died(self, engine_id: str, reason: str, pairs: list[tuple[str, str]]) -> list[Handoff]:
        """An engine incarnation is gone: every pair it is part of, `(decode, prefill)`, opens
        at once (its next incarnation earns its traffic back through a probe), and its open
        handoffs end without a verdict (returned, so the caller can release the prefill side)."""
        why = f"engine {engine_id} died: {reason}"
        for d, p in pairs:
            self._trip(d, p, why)
        return self._drop_handoffs(engine_id, "eviction")

    def engine_left(self, engine_id: str) -> list[Handoff]:
        """An engine shut down on purpose: its breakers go, its open handoffs end (returned)."""
        for key in [k for k in self._breakers if engine_id in k]:
            self._breakers.pop(key)
            self._reasons.pop(key, None)
            self._moved(key)
        return self._drop_handoffs(engine_id, "left")

    def _drop_handoffs(self, engine_id: str, why: str) -> list[Handoff]:
        self._aggregators.pop(engine_id, None)
        if not self._per_engine.get(engine_id):
            return []
        gone = [h for h in self._handoffs.values() if engine_id in (h.prefill_id, h.decode_id)]
        for h in gone:
            self._pop(h.req_id)
            self._forget_counts(h)
            self.verdicts["failed"] += 1
            self.ended_by[why] += 1
        return gone

    def _trip(self, decode_id: str, prefill_id: str, reason: str) -> None:
        b = self.breaker(decode_id, prefill_id)
        for _ in range(b.failure_threshold + 1):
            if b.state == BreakerState.OPEN:
                break
            b.record_failure()  # the breaker's own rule opens it: threshold failures, or a failed probe
        self._reasons[(decode_id, prefill_id)] = reason
        self._moved((decode_id, prefill_id))

    def pair_states(self) -> tuple[PairState, ...]:
        """Every pair's breaker, sorted by (decode, prefill)."""
        self.advance()
        if self._sorted_states is None:
            if self._sorted_keys is None:
                self._sorted_keys = sorted(self._states)
            states = self._states
            self._sorted_states = tuple(states[k] for k in self._sorted_keys)
        return self._sorted_states

    def take_moved(self) -> set[Pair]:
        """The pairs whose state changed since the last call (the route book's delta)."""
        moved, self.moved = self.moved, set()
        return moved

    # -------------------------------------------------------------- handoffs
    def open(self, req_id: str, prefill_id: str, decode_id: str, deadline_s: float | None = None) -> Handoff:
        now = self.clock()
        if req_id in self._handoffs:  # opened again (a retried call): the new one replaces it
            self._pop(req_id)
        handoff = Handoff(req_id, prefill_id, decode_id, now, now + (deadline_s or self.deadline_s))
        self._handoffs[req_id] = handoff
        self._per_engine[prefill_id] += 1
        self._per_engine[decode_id] += 1
        heapq.heappush(self._deadlines, (handoff.deadline, req_id))
        if len(self._deadlines) > 2 * len(self._handoffs) + 1024:  # mostly closed ones: compact
            self._deadlines = [(h.deadline, h.req_id) for h in self._handoffs.values()]
            heapq.heapify(self._deadlines)
        return handoff

    def _pop(self, req_id: str) -> Handoff | None:
        handoff = self._handoffs.pop(req_id, None)
        if handoff is not None:
            for engine_id in (handoff.prefill_id, handoff.decode_id):
                self._per_engine[engine_id] -= 1
                if self._per_engine[engine_id] <= 0:
                    del self._per_engine[engine_id]
        return handoff

    def in_flight(self) -> list[Handoff]:
        return list(self._handoffs.values())

    def in_flight_of(self, engine_id: str) -> int:
        """Open handoffs from or to the engine (O(1))."""
        return self._per_engine.get(engine_id, 0)

    def next_deadline(self) -> float | None:
        while self._deadlines:
            deadline, req_id = self._deadlines[0]
            h = self._handoffs.get(req_id)
            if h is not None and h.deadline == deadline:
                return deadline
            heapq.heappop(self._deadlines)  # closed meanwhile
        return None

    def abort(self, req_id: str) -> Handoff | None:
        """The client went away: close the handoff; no breaker is touched."""
        handoff = self._pop(req_id)
        if handoff is not None:
            self._forget_counts(handoff)
            self.verdicts["aborted"] += 1
            self.ended_by["aborted"] += 1
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
        handoffs = self._handoffs

        def keep(o: KVConnectorOutput) -> KVConnectorOutput:
            if all(r in handoffs for r in o.finished_recving) and all(r in handoffs for r in o.failed_recving):
                return o  # the common case: every request named is open
            return dataclasses.replace(o, finished_recving={r for r in o.finished_recving if r in handoffs},
                                       failed_recving={r for r in o.failed_recving if r in handoffs})
        return [keep(o) if o is not None else None for o in outputs]

    def report(self, decode_id: str, outputs: list[KVConnectorOutput | None], source: str = "report"
               ) -> list[Verdict]:
        """Per-unit outputs of one step of a decode engine -> verdicts that became final."""
        expected = max((o.expected_finished_count for o in outputs if o), default=1) or 1
        merged = self._aggregator(decode_id, expected).aggregate(self._open_only(outputs))
        verdicts = []
        for req_id in sorted(merged.finished_recving):
            failed = req_id in merged.failed_recving
            if req_id not in self._handoffs:
                continue  # aborted, expired or decided by a handshake failure: nothing left to decide
            why = merged.failure_reasons.get(req_id) if failed else None
            verdicts.append(self._close(req_id, decode_id, not failed,
                                        (f"KV pull failed: {why}" if why else "KV pull failed") if failed else "",
                                        frozenset(merged.invalid_block_ids) if failed else frozenset(), source))
        return verdicts

    def unit_died(self, decode_id: str, collected: list[KVConnectorOutput | None]) -> list[Verdict]:
        """A unit died mid-step: the step's collected outputs (the dead unit's own failures
        included) are stashed and replayed at once, so no unit's progress is lost."""
        agg = self._aggregator(decode_id, max((o.expected_finished_count for o in collected if o), default=1))
        agg.ft_defer_kv_connector_outputs(self._open_only(collected))
        return self.report(decode_id, [], source="salvage")

    def _close(self, req_id: str, decode_id: str, ok: bool, reason: str,
               invalid: frozenset[int], source: str = "report") -> Verdict:
        handoff = self._pop(req_id)
        if ok:
            self.record_success(decode_id, handoff.prefill_id)
        else:
            self.record_failure(decode_id, handoff.prefill_id, reason)
        self.verdicts["ok" if ok else "failed"] += 1
        self.ended_by[source] += 1
        return Verdict(req_id, handoff.prefill_id, decode_id, ok, reason, invalid, source)

    def expire(self) -> list[Verdict]:
        """Fail every handoff past its deadline."""
        now = self.clock()
        out = []
        while (deadline := self.next_deadline()) is not None and deadline <= now:
            h = self._pop(heapq.heappop(self._deadlines)[1])
            self._forget_counts(h)
            reason = f"no verdict within {h.deadline - h.opened_at:.0f}s"
            self.record_failure(h.decode_id, h.prefill_id, reason)
            self.verdicts["expired"] += 1
            self.ended_by["expired"] += 1
            out.append(Verdict(h.req_id, h.prefill_id, h.decode_id, False, reason, source="expired"))
        return out

    def snapshot(self) -> LedgerSnapshot:
        awaiting = {}
        for agg in self._aggregators.values():
            awaiting.update({r: n for r, n in agg.pending().recving.items() if r in self._handoffs})
        return LedgerSnapshot(len(self._handoffs), dict(self.verdicts), self.pair_states(), awaiting,
                              dict(self.ended_by))
