"""The router's planning hook: SLO placement (colocated or disaggregated, and where) over cache-aware
engine state, with counted decisions (fakes, no Ray; the placement model's priors, nothing learned yet)."""

from __future__ import annotations

import asyncio

import pytest

from actors.control.prefix_index import PrefixIndex
from actors.prefix_wire import BlocksStored, HashScheme, KVEventsBatch
from actors.protocol.request import EngineRequest, SamplingSpec
from serving.ops.metrics import RouterCollector
from serving.routing.prefix_view import PrefixCacheView
from serving.config import RouterConfig
from serving.routing.planner import planner_for
from serving.routing.router import Router
from tests.unit.test_router import FakeClock, FakeDirectory, FakeEngine, collect

SCHEME = HashScheme(block_size=4)
PROMPT = tuple(range(100, 140))  # 40 tokens: 10 blocks


def make(owner: PrefixIndex, decodes=("d0", "d1"), **settings):
    ps = {"p0": FakeEngine("p0")}
    ds = {d: FakeEngine(d) for d in decodes}

    async def fetch(cursor):
        return owner.updates_since(cursor)

    view = PrefixCacheView(fetch, refresh_s=0.0)
    s = RouterConfig(policy="cache_aware", **settings)
    clock = FakeClock()
    router = Router(ps, ds, FakeDirectory({d: ["p0"] for d in decodes}, clock), s, clock=clock,
                    planner=planner_for(s, view))
    return router, ps, ds, view


def held(owner: PrefixIndex, engine: str, tokens) -> None:
    owner.apply(engine, KVEventsBatch(SCHEME, (BlocksStored(tuple(SCHEME.block_hashes(tokens))),)))


def req(rid: str, tokens=PROMPT) -> EngineRequest:
    return EngineRequest(rid, SamplingSpec(max_tokens=2), prompt_token_ids=tuple(tokens))


def decisions(router: Router) -> dict[tuple[str, str], float]:
    fam = next(f for f in RouterCollector(lambda: router).collect() if f.name == "raypd_disagg_decisions")
    return {(s.labels["decision"], s.labels["reason"]): s.value for s in fam.samples if s.name.endswith("_total")}


def test_the_decode_engine_holding_the_prompt_wins_and_prefills_it_locally():
    async def go():
        owner = PrefixIndex()
        held(owner, "d1", PROMPT)
        router, ps, ds, view = make(owner)
        await view.refresh()
        stream = await router.open(req("r1"))
        await collect(stream)
        return router, ps, stream

    router, ps, stream = asyncio.run(go())
    assert (stream.decode_id, stream.route.path, ps["p0"].prefills) == ("d1", "local", [])
    assert decisions(router) == {("local", "prefix_cached"): 1}


def test_a_short_prompt_on_idle_engines_is_colocated_it_saves_the_handoff():
    async def go():
        router, ps, _, view = make(PrefixIndex())
        stream = await router.open(req("r1"))
        await collect(stream)
        return router, ps, stream

    router, ps, stream = asyncio.run(go())
    assert (stream.route.path, ps["p0"].prefills) == ("local", [])
    assert decisions(router) == {("local", "ttft"): 1}


def test_a_long_prompt_goes_to_the_prefill_engine_when_it_would_stall_decoding_streams():
    async def go():
        router, ps, _, view = make(PrefixIndex())
        for d in ("d0", "d1"):
            router.pool.decode_load[d].requests = 4  # four streams decoding on each decode engine
        stream = await router.open(req("r1", tokens=tuple(range(1000, 1400))))  # 400 tokens: ~1 s of prefill
        await collect(stream)
        return router, stream

    router, stream = asyncio.run(go())
    assert (stream.route.path, stream.prefill_id) == ("pd", "p0")
    assert decisions(router) == {("remote", "itl_protect"): 1}


