"""Deadlines on engine calls (serving/routing/deadlines.py): formulas, and what a router does with an
engine that misses one (fakes, no Ray): fail over, migrate at once, hold it back, tell the coordinator,
refuse what nothing can take with 503 at once, and take it back once restarted."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.rates import EngineRates
from serving.config import RouterConfig
from serving.placement_config import PlacementConfig
from serving.ops.metrics import ServiceMetrics
from serving.routing.deadlines import EngineDeadlines, EngineHung
from serving.routing.route_errors import NoDecodeEngine
from tests.unit.test_router import FakeClock, collect, make, req, texts

# deadlines of about the floor: fast priors (no engine publishes its rates in these tests)
FAST = dict(deadline_floor_s=0.2, token_timeout_s=0.2, deadline_margin=1.0,
            slo=PlacementConfig(prior_prefill_tokens_per_s=1e6, prior_step_s=1e-5, prior_step_per_stream_s=1e-6))


def run(coro):
    return asyncio.run(coro)


def test_deadlines_follow_the_work_and_the_engines_published_rates():
    slo = PlacementConfig(prior_prefill_tokens_per_s=500, prior_step_s=0.05, prior_step_per_stream_s=0.001)
    d = EngineDeadlines(RouterConfig(deadline_floor_s=10, deadline_margin=3, token_timeout_s=10, slo=slo),
                        pull_timeout_s=10)
    assert d.prefill_s("p", 1000) == pytest.approx(10 + 3 * (1000 / 500 + 0.05))  # the priors: nothing published
    assert d.prefill_s("p", 1000, queued=1000) == pytest.approx(10 + 3 * (2000 / 500 + 0.05))  # our queue counts
    # the engine published its own rates (2000 tokens/s, 10 ms steps) and every router's queue there
    d.rates.adopt({"p": EngineRates(0.01, 0.001, 1 / 2000, samples=50, prefill_samples=20, queued_prompt_tokens=3000)})
    assert d.prefill_s("p", 1000) == pytest.approx(10 + 3 * (4000 / 2000 + 2 * 0.01))  # 4000 tokens: 2 steps
    assert d.prefill_s("p", 1000, queued=5000) == pytest.approx(10 + 3 * (6000 / 2000 + 3 * 0.01))  # the larger queue
    d.rates.observe_hop("p", 0.5)  # this router's own delay to the engine: its one local correction
    assert d.prefill_s("p", 1000) == pytest.approx(10 + 3 * (2.02 + 0.5))
    assert d.first_chunk_s("p", 1000, pulls=True) == pytest.approx(10 + 3 * 2.52 + 10)  # + the pull's own bound
    assert d.token_s("d") == 10  # the floor
    d.rates.adopt({"d": EngineRates(4.0, 0.25, 1 / 2000, samples=10, decode_streams=4)})  # a slow engine
    assert d.token_s("d") == pytest.approx(3 * 5.0)  # 3 x its step at the batch it published


def test_a_hung_prefill_engine_is_failed_over_within_its_deadline_and_reported():
    async def go():
        router, ps, ds, directory = make(**FAST)
        ps["p0"].gate = asyncio.Event()  # p0 never answers
        t0 = time.monotonic()
        s = await router.open(req("a"))
        took = time.monotonic() - t0
        assert s.prefill_id == "p1" and texts(await collect(s)) == [" first", " t1", " t2"]
        assert 0.2 <= took < 1.0
        assert directory.hung_reports == [("p0", None, "missed its prefill deadline (0.2 s)")]
        assert router.pool.deadlines.misses[("p0", "prefill")] == 1
        assert {b.pair: b for b in directory.ledger.pair_states()}["p0->d0"].failures == 1  # the pair heard it
        s2 = await router.open(req("b"))  # held back: the next request goes straight to p1
        assert s2.prefill_id == "p1" and len(ps["p0"].prefills) == 1
        await collect(s2)

    run(go())


def test_streams_on_a_hung_decode_engine_all_migrate_at_once_token_for_token():
    async def go():
        router, ps, ds, directory = make(decodes=("d0", "d1"), **{**FAST, "token_timeout_s": 0.5})
        want = texts(await collect(await router.open(req("ref", max_tokens=6))))
        streams = [await router.open(req(f"r{i}", max_tokens=6)) for i in range(6)]
        victim = streams[0].decode_id
        on_victim = [s for s in streams if s.decode_id == victim]
        ds[victim].hang_after = 2  # frozen after two decode tokens
        t0 = time.monotonic()
        answers = await asyncio.gather(*(collect(s) for s in streams))
        took = time.monotonic() - t0
        assert [texts(a) for a in answers] == [want] * 6 and not any(c.failed for a in answers for c in a)
        assert len(on_victim) == 3 and router.pool.migrations["engine_hung"] == 3
        assert took < 0.5 + 0.4  # one deadline, not one per stream
        assert [r[0] for r in directory.hung_reports] == [victim]  # reported once
        assert router.pool.deadlines.misses == {(victim, "token"): 1}

    run(go())


def test_one_hung_decode_engine_streams_end_with_an_error_new_requests_get_503_at_once_then_it_is_back():
    async def go():
        clock = FakeClock()
        router, ps, ds, directory = make(prefills=("p0",), clock=clock, **FAST)
        s = await router.open(req("a", max_tokens=8))
        ds["d0"].hang_after = 1
        chunks = await collect(s)
        assert texts(chunks[:2]) == [" first", " t1"]
        assert chunks[-1].finish_reason == "error" and "no engine could take the stream" in chunks[-1].error
        ready = await router.readiness()
        assert (ready.ready, ready.code, ready.hung) == (False, "decode_engines_hung", ("d0",))
        assert "missed their deadlines" in ready.reason
        t0 = time.monotonic()
        with pytest.raises(NoDecodeEngine, match="treated as hung: d0"):
            await router.open(req("b"))
        assert time.monotonic() - t0 < 0.1  # answered at once, nobody waits on the hung engine
        metrics = ServiceMetrics(lambda: router).render().decode()
        assert 'raypd_ready{reason="decode_engines_hung"} 1.0' in metrics
        assert 'raypd_ready{reason="ok"} 0.0' in metrics
        assert 'raypd_deadline_misses_total{call="token",engine="d0"} 1.0' in metrics
        # the coordinator killed it; Ray restarted it: a new incarnation is listed
        ds["d0"].hang_after = None
        directory.generations["d0"] = 2
        await router.routes(force=True)
        assert (await router.readiness()).ready
        assert texts(await collect(await router.open(req("c", max_tokens=3)))) == [" first", " t1", " t2"]

    run(go())


def test_an_engine_found_alive_gets_work_again_after_the_hold():
    async def go():
        clock = FakeClock()
        router, ps, ds, directory = make(prefills=("p0",), clock=clock, **{**FAST, "hung_engine_hold_s": 30})
        ps["p0"].gate = asyncio.Event()
        s = await router.open(req("a"))
        assert s.route.path == "fallback"  # p0 missed its deadline: the decode engine prefilled itself
        await collect(s)
        ps["p0"].gate.set()  # it was only slow; the coordinator's probe found it alive
        assert (await router.open(req("b"))).route.path == "fallback"  # still held back
        clock.t += 31
        s = await router.open(req("c"))
        assert s.route.path == "pd" and s.prefill_id == "p0"
        await collect(s)

    run(go())


def test_a_timeout_raised_by_the_work_itself_is_not_a_missed_deadline():
    async def go():
        d = EngineDeadlines(RouterConfig(**FAST))

        async def own_timeout():
            raise TimeoutError("the work's own")

        with pytest.raises(TimeoutError, match="the work's own"):
            await d.within("e", 1, "prefill", 5.0, own_timeout())
        assert not d.suspects and not d.misses
        with pytest.raises(EngineHung):
            await d.within("e", 1, "prefill", 0.01, asyncio.sleep(1))
        assert d.suspected("e", 1) and not d.suspected("e", 2)  # another incarnation is not suspected

    run(go())


async def keep_busy(d: EngineDeadlines, engine: str, every_s: float, stop: asyncio.Event) -> None:
    """Another stream on the engine: a call on it returns every `every_s` (progress)."""
    while not stop.is_set():
        await d.within(engine, 1, "token", 5.0, asyncio.sleep(every_s))


def test_a_busy_engine_is_slow_not_hung_up_to_margin_times_the_deadline():
    async def go():
        d = EngineDeadlines(RouterConfig(**{**FAST, "token_timeout_s": 0.3, "deadline_margin": 4.0}))
        stop = asyncio.Event()
        other = asyncio.ensure_future(keep_busy(d, "e", 0.05, stop))
        await asyncio.sleep(0.06)
        t0 = time.monotonic()
        slow = await d.within("e", 1, "prefill", 0.2, asyncio.sleep(0.5, "done"))  # 2.5x its deadline
        took = time.monotonic() - t0
        assert (slow, d.suspects, d.misses) == ("done", {}, {})
        assert d.extended[("e", "prefill")] >= 1 and took >= 0.5
        t0 = time.monotonic()
        with pytest.raises(EngineHung):  # busy, but past margin x deadline: a bound for every wait
            await d.within("e", 1, "prefill", 0.2, asyncio.sleep(10))
        assert 0.8 <= time.monotonic() - t0 < 1.2
        stop.set()
        (ended,) = await asyncio.gather(other, return_exceptions=True)
        assert isinstance(ended, EngineHung) and "another request" in str(ended)  # its other waits end too

    run(go())


def test_an_engine_silent_for_the_token_timeout_misses_the_deadline_then():
    async def go():
        d = EngineDeadlines(RouterConfig(**{**FAST, "token_timeout_s": 0.4, "deadline_margin": 10.0}))
        await d.within("e", 1, "token", 1.0, asyncio.sleep(0))  # the last output: now
        t0 = time.monotonic()
        with pytest.raises(EngineHung):
            await d.within("e", 1, "prefill", 0.1, asyncio.sleep(10))  # nothing returns after it
        took = time.monotonic() - t0
        assert 0.35 <= took < 0.6  # the engine's silence reached token_timeout_s, not margin x deadline
        assert d.misses[("e", "prefill")] == 1 and d.suspected("e", 1)
        with pytest.raises(EngineHung):  # progress of another incarnation is no evidence for this one
            await d.within("f", 2, "prefill", 0.1, asyncio.sleep(10))

    run(go())
