"""The control plane at size, without Ray: the routers' table is built once per change and polled for
nothing; ledger batches apply in order; the ledger's hot paths do not scan its handoffs or pairs."""

from __future__ import annotations

import asyncio

from actors.control.coordinator import Coordinator
from actors.control.breaker_config import BreakerConfig
from actors.control.ledger import TransferLedger
from actors.kv.aggregator import KVConnectorOutput
from actors.control.ledger_records import (
    HandoffAborted,
    HandoffOpened,
    HandshakeFailure,
    LedgerBatch,
    TransferOutcomes,
    UnitOutcome,
)
from tests.unit.test_handshake import payload


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def done(req_id: str, failed: bool = False) -> KVConnectorOutput:
    return KVConnectorOutput(finished_recving={req_id}, failed_recving={req_id} if failed else set(),
                             expected_finished_count=1)


def unit(req_id: str, failed: bool = False) -> UnitOutcome:
    return UnitOutcome.of(done(req_id, failed))


async def cluster(prefills=("P0", "P1"), decodes=("D0",), clock=None) -> Coordinator:
    c = Coordinator(hang_check_s=3600, breaker={"failure_threshold": 2, "cooldown_s": 10, "probe_window_s": 5})
    if clock is not None:
        c.ledger.clock = clock  # before any breaker exists: they all take it
    for eid in prefills:
        await c.register_engine(eid, "prefill", [payload(engine_id=eid, role="prefill", tp_rank=0, tp_size=1).encode()])
    for eid in decodes:
        await c.register_engine(eid, "decode", [payload(engine_id=eid, role="decode", tp_rank=0, tp_size=1).encode()])
    return c


def stop(c: Coordinator) -> None:
    for t in c._timers:
        t.cancel()


def test_the_table_is_built_once_per_change_and_a_current_copy_gets_nothing():
    async def go():
        c = await cluster()
        t1 = await c.routes()
        same = await c.routes()
        unchanged = await c.routes_if_changed(t1.epoch, t1.version)
        other_epoch = await c.routes_if_changed("another", t1.version)
        await c.report_batch(LedgerBatch("D0", (HandoffOpened("r1", "P0"), TransferOutcomes((unit("r1"),)))))
        after_success = await c.routes_if_changed(t1.epoch, t1.version)  # a healthy pair stays: no change
        await c.set_draining("P1")
        drained = await c.routes_if_changed(t1.epoch, t1.version)
        stats = await c.control_stats()
        stop(c)
        return t1, same, unchanged, other_epoch, after_success, drained, stats

    t1, same, unchanged, other_epoch, after_success, drained, stats = asyncio.run(go())
    assert same is t1 and unchanged is None and other_epoch is t1 and after_success is None
    assert [r.prefill_id for r in t1.decodes["D0"]] == ["P0", "P1"]
    assert drained.version > t1.version and [r.prefill_id for r in drained.decodes["D0"]] == ["P0"]
    assert stats.verdicts["ok"] == 1 and stats.ledger_records == 2 and stats.route_unchanged == 2


def test_breaker_moves_by_report_and_by_time_alone_give_a_new_table():
    async def go():
        clock = Clock()
        c = await cluster(clock=clock)
        v0 = (await c.routes()).version
        for i in range(2):  # threshold 2: P0 -> D0 opens
            await c.report_batch(LedgerBatch("D0", (HandoffOpened(f"f{i}", "P0"),
                                                     TransferOutcomes((unit(f"f{i}", failed=True),)))))
        opened = await c.routes()
        clock.now += 10.5  # the cooldown ends by time alone: half-open, offered for a probe
        half_open = await c.routes()
        granted = await c.admit_probe("D0", "P0")
        probing = await c.routes()  # the probe is out: nobody else is offered the pair
        clock.now += 5.5  # the probe never answered: its window ends, the pair is offered again
        expired_probe = await c.routes()
        stop(c)
        return v0, opened, half_open, granted, probing, expired_probe

    v0, opened, half_open, granted, probing, expired_probe = asyncio.run(go())
    usable = lambda t: {r.prefill_id: r.state for r in t.decodes["D0"]}  # noqa: E731
    assert opened.version > v0 and usable(opened) == {"P1": "closed"}
    assert usable(half_open) == {"P0": "half_open", "P1": "closed"} and granted
    assert usable(probing) == {"P1": "closed"}
    assert usable(expired_probe) == {"P0": "half_open", "P1": "closed"}
    assert len({opened.version, half_open.version, probing.version, expired_probe.version}) == 4


