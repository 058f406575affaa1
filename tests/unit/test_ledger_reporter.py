"""A decode engine's ledger reporter: records coalesce into one call per window, in order, one call in
flight; a lost call is counted and later records still go; nothing waits on the request path."""

from __future__ import annotations

import asyncio

from actors.engine.ledger_reporter import LedgerReporter
from actors.kv.aggregator import KVConnectorOutput
from actors.control.ledger_records import HandoffAborted, HandoffOpened, TransferOutcomes


class Method:
    def __init__(self, owner):
        self.owner = owner

    def remote(self, batch):
        return self.owner.call(batch)


class FakeCoordinator:
    """`report_batch.remote(batch)` as an awaitable; `gate` holds the answer, `fail` raises."""

    def __init__(self):
        self.batches = []
        self.gate: asyncio.Event | None = None
        self.fail = 0
        self.report_batch = Method(self)

    async def call(self, batch):
        self.batches.append(batch)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise ConnectionError("coordinator restarting")
        return len(batch.records)


def out(req_id):
    return KVConnectorOutput(finished_recving={req_id}, expected_finished_count=1)


def test_records_of_one_window_go_in_one_call_in_order():
    async def go():
        c = FakeCoordinator()
        r = LedgerReporter("D", lambda: c, max_delay_s=0.02)
        for i in range(50):
            r.opened(f"r{i}", "P")
            r.outcomes([out(f"r{i}")])
        r.aborted("x")
        assert c.batches == []  # nothing was sent while recording: the request path never waits
        assert await r.flush(timeout_s=2)
        return c, r

    c, r = asyncio.run(go())
    (batch,) = c.batches
    assert batch.decode_id == "D" and len(batch.records) == 101
    assert batch.records[0] == HandoffOpened("r0", "P") and isinstance(batch.records[1], TransferOutcomes)
    assert batch.records[-1] == HandoffAborted("x") and r.stats.records == 101


def test_one_call_in_flight_and_what_arrives_meanwhile_goes_next_at_most_once_per_window():
    async def go():
        c = FakeCoordinator()
        c.gate = asyncio.Event()
        r = LedgerReporter("D", lambda: c, max_delay_s=0.01)
        r.opened("a", "P")
        await asyncio.sleep(0.03)  # the first call is out, held at the coordinator
        for i in range(20):
            r.opened(f"b{i}", "P")
            await asyncio.sleep(0.002)
        assert len(c.batches) == 1  # no second call while the first is in flight
        c.gate.set()
        assert await r.flush(timeout_s=2)
        return c

    c = asyncio.run(go())
    assert [len(b.records) for b in c.batches] == [1, 20]
    assert [rec.req_id for b in c.batches for rec in b.records] == ["a"] + [f"b{i}" for i in range(20)]


def test_a_lost_call_is_counted_and_later_records_still_go():
    async def go():
        c = FakeCoordinator()
        c.fail = 1
        r = LedgerReporter("D", lambda: c, max_delay_s=0.0)
        r.opened("a", "P")
        assert await r.flush(timeout_s=2)
        r.opened("b", "P")
        assert await r.flush(timeout_s=2)
        return c, r

    c, r = asyncio.run(go())
    assert r.stats.lost_batches == 1 and r.stats.lost_records == 1 and r.stats.batches == 1
    assert [b.records[0].req_id for b in c.batches] == ["a", "b"]


def test_pending_records_are_bounded_and_flush_has_a_deadline():
    async def go():
        c = FakeCoordinator()
        c.gate = asyncio.Event()
        r = LedgerReporter("D", lambda: c, max_delay_s=0.0, max_pending=3)
        r.opened("first", "P")
        await asyncio.sleep(0.01)  # in flight, held
        for i in range(5):
            r.opened(f"r{i}", "P")
        flushed = await r.flush(timeout_s=0.05)
        c.gate.set()
        return r, flushed, await r.flush(timeout_s=2)

    r, flushed, later = asyncio.run(go())
    assert r.stats.dropped == 2 and not flushed and later and r.stats.records == 4
