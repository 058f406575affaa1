"""The coordinator's liveness probes without Ray (actors/control/liveness.py): a router's hang report is
probed, `failure_threshold` probes in a row that time out evict the incarnation (breakers open) and kill
it for a restart; an engine that answers is left alone; the sweep finds hangs nobody reported (the same
threshold: one slow answer does not kill a healthy engine); one judgement per incarnation; a probe that
times out while the engine calls the coordinator found a busy engine, not a hung one; an engine actor
whose core is slow but stepping answers "pong" (actors/engine/core_probe.py)."""

from __future__ import annotations

import asyncio

from actors.control.coordinator import Coordinator
from actors.control.ledger_records import LedgerBatch
from actors.engine.core_probe import PONG, core_answer
from tests.unit.test_handshake import payload


class FakeMethod:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def options(self, **_):
        return self

    def remote(self, *args):
        self.actor.calls.append(self.name)
        if self.name == "ping":
            return self.actor._ping()
        fut = asyncio.get_running_loop().create_future()
        if self.name != "watch":
            fut.set_result(None)
        return fut


class FakeActor:
    """An actor handle: `frozen` never answers (a SIGSTOPped process), `answer` is what ping returns."""

    def __init__(self, answer="pong"):
        self.frozen = False
        self.answer = answer
        self.calls: list[str] = []
        self.killed = 0

    def __getattr__(self, name):
        return FakeMethod(self, name)

    async def _ping(self):
        if self.frozen:
            await asyncio.Event().wait()
        return self.answer


async def pair(timeout_s=0.2):
    c = Coordinator(hang_check_s=3600, ping_timeout_s=timeout_s)
    handles = {"P": FakeActor(), "D": FakeActor()}
    c.liveness.kill = lambda h: setattr(h, "killed", h.killed + 1)
    for eid, role in (("P", "prefill"), ("D", "decode")):
        await c.register_engine(eid, role, [payload(engine_id=eid, role=role, tp_rank=0, tp_size=1).encode()],
                                [handles[eid]])
    return c, handles


def stop(c):
    for t in c._timers:
        t.cancel()


def test_a_reported_hang_is_probed_evicted_with_open_breakers_and_killed_once():
    async def go():
        c, h = await pair()
        h["D"].frozen = True
        gen = {e.engine_id: e.generation for e in await c.engines()}["D"]
        verdicts = await asyncio.gather(*(c.engine_hung("D", gen, "missed its token deadline") for _ in range(3)))
        routes = await c.routes()
        events = [e for e in c.events if e["engine_id"] == "D" and e["event"] == "removed"]
        stop(c)
        return verdicts, routes, events, h, c

    verdicts, routes, events, h, c = asyncio.run(go())
    assert verdicts == ["hung"] * 3
    assert h["D"].calls.count("ping") == 2  # three reports, one judgement: two failed probes in a row
    assert h["D"].killed == 1 and h["P"].killed == 0  # killed so that Ray restarts it
    assert "D" not in routes.decodes and routes.hangs == {"D": 1}
    assert events[0]["reason"].startswith(
        "hung: no answer to a ping in 0 s (2 probes in a row; reported: missed its token deadline")
    assert {b.pair: b for b in routes.breakers}["P->D"].state == "open"  # its pairs record the failure


def test_an_engine_that_answers_is_left_alone_and_stale_reports_are_ignored():
    async def go():
        c, h = await pair()
        gen = {e.engine_id: e.generation for e in await c.engines()}["P"]
        alive = await c.engine_hung("P", gen, "slow prefill")
        stale = await c.engine_hung("P", gen + 100, "an old incarnation")
        routes = await c.routes()
        stop(c)
        return alive, stale, routes, h

    alive, stale, routes, h = asyncio.run(go())
    assert (alive, stale) == (None, None)
    assert h["P"].killed == 0 and h["P"].calls.count("ping") == 1
    assert [r.prefill_id for r in routes.decodes["D"]] == ["P"] and routes.hangs == {}