def test_a_batch_applies_in_order_and_a_handshake_failure_decides_its_handoff():
    async def go():
        c = await cluster()
        n = await c.report_batch(LedgerBatch("D0", (
            HandoffOpened("a", "P0"), HandoffOpened("b", "P1"), HandoffOpened("c", "P0"),
            TransferOutcomes((unit("a"),)), HandoffAborted("b"),
            HandshakeFailure("P0", "peer not registered", "c"),
            TransferOutcomes((unit("b"),)),  # after its abort: decides nothing
        )))
        ledger = await c.transfers()
        in_flight = (await c.handoffs_in_flight("P0"), await c.handoffs_in_flight("D0"))
        stop(c)
        return n, ledger, in_flight

    n, ledger, in_flight = asyncio.run(go())
    assert n == 7 and ledger.in_flight == 0 and in_flight == (0, 0)
    assert ledger.verdicts == {"ok": 1, "failed": 1, "expired": 0, "aborted": 1}


def test_expiry_uses_the_deadline_heap_and_closed_handoffs_do_not_pile_up():
    clock = Clock()
    led = TransferLedger(BreakerConfig(), deadline_s=30, clock=clock)
    for i in range(10_000):  # open and decided at once: the heap stays bounded by its compaction
        led.open(f"r{i}", "P", "D")
        led.report("D", [done(f"r{i}")])
    assert len(led._deadlines) <= 1024 + 2 and led.next_deadline() is None
    led.open("late", "P", "D")
    clock.now += 10
    led.open("later", "P", "D")
    assert led.in_flight_of("P") == 2 and led.next_deadline() == 130.0
    clock.now += 25  # past the first deadline only
    (v,) = led.expire()
    assert v.req_id == "late" and not v.ok and led.in_flight_of("D") == 1 and led.next_deadline() == 140.0


def test_a_healthy_pair_reporting_success_is_no_change():
    led = TransferLedger(BreakerConfig(failure_threshold=2), clock=Clock())
    led.breaker("D", "P")
    before = led.changes
    for i in range(100):
        led.open(f"r{i}", "P", "D")
        led.report("D", [done(f"r{i}")])
    assert led.changes == before
    led.record_failure("D", "P", "x")
    assert led.changes == before + 1 and led.state_of("D", "P").failures == 1
    led.record_success("D", "P")
    assert led.changes == before + 2 and led.state_of("D", "P").failures == 0


def test_coalesced_kv_events_leave_the_index_exactly_as_the_engine_events_do():
    import random

    from actors.control.prefix_index import PrefixIndex
    from actors.prefix_wire import (
        AllBlocksCleared,
        BlocksRemoved,
        BlocksStored,
        HashScheme,
        KVEventsBatch,
        coalesce,
    )

    rng = random.Random(5)
    scheme = HashScheme(16)
    for _ in range(50):
        events = []
        for _ in range(rng.randrange(1, 40)):
            kind = rng.choice((BlocksStored, BlocksRemoved, BlocksRemoved, AllBlocksCleared))
            events.append(AllBlocksCleared() if kind is AllBlocksCleared
                          else kind(tuple(rng.randrange(20) for _ in range(rng.randrange(0, 4)))))
        plain, merged = PrefixIndex(max_blocks_per_engine=8), PrefixIndex(max_blocks_per_engine=8)
        plain.apply("e", KVEventsBatch(scheme, tuple(events)))
        batch = KVEventsBatch(scheme, coalesce(events), engine_events=len(events))
        merged.apply("e", batch)
        assert batch.num_engine_events == len(events) and len(batch.events) <= len(events)
        assert {e: list(b.blocks) for e, b in plain._engines.items()} == \
            {e: list(b.blocks) for e, b in merged._engines.items()}


def test_breaker_moves_travel_as_deltas_that_rebuild_the_whole_table_exactly():
    from actors.routes import RouteDelta

    async def go():
        c = await cluster(prefills=("P0", "P1", "P2"), decodes=("D0", "D1"))
        base = await c.routes()
        for i in range(2):  # P1 -> D1 opens
            await c.report_batch(LedgerBatch("D1", (HandoffOpened(f"f{i}", "P1"),
                                                     TransferOutcomes((unit(f"f{i}", failed=True),)))))
        delta = await c.routes_if_changed(base.epoch, base.version)
        whole = await c.routes()
        await c.set_draining("P2")  # a directory change: the whole table again
        after_drain = await c.routes_if_changed(whole.epoch, whole.version)
        from_base = await c.routes_if_changed(base.epoch, base.version)  # reaches back past a whole change
        stop(c)
        return base, delta, whole, after_drain, from_base

    base, delta, whole, after_drain, from_base = asyncio.run(go())
    assert isinstance(delta, RouteDelta) and set(delta.decodes) == {"D1"} and len(delta.breakers) == 1
    assert delta.apply(base) == whole and [r.prefill_id for r in whole.decodes["D1"]] == ["P0", "P2"]
    assert type(after_drain) is type(from_base) is type(whole)
