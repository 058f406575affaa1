"""Transfer ledger: one verdict per handoff, the one owner of pair breakers, aborts, deaths, salvage."""

from actors.kv.aggregator import KVConnectorOutput
from actors.control.breaker_config import BreakerConfig
from actors.control.ledger import TransferLedger


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def out(done=(), failed=(), invalid=(), n=2):
    return KVConnectorOutput(finished_recving=set(done) | set(failed), failed_recving=set(failed),
                             invalid_block_ids=set(invalid), expected_finished_count=n)


def ledger(clock=None):
    return TransferLedger(BreakerConfig(failure_threshold=2, cooldown_s=10, probe_window_s=5), deadline_s=30,
                          clock=clock or Clock())


def state(led, pair="P->D"):
    return {b.pair: b for b in led.pair_states()}[pair]


def test_verdict_only_when_every_unit_reported():
    led = ledger()
    led.open("r", "P", "D")
    assert led.report("D", [out(done=["r"]), None]) == []
    (v,) = led.report("D", [None, out(done=["r"])])
    assert v.ok and v.prefill_id == "P" and led.in_flight() == []
    assert state(led).failures == 0


def test_one_failed_unit_fails_the_request_and_feeds_the_breaker():
    led = ledger()
    for i in range(2):
        led.open(f"r{i}", "P", "D")
        (v,) = led.report("D", [out(done=[f"r{i}"]), out(failed=[f"r{i}"], invalid=[7])])
        assert not v.ok and v.invalid_block_ids == frozenset({7})
    assert led.is_open("D", "P") and not led.is_open("D", "P2")
    assert state(led).state == "open" and state(led).last_reason == "KV pull failed"


def test_client_abort_closes_the_handoff_and_touches_no_breaker():
    clock = Clock()
    led = ledger(clock)
    for i in range(5):
        led.open(f"r{i}", "P", "D")
        led.report("D", [out(done=[f"r{i}"]), None])  # half reported, then the client left
        assert led.abort(f"r{i}") is not None
    clock.now = 100.0
    assert led.expire() == [] and led.in_flight() == []
    assert led.route_state("D", "P") == "closed" and led.verdicts["aborted"] == 5
    assert led.report("D", [None, out(done=["r0"])]) == []  # a late report decides nothing


def test_half_open_probe_is_admitted_once_cluster_wide():
    clock = Clock()
    led = ledger(clock)
    for _ in range(2):
        led.prefill_failed("D", "P", "actor died")
    assert led.route_state("D", "P") == "open" and "prefill failed: actor died" == state(led).last_reason
    clock.now = 10.0
    assert led.route_state("D", "P") == "half_open"
    assert [led.admit_probe("D", "P") for _ in range(3)] == [True, False, False]
    led.open("probe", "P", "D")
    led.report("D", [out(done=["probe"], n=1)])
    assert led.route_state("D", "P") == "closed"


def test_handshake_failure_decides_the_request_once():
    led = ledger()
    led.open("r", "P", "D")
    v = led.handshake_failed("D", "P", "peer not registered", req_id="r")
    assert not v.ok and v.reason == "handshake failed: peer not registered"
    assert led.report("D", [out(failed=["r"]), out(failed=["r"])]) == []  # the units' own reports come later
    assert state(led).failures == 1 and led.in_flight() == []
    assert led.handshake_failed("D", "P", "incompatible") is None  # no request: still the pair's failure
    assert state(led).state == "open" and state(led).last_reason == "handshake failed: incompatible"


def test_dead_unit_step_is_salvaged_into_exactly_one_verdict():
    led = ledger()
    led.open("r", "P", "D")
    # unit 0's success and unit 1's death-on-behalf failure were collected in the step the unit died in
    (v,) = led.unit_died("D", [out(done=["r"]), out(failed=["r"])])
    assert (v.req_id, v.ok, v.source) == ("r", False, "salvage")  # decided by the salvaged step
    assert led.report("D", [None, None]) == [] and led.in_flight() == []
    assert led.verdicts["failed"] == 1 and led.snapshot().ended_by == {"salvage": 1}


def test_every_handoff_records_what_ended_it():
    clock = Clock()
    led = ledger(clock)
    for r in ("a", "b", "c", "d", "e", "f"):
        led.open(r, "P", "D")
    led.report("D", [out(done=["a"]), out(done=["a"])])
    led.handshake_failed("D", "P", "incompatible", "b")
    led.abort("c")
    led.engine_died("D", "killed", [("D", "P")])  # d, e and f end with their engine
    assert led.snapshot().ended_by == {"report": 1, "handshake": 1, "aborted": 1, "eviction": 3}
    led.open("g", "P", "D")
    clock.now = 1000.0
    (v,) = led.expire()
    assert v.source == "expired" and led.snapshot().ended_by["expired"] == 1


def test_handoff_past_its_deadline_is_failed_and_forgotten():
    clock = Clock()
    led = ledger(clock)
    led.open("r", "P", "D")
    led.report("D", [out(done=["r"]), None])
    clock.now = 29.0
    assert led.expire() == [] and led.next_deadline() == 30.0
    clock.now = 30.0
    (v,) = led.expire()
    assert not v.ok and "no verdict" in v.reason and led.in_flight() == []
    assert led.report("D", [None, out(done=["r"])]) == []
    assert led.verdicts["expired"] == 1 and state(led).failures == 1


def test_engine_death_opens_its_pairs_and_ends_its_handoffs():
    led = ledger()
    led.open("a", "P", "D")
    led.open("b", "P2", "D")
    gone = led.engine_died("P", "actor died", [("D", "P")])
    assert [h.req_id for h in gone] == ["a"] and [h.req_id for h in led.in_flight()] == ["b"]
    assert state(led).state == "open" and state(led).last_reason == "engine P died: actor died"
    assert led.route_state("D", "P2") == "closed"


def test_engine_leaving_drops_its_breakers():
    led = ledger()
    led.prefill_failed("D", "P", "x")
    led.open("a", "P", "D")
    assert [h.req_id for h in led.engine_left("P")] == ["a"]
    assert led.pair_states() == ()


def test_a_failed_pulls_reason_names_the_verdict_across_the_wire_and_the_desk():
    from actors.control.handoff_desk import HandoffDesk
    from actors.control.ledger_records import LedgerBatch, TransferOutcomes, UnitOutcome

    led, events = ledger(), []
    desk = HandoffDesk(led, lambda *_: None, lambda kind, engine, **f: events.append((kind, engine, f)))
    led.open("late", "P", "D")
    why = "the producer's lease had ended when the read was confirmed (its blocks may be reused)"
    units = [out(done=["late"]), out(failed=["late"], invalid=[3])]
    units[1].failure_reasons["late"] = why
    wire = TransferOutcomes(tuple(UnitOutcome.of(o) for o in units))  # as the decode engine sends them
    desk.apply(LedgerBatch("D", (wire,)))
    assert events == [("transfer_failed", "D", {"req_id": "late", "prefill_id": "P", "reason": f"KV pull failed: {why}"})]
    assert state(led).last_reason == f"KV pull failed: {why}"