@pytest.mark.parametrize("placement, path", [("slo", "pd"), ("colocate", "local")])
def test_placement_colocate_keeps_a_long_prompt_on_a_busy_engine_and_pulls_nothing(placement, path):
    """A role-flexible engine with four streams and an idle one that may prefill for it: `slo`
    protects their ITL with a pull, `colocate` prefills where the stream decodes."""
    async def go():
        both = {e: FakeEngine(e) for e in ("b0", "b1")}  # b1 prefills only for this router
        s = RouterConfig(policy="cache_aware", placement=placement)
        clock = FakeClock()
        router = Router(both, {"b0": both["b0"]}, FakeDirectory({"b0": ["b1"]}, clock), s, clock=clock,
                        planner=planner_for(s, PrefixCacheView(lambda cursor: None, refresh_s=0.0)))
        router.pool.decode_load["b0"].requests = 4
        stream = await router.open(req("r1", tokens=tuple(range(1000, 1400))))
        await collect(stream)
        return router, both, stream

    router, both, stream = asyncio.run(go())
    assert stream.route.path == path
    assert sum(len(e.prefills) for e in both.values()) == (path == "pd")
    assert list(decisions(router)) == [("remote", "itl_protect") if path == "pd" else ("local", "colocate")]


def test_a_saturated_prefill_engine_makes_the_decode_engine_prefill():
    async def go():
        router, ps, _, view = make(PrefixIndex(), decodes=("d0",))
        router.pool.prefill_load["p0"].tokens = 4000  # other prompts queued there: ~10 s of work
        stream = await router.open(req("r1", tokens=tuple(range(1000, 1400))))
        await collect(stream)
        return router, stream

    router, stream = asyncio.run(go())
    assert stream.route.path == "local"
    assert decisions(router) == {("local", "prefill_queue"): 1}


def test_least_outstanding_policy_ignores_the_index():
    owner = PrefixIndex()
    held(owner, "d1", PROMPT)

    async def go():
        async def fetch(cursor):
            raise AssertionError("no index lookups under least_outstanding")

        s = RouterConfig(policy="least_outstanding", placement="disaggregate")
        clock = FakeClock()
        router = Router({"p0": FakeEngine("p0")}, {"d0": FakeEngine("d0"), "d1": FakeEngine("d1")},
                        FakeDirectory({"d0": ["p0"], "d1": ["p0"]}, clock), s, clock=clock,
                        planner=planner_for(s, PrefixCacheView(fetch, refresh_s=0.0)))
        stream = await router.open(req("r1"))
        await collect(stream)
        return router, stream

    router, stream = asyncio.run(go())
    assert (stream.decode_id, stream.route.path) == ("d0", "pd")
    assert router.planner.view is None


def test_the_view_refreshes_in_the_background_without_holding_the_request():
    async def go():
        owner = PrefixIndex()
        router, _, _, view = make(owner)
        held(owner, "d1", PROMPT)
        first = await router.open(req("r1"))  # the copy is empty: nothing cached as far as routing knows
        await collect(first)
        await asyncio.sleep(0)  # the background refresh started by r1 lands
        await asyncio.sleep(0)
        second = await router.open(req("r2"))
        await collect(second)
        return router, second

    router, second = asyncio.run(go())
    assert second.decode_id == "d1"
    assert decisions(router) == {("local", "ttft"): 1, ("local", "prefix_cached"): 1}


def test_a_migrated_stream_goes_where_the_slo_model_places_it_and_the_score_policy_would_not():
    """One policy (issue 28): a continuation is placed by the placer that places first requests. d0 owes
    few tokens over 3 streams, d1 many over 1: the score policy (disaggregate) picks d0, the least
    outstanding work; the SLO model (the default) picks d1, where recomputing the continuation
    stalls one stream instead of three."""
    async def go(placement: str) -> str:
        router, _, _, _ = make(PrefixIndex(), placement=placement)
        loads = router.pool.decode_load
        loads["d0"].requests, loads["d0"].tokens = 3, 90
        loads["d1"].requests, loads["d1"].tokens = 1, 2000
        routes = await router.routes(force=True)
        return router.planner.choose_decode(router.pool, req("m1", tokens=tuple(range(1000, 1400))), routes, 0)

    assert asyncio.run(go("slo")) == "d1"
    assert asyncio.run(go("disaggregate")) == "d0"
