"""Transfer ledger: one verdict per handoff from per-unit reports, breakers, deadlines, salvage."""

from actors.kv.aggregator import KVConnectorOutput
from actors.ledger import BreakerSettings, TransferLedger


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def out(done=(), failed=(), invalid=(), n=2):
    return KVConnectorOutput(finished_recving=set(done) | set(failed), failed_recving=set(failed),
                             invalid_block_ids=set(invalid), expected_finished_count=n)


def ledger(clock=None):
    return TransferLedger(deadline_s=30, breaker_settings=BreakerSettings(2, 10, 5), clock=clock or Clock())


def test_verdict_only_when_every_unit_reported():
    led = ledger()
    led.open("r", "P", "D")
    assert led.report("D", [out(done=["r"]), None]) == []
    (v,) = led.report("D", [None, out(done=["r"])])
    assert v.ok and v.prefill_id == "P" and led.in_flight() == []
    assert led.breaker("D", "P").consecutive_failures == 0


def test_one_failed_unit_fails_the_request_and_feeds_the_breaker():
    led = ledger()
    for i in range(2):
        led.open(f"r{i}", "P", "D")
        (v,) = led.report("D", [out(done=[f"r{i}"]), out(failed=[f"r{i}"], invalid=[7])])
        assert not v.ok and v.invalid_block_ids == frozenset({7})
    assert led.is_open("D", "P") and not led.is_open("D", "P2")
    assert led.breaker_states()["P->D"]["state"] == "open"


def test_dead_unit_reports_are_salvaged():
    led = ledger()
    led.open("r", "P", "D")
    led.rank_died("D", [])  # nothing known yet: harmless
    assert led.report("D", [out(done=["r"]), None]) == []
    led.rank_died("D", [out(done=["r"])])  # the dead unit had reported its part
    (v,) = led.report("D", [None, None])
    assert v.ok and v.req_id == "r"


def test_handoff_past_its_deadline_is_failed_and_forgotten():
    clock = Clock()
    led = ledger(clock)
    led.open("r", "P", "D")
    led.report("D", [out(done=["r"]), None])
    clock.now = 29.0
    assert led.expire() == []
    clock.now = 30.0
    (v,) = led.expire()
    assert not v.ok and "no verdict" in v.reason and led.in_flight() == []
    late = led.report("D", [None, out(done=["r"])])  # a late report yields no open handoff
    assert all(v.prefill_id is None for v in late)
    assert led.in_flight() == [] and led.verdicts["expired"] == 1


def test_forget_engine_fails_its_handoffs_and_drops_breakers():
    led = ledger()
    led.open("a", "P", "D")
    led.open("b", "P2", "D")
    led.record_handshake_failure("D", "P")
    gone = led.forget_engine("P")
    assert [h.req_id for h in gone] == ["a"] and [h.req_id for h in led.in_flight()] == ["b"]
    assert "P->D" not in led.breaker_states()