def test_the_sweep_finds_an_unreported_hang_and_a_stuck_engine_core():
    async def go():
        c, h = await pair()
        h["P"].frozen = True  # the actor frozen
        h["D"].answer = "the engine core did not answer in 8 s"  # the actor answers, its core does not
        first = await c.check_engines()
        killed_after_first = h["P"].killed + h["D"].killed
        found = await c.check_engines()
        routes = await c.routes()
        stop(c)
        return first, killed_after_first, found, routes, h

    first, killed_after_first, found, routes, h = asyncio.run(go())
    assert (first, killed_after_first) == ([], 0)  # one failed probe decides nothing
    assert sorted(found) == ["D", "P"]
    assert h["P"].killed == 1 and h["D"].killed == 1
    assert routes.decodes == {} and routes.hangs == {"P": 1, "D": 1}


def test_a_slow_answer_between_sweeps_resets_the_count():
    """Probes fail, answer, fail: never two in a row, so the engine (busy, not hung) keeps serving."""
    async def go():
        c, h = await pair()
        found = []
        for frozen in (True, False, True, False, True):
            h["D"].frozen = frozen
            found += await c.check_engines()
        routes = await c.routes()
        stop(c)
        return found, routes, h

    found, routes, h = asyncio.run(go())
    assert found == [] and h["D"].killed == 0
    assert "D" in routes.decodes and routes.hangs == {}


def test_a_report_during_a_sweeps_probe_is_decided_by_that_probe():
    async def go():
        c, h = await pair(timeout_s=0.3)
        h["D"].frozen = True
        gen = {e.engine_id: e.generation for e in await c.engines()}["D"]
        sweep = asyncio.ensure_future(c.check_engines())
        while "ping" not in h["D"].calls:  # until the sweep's probe is in flight (an event, not a sleep)
            await asyncio.sleep(0)
        verdict = await c.engine_hung("D", gen, "missed its token deadline")
        found = await sweep
        stop(c)
        return verdict, found, h

    verdict, found, h = asyncio.run(go())
    assert verdict == "hung" and found == ["D"]
    # the sweep's failed probe is the first strike; the report probes again at once for the second
    assert h["D"].calls.count("ping") == 2 and h["D"].killed == 1


def test_a_reported_engine_that_calls_the_coordinator_while_its_probe_times_out_is_busy_not_hung():
    async def go():
        c, h = await pair(timeout_s=0.3)
        h["D"].frozen = True  # its pings go unanswered (a starved actor loop) ...
        gen = {e.engine_id: e.generation for e in await c.engines()}["D"]
        verdict = asyncio.ensure_future(c.engine_hung("D", gen, "missed its token deadline"))
        while "ping" not in h["D"].calls:
            await asyncio.sleep(0)
        await c.report_batch(LedgerBatch("D", ()))  # ... but it reports its ledger records meanwhile
        out = await verdict
        stats = await c.control_stats()
        routes = await c.routes()
        stop(c)
        return out, stats, routes, h

    verdict, stats, routes, h = asyncio.run(go())
    assert verdict is None and h["D"].killed == 0
    assert (stats.probe_failures, stats.probes_busy) == (0, 1)
    assert "D" in routes.decodes and routes.hangs == {}


class SlowCore:
    """A backend whose core answers a probe after `answer_s`, stepping `steps_meanwhile` times first."""

    def __init__(self, answer_s: float, steps_meanwhile: int):
        self.answer_s, self.steps_meanwhile, self.n = answer_s, steps_meanwhile, 0

    async def probe(self):
        for _ in range(self.steps_meanwhile):
            await asyncio.sleep(0.01)
            self.n += 1
        await asyncio.sleep(self.answer_s)

    def steps(self) -> int:
        return self.n


def test_an_engine_core_slow_to_answer_but_stepping_is_busy_and_a_silent_one_is_stuck():
    busy = asyncio.run(core_answer(SlowCore(answer_s=5.0, steps_meanwhile=3), "E", probe_s=0.2))
    stuck = asyncio.run(core_answer(SlowCore(answer_s=5.0, steps_meanwhile=0), "E", probe_s=0.2))
    assert (busy, stuck) == (PONG, "the engine core did not answer in 0 s")
