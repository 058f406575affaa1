"""One rate model, shared (fakes, no Ray): engines publish their own rates and queues, the coordinator's
route book carries them in the table and its deltas, and every router reads the same numbers; a router
keeps only its own hop to each engine as a local correction."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from actors.engine.rates_publisher import RatesPublisher
from actors.protocol.request import EngineRequest, SamplingSpec, Stamps
from actors.rates import EngineRates
from actors.routes import PairState, PrefillRoute, RouteDelta, RouteTable
from serving.config import RouterConfig
from serving.routing.rates import hop_of
from serving.routing.router import Router
from tests.unit.test_control_plane import cluster, stop
from tests.unit.test_router import FakeClock, FakeEngine, collect

# what the engines measured of themselves: p0 fast and idle, p1 as fast with a long queue, d0 with
# eight streams decoding, d1 idle and slower per stream
PUBLISHED = {
    "p0": EngineRates(0.02, 0.002, 1 / 4000, samples=80, prefill_samples=40, chunk_budget_tokens=1024),
    "p1": EngineRates(0.02, 0.002, 1 / 4000, samples=80, prefill_samples=40, queued_prompt_tokens=6000,
                      prompt_tokens_per_s=2000.0),
    "d0": EngineRates(0.03, 0.004, 1 / 1000, samples=200, prefill_samples=5, decode_streams=8),
    "d1": EngineRates(0.03, 0.006, 1 / 1000, samples=200),  # measured no prefill: the pooled rate
}


class TableDirectory:
    """The coordinator as a fixed route table (what every ingress replica polls)."""

    def __init__(self, table: RouteTable):
        self.table = table
        self.hung: list[tuple] = []

    async def routes(self) -> RouteTable:
        return self.table

    async def admit_probe(self, decode_id: str, prefill_id: str) -> bool:
        return True

    def prefill_failed(self, decode_id: str, prefill_id: str, reason: str) -> None:
        pass

    def engine_hung(self, engine_id: str, generation: int | None, reason: str) -> None:
        self.hung.append((engine_id, generation, reason))


def table(rates: dict[str, EngineRates] | None = None, version: int = 1) -> RouteTable:
    routes = (PrefillRoute("p0"), PrefillRoute("p1"))
    return RouteTable({"d0": routes, "d1": routes}, generations={e: 1 for e in PUBLISHED}, epoch="e",
                      version=version, rates=dict(PUBLISHED if rates is None else rates))


def router(directory: TableDirectory, engine: type = FakeEngine) -> Router:
    prefills = {p: engine(p) for p in ("p0", "p1")}
    decodes = {d: engine(d) for d in ("d0", "d1")}
    return Router(prefills, decodes, directory, RouterConfig(placement="slo", migration_wait_s=0.0),
                  clock=FakeClock())


def request(rid: str = "r", tokens: int = 1500) -> EngineRequest:
    return EngineRequest(rid, SamplingSpec(max_tokens=64), prompt_token_ids=tuple(i % 250 for i in range(tokens)))


def estimates(r: Router) -> dict:
    return {e: r.planner.estimate(r.pool, e) for e in PUBLISHED}


def test_two_routers_fed_the_same_table_estimate_and_place_alike():
    async def go():
        a, b = router(TableDirectory(table())), router(TableDirectory(table()))  # two ingress replicas
        routes_a, routes_b = await a.routes(), await b.routes()
        plan_a = a.planner.plan(a.pool, request(), routes_a, 0)
        plan_b = b.planner.plan(b.pool, request(), routes_b, 0)
        return a, b, plan_a, plan_b

    a, b, plan_a, plan_b = asyncio.run(go())
    assert estimates(a) == estimates(b)  # the same numbers: not each replica's own learning
    assert (plan_a.decode_id, plan_a.prefill_ids, plan_a.decision) == (plan_b.decode_id, plan_b.prefill_ids,
                                                                      plan_b.decision)
    assert plan_a.placement.predictions == plan_b.placement.predictions
    # and they are the engines' numbers: p1's queue, d0's streams, p0's budget, d1's pooled prefill rate
    e = estimates(a)
    assert (e["p1"].queued_prefill_tokens, e["d0"].decode_streams, e["p0"].chunk_budget_tokens) == (6000, 8, 1024)
    assert e["d0"].decode_step_s == pytest.approx(0.03 + 8 * 0.004)
    pooled_c = (40 / 4000 + 40 / 4000 + 5 / 1000) / 85  # d1 measured no prefill: the engines' weighted mean
    assert e["d1"].prefill_tokens_per_s == pytest.approx(1 / pooled_c)
    assert a.pool.prefill_busy("p1") == pytest.approx(2000 / 4000)  # every router's load, not just ours
    assert (plan_a.decode_id, plan_a.prefill_ids[0]) == ("d1", "p0")  # the idle decode engine, the idle prefill one
    assert a.deadlines.prefill_s("p1", 1500) == b.deadlines.prefill_s("p1", 1500)
    assert a.deadlines.token_s("d0") == b.deadlines.token_s("d0")


def test_a_router_that_got_the_rates_as_a_delta_reads_what_a_whole_table_says():
    old = {**PUBLISHED, "p1": dataclasses.replace(PUBLISHED["p1"], queued_prompt_tokens=0)}
    base = table(old, version=1)
    delta = RouteDelta("e", 1, 2, {}, (), rates={"p1": PUBLISHED["p1"]})

    async def go():
        whole = router(TableDirectory(table(version=2)))
        by_delta = router(TableDirectory(base))
        await whole.routes()
        await by_delta.routes()
        by_delta.view.directory.table = delta.apply(base)
        await by_delta.routes(force=True)
        return whole, by_delta

    whole, by_delta = asyncio.run(go())
    assert estimates(whole) == estimates(by_delta) and estimates(by_delta)["p1"].queued_prefill_tokens == 6000


class HopEngine(FakeEngine):
    """Stamps its calls as an engine does; its answer reaches the router `HOP_S` after it left."""

    HOP_S = 0.05

    async def prefill(self, req):
        out = await super().prefill(req)
        inside = (Stamps.now(Stamps.ENGINE_IN), Stamps.now(Stamps.ENGINE_OUT))  # the engine took no time
        await asyncio.sleep(self.HOP_S)
        return out.replace(stamps=inside)


def test_a_routers_local_correction_covers_only_the_delay_it_observes():
    async def go():
        a, b = router(TableDirectory(table()), HopEngine), router(TableDirectory(table()), HopEngine)
        await b.routes()
        stream = await a.open(request("one"))  # a's request only: a sees its hop to p0
        await collect(stream)
        return a, b, stream.prefill_id

    a, b, p = asyncio.run(go())
    assert p == "p0" and HopEngine.HOP_S <= a.pool.rates.hop_s(p) < HopEngine.HOP_S + 0.5
    assert b.pool.rates.hop_s(p) == 0.0  # another router does not see it
    assert a.pool.rates.rates(p) == b.pool.rates.rates(p)  # the shared rates did not move
    ea, eb = estimates(a), estimates(b)
    assert ea[p].hop_s == a.pool.rates.hop_s(p)
    # otherwise alike but for a's own prompt given to p0 (its busy share until p0 publishes it)
    assert dataclasses.replace(ea[p], hop_s=0.0, prefill_busy=eb[p].prefill_busy) == eb[p]
    margin = a.config.deadline_margin
    assert a.deadlines.prefill_s(p, 100) - b.deadlines.prefill_s(p, 100) == pytest.approx(margin * ea[p].hop_s)
    assert a.deadlines.token_s("d0") == b.deadlines.token_s("d0")  # gaps are the engine's steps, no hop in them


def test_the_hop_is_the_routers_wait_less_the_engines_time():
    stamps = ((Stamps.ROUTED, 10.0), (Stamps.ENGINE_IN, 500.1), (Stamps.VLLM_STEP_TOKENS, 64.0),
              (Stamps.ENGINE_OUT, 500.4), (Stamps.ROUTER_IN, 10.5))  # two processes' clocks
    assert hop_of(stamps) == pytest.approx(0.2)
    assert hop_of(stamps[1:]) is None  # no stamps (a fake engine): no sample


# ----------------------------------------------------------- the coordinator's route book
async def report(c, engine_id: str, rates: EngineRates, generation: int | None = None) -> bool:
    """`Coordinator.report_rates` (its route book's `report_rates` while the coordinator lacks it)."""
    if hasattr(c, "report_rates"):
        return await c.report_rates(engine_id, generation, rates)
    return c.book.report_rates(engine_id, generation, rates, c._engines)


def test_engines_rates_travel_in_the_table_and_its_deltas_when_they_moved_materially():
    first = EngineRates(0.02, 0.002, 1 / 4000, samples=10, prefill_samples=4, queued_prompt_tokens=100)

    async def go():
        c = await cluster()
        base = await c.routes()
        assert await report(c, "P0", first)
        delta = await c.routes_if_changed(base.epoch, base.version)
        whole = await c.routes()
        nudged = dataclasses.replace(first, prefill_s_per_token=first.prefill_s_per_token * 1.05,
                                     queued_prompt_tokens=140)  # 5 %, 40 tokens: not material
        assert await report(c, "P0", nudged)
        unmoved = await c.routes_if_changed(whole.epoch, whole.version)
        ignored = (await report(c, "X", first), await report(c, "P0", first, generation=99))
        moved = dataclasses.replace(first, queued_prompt_tokens=4000)
        await report(c, "P0", moved)
        after = await c.routes()
        await c.unregister_engine("P0")
        gone = await c.routes()
        stop(c)
        return base, delta, whole, unmoved, ignored, after, gone

    base, delta, whole, unmoved, ignored, after, gone = asyncio.run(go())
    assert base.rates == {} and isinstance(delta, RouteDelta) and delta.rates == {"P0": first}
    assert delta.apply(base) == whole and whole.rates == {"P0": first} and whole.version == base.version + 1
    assert unmoved is None  # nothing material: no new version, every router keeps reading `first`
    assert ignored == (False, False)  # not registered, or another incarnation
    assert after.version == whole.version + 1 and after.rates["P0"].queued_prompt_tokens == 4000
    assert "P0" not in gone.rates


# ------------------------------------------------------------------ the engine's publisher
def test_the_engine_publishes_when_its_rates_moved_or_the_coordinator_may_have_lost_them():
    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock, sent, fail = Clock(), [], []
    current = [EngineRates(0.02, 0.002, 1 / 4000, samples=5)]

    async def send(rates):
        if fail:
            raise RuntimeError("coordinator away")
        sent.append(rates)

    pub = RatesPublisher("e", lambda: current[0], send, republish_s=10.0, clock=clock)

    async def go():
        results = [await pub.publish()]  # the first record
        clock.t += 1
        results.append(await pub.publish())  # unchanged: nothing sent
        current[0] = dataclasses.replace(current[0], decode_streams=3)
        fail.append(True)
        results.append(await pub.publish())  # moved, but the call failed: counted, sent at the next check
        fail.clear()
        results.append(await pub.publish())
        clock.t += 10
        results.append(await pub.publish())  # unchanged for republish_s: sent again
        pub.reset()  # registered again
        results.append(await pub.publish())
        return results

    assert asyncio.run(go()) == [True, False, False, True, True, True]
    assert [r.decode_streams for r in sent] == [0, 3, 3, 3] and (pub.sent, pub.failed) == (4, 1)


def test_a_delta_of_rate_moves_alone_shares_the_tables_breakers():
    breakers = tuple(PairState(p, d, "closed", 0, 0) for p in ("p0", "p1") for d in ("d0", "d1"))
    base = dataclasses.replace(table(PUBLISHED, version=1), breakers=breakers)
    applied = RouteDelta("e", 1, 2, {}, (), rates={"p1": PUBLISHED["p1"]}).apply(base)
    assert applied.breakers is base.breakers and applied.version == 2
