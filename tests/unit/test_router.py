"""Router: engine selection, the ledger's breakers, fallbacks, retry-once, client errors, migration,
policies, aborts (fakes, no Ray; the directory fake wraps a real TransferLedger like the coordinator)."""

from __future__ import annotations

import asyncio

import pytest

from actors.kv.aggregator import KVConnectorOutput
from actors.control.breaker_config import BreakerConfig
from actors.control.ledger import TransferLedger
from actors.routes import PrefillRoute, RouteTable
from actors.protocol.request import EngineRequest, PrefillResult, SamplingSpec, TokenChunk
from serving.config import RouterConfig
from serving.routing.route_errors import (
    EngineUnavailable,
    InvalidRequest,
    NoDecodeEngine,
    NoPrefillEngine,
    RequestRejected,
)
from serving.routing.pool import EnginePool
from serving.routing.router import Router
from serving.routing.status import Readiness
from typed_fakes import engine_stats


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


ERROR = TokenChunk("x", finished=True, finish_reason="error", error="KV transfer failed: boom")


class FakeEngine:
    """A prefill/decode engine; behaviour is set per instance.

    Decode tokens are their positions in the answer ("t<pos>"; the prefill engine's first
    token is position 0), so a resumed stream (`num_resumed_tokens`) continues exactly
    where the uninterrupted one would be, as a greedy model does.
    """

    def __init__(self, engine_id, tokens=None, prefill_error=None, first_chunk=None, fail_after=None,
                 recomputed=False, gate=None, hang_after=None):
        self.engine_id = engine_id
        self.tokens = tokens  # None: as many as max_tokens asks
        self.prefill_error = prefill_error  # exception raised by prefill()
        self.first_chunk = first_chunk  # a TokenChunk replacing the first chunk (e.g. an error chunk)
        self.fail_after = fail_after  # raise EngineUnavailable(died) after this many tokens
        self.recomputed = recomputed
        self.gate = gate  # asyncio.Event awaited before answering
        self.hang_after = hang_after  # never answer again after this many tokens (a frozen engine)
        self.ledger = None  # set by make(): decode engines report transfer verdicts like real ones
        self.prefills: list[EngineRequest] = []
        self.generates: list[EngineRequest] = []
        self.aborted: list[str] = []

    async def prefill(self, req):
        self.prefills.append(req)
        if self.gate is not None:
            await self.gate.wait()
        if self.prefill_error is not None:
            raise self.prefill_error
        params = {"remote_engine_id": self.engine_id, "remote_block_ids": [1]} if req.max_tokens > 1 else None
        return PrefillResult(req.prompt_token_ids, (0,), " first", "length", params)

    async def generate(self, req):
        self.generates.append(req)
        if self.gate is not None:
            await self.gate.wait()
        rid = req.request_id
        params = req.kv_transfer_params
        if params and self.ledger is not None:
            self.ledger.open(rid, params["remote_engine_id"], self.engine_id)
            failed = self.recomputed or (self.first_chunk is not None and self.first_chunk.failed)
            self.ledger.report(self.engine_id, [KVConnectorOutput(finished_recving={rid},
                                                                  failed_recving={rid} if failed else set(),
                                                                  expected_finished_count=1)])
        if self.first_chunk is not None:
            yield self.first_chunk.replace(request_id=rid)
            return
        prompt = req.prompt_token_ids or (1, 2, 3)
        n = req.max_tokens if self.tokens is None else self.tokens
        for i in range(n):
            if self.fail_after is not None and i == self.fail_after:
                raise EngineUnavailable("actor died", died=True)
            if self.hang_after is not None and i >= self.hang_after:
                await asyncio.Event().wait()
            pos = req.num_resumed_tokens + i
            last = i == n - 1
            yield TokenChunk(rid, (pos,), f" t{pos}", finished=last, finish_reason="length" if last else None,
                             recomputed=self.recomputed and i == 0,
                             num_prompt_tokens=len(prompt) - req.num_resumed_tokens)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def stats(self):
        return engine_stats(self.engine_id, free_blocks=10, num_blocks=10)


class FakeDirectory:
    """The coordinator's view: compatible pairs, live engines, and the ledger's breakers."""

    def __init__(self, routes, clock):
        self.routes_value = routes  # decode -> compatible prefills (live engines only)
        self.ledger = TransferLedger(BreakerConfig(failure_threshold=2, cooldown_s=10.0, probe_window_s=5.0),
                                     clock=clock)
        self.generations: dict[str, int] = {}
        self.calls = 0
        self.probes = 0
        self.error = None
        self.hung_reports: list[tuple] = []

    async def routes(self):
        self.calls += 1
        if self.error:
            raise self.error
        led = self.ledger
        return RouteTable({d: tuple(PrefillRoute(p, led.route_state(d, p)) for p in ps if not led.is_open(d, p))
                           for d, ps in self.routes_value.items()}, led.pair_states(),
                          {d: self.generations.get(d, 1) for d in self.routes_value})

    async def admit_probe(self, decode_id, prefill_id):
        self.probes += 1
        return self.ledger.admit_probe(decode_id, prefill_id)

    def prefill_failed(self, decode_id, prefill_id, reason):
        self.ledger.prefill_failed(decode_id, prefill_id, reason)

    def engine_hung(self, engine_id, generation, reason):
        self.hung_reports.append((engine_id, generation, reason))

    def state(self, decode_id, prefill_id):
        return self.ledger.route_state(decode_id, prefill_id)


def make(prefills=("p0", "p1"), decodes=("d0",), routes=None, clock=None, **settings):
    ps = {p: FakeEngine(p) for p in prefills}
    ds = {d: FakeEngine(d) for d in decodes}
    if routes is None:
        routes = {d: list(prefills) for d in decodes}
    clock = clock or FakeClock()
    directory = FakeDirectory(routes, clock)
    for d in ds.values():
        d.ledger = directory.ledger
    settings.setdefault("migration_wait_s", 0.0)
    settings.setdefault("placement", "disaggregate")  # these tests are about the P/D path's mechanics
    router = Router(ps, ds, directory, RouterConfig(**settings), clock=clock)
    return router, ps, ds, directory


def req(rid="r1", prompt="hello world", max_tokens=3):
    """The prompt as the front tokenizes it for the synthetic model: one token per UTF-8 byte."""
    return EngineRequest(rid, SamplingSpec(max_tokens=max_tokens), prompt_token_ids=tuple(prompt.encode()))


async def collect(stream):
    chunks = [c async for c in stream]
    stream.close()
    return chunks


def texts(chunks):
    return [c.text for c in chunks]


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------ selection
def test_pd_path_passes_transfer_params_and_streams_every_token():
    async def go():
        router, ps, ds, directory = make()
        stream = await router.open(req())
        chunks = await collect(stream)
        assert texts(chunks) == [" first", " t1", " t2"]
        assert stream.prefill_id == "p0" and stream.route.path == "pd"
        sent = ds["d0"].generates[0]
        assert sent.kv_transfer_params["remote_engine_id"] == "p0"
        assert ps["p0"].prefills[0].request_id == "r1"
        assert directory.state("d0", "p0") == "closed" and directory.ledger.verdicts["ok"] == 1
        await router.drain()
        assert ds["d0"].aborted == [] and ps["p0"].aborted == []  # finished: nothing to abort
        assert router.pool.decode_load["d0"].requests == 0 and router.pool.decode_load["d0"].tokens == 0

    run(go())


def test_decode_is_chosen_by_least_outstanding_work():
    async def go():
        router, _, ds, _ = make(decodes=("d0", "d1"))
        s1 = await router.open(req("a", max_tokens=3))
        s2 = await router.open(req("b", max_tokens=3))
        assert {s1.decode_id, s2.decode_id} == {"d0", "d1"}
        # consume s1 entirely: its engine owes nothing, so it is chosen next
        await collect(s1)
        s3 = await router.open(req("c"))
        assert s3.decode_id == s1.decode_id
        for s in (s2, s3):
            await collect(s)
        assert all(load.requests == 0 and load.tokens == 0 for load in router.pool.decode_load.values())

    run(go())


def test_big_request_outweighs_request_count():
    async def go():
        router, _, _, _ = make(decodes=("d0", "d1"))
        big = await router.open(req("big", max_tokens=500))
        small = [await router.open(req(f"s{i}", max_tokens=2)) for i in range(3)]
        assert all(s.decode_id != big.decode_id for s in small)
        for s in [big, *small]:
            s.close()

    run(go())


def test_prefill_is_chosen_by_load_among_compatible_engines():
    async def go():
        router, ps, _, _ = make(prefills=("p0", "p1", "p2"), routes={"d0": ["p1", "p2"]})
        gate = asyncio.Event()
        ps["p1"].gate = gate
        first = asyncio.ensure_future(router.open(req("a")))
        await asyncio.sleep(0)  # a's prefill is now in flight on p1 (least loaded, first by id)
        assert router.pool.prefill_load["p1"].requests == 1
        second = await router.open(req("b"))
        assert second.prefill_id == "p2"  # p1 is busy, p0 is not compatible with d0
        gate.set()
        s1 = await first
        assert s1.prefill_id == "p1" and ps["p0"].prefills == []
        for s in (s1, second):
            await collect(s)
        assert all(load.requests == 0 for load in router.pool.prefill_load.values())

    run(go())


def test_dead_decode_engine_is_not_chosen_and_none_alive_is_503():
    async def go():
        router, _, _, directory = make(decodes=("d0", "d1"), routes={"d1": ["p0"]})
        s = await router.open(req())
        assert s.decode_id == "d1"
        s.close()
        directory.routes_value = {}
        await router.routes(force=True)
        with pytest.raises(NoDecodeEngine) as err:
            await router.open(req("x"))
        assert "no decode engine" in err.value.message

    run(go())


# ------------------------------------------------------------------ breakers (the ledger's)
def test_open_breaker_is_skipped_then_one_probe_after_cooldown():
    async def go():
        clock = FakeClock()
        router, ps, _, directory = make(clock=clock, prefill_retries=0)
        ps["p0"].prefill_error = EngineUnavailable("boom")
        for i in range(2):  # threshold 2: two failed prefills on p0, reported to the ledger, open it
            s = await router.open(req(f"f{i}"))
            assert s.route.path == "fallback"  # retries=0: straight to the decode-local fallback
            await collect(s)
        assert directory.state("d0", "p0") == "open"
        assert {b.pair: b for b in directory.ledger.pair_states()}["p0->d0"].last_reason == "prefill failed: boom"
        await router.drain()  # the reported failure refreshed the view in the background (no request waits)
        s = await router.open(req("ok"))
        assert s.prefill_id == "p1"
        await collect(s)
        ps["p0"].prefill_error = None
        clock.t += 10.0  # cooldown over
        s = await router.open(req("stale"))  # the expired view is served while it refreshes in the background
        assert s.prefill_id == "p1"
        await collect(s)
        await router.drain()
        # the refreshed view: p0 half-open, p1 closed; this request takes p1 without waiting, and the
        # router asks for p0's probe in the background: the ledger grants it, once
        s = await router.open(req("asks"))
        assert s.prefill_id == "p1" and router.probes.waited == 0
        await collect(s)
        await router.drain()
        assert directory.probes == 1
        s = await router.open(req("probe"))  # the next request ranked to p0 carries the probe
        assert s.prefill_id == "p0" and directory.probes == 1 and router.probes.carried == 1
        await collect(s)  # the decode engine's verdict closes the breaker
        assert directory.state("d0", "p0") == "closed"

    run(go())


def test_probe_taken_elsewhere_is_not_taken_twice():
    async def go():
        clock = FakeClock()
        router, ps, _, directory = make(clock=clock, prefills=("p0",))
        for _ in range(2):
            directory.ledger.prefill_failed("d0", "p0", "x")
        clock.t += 10.0
        assert directory.ledger.admit_probe("d0", "p0")  # another router (replica) won the probe
        await router.routes(force=True)
        s = await router.open(req())
        assert s.route.path == "fallback" and ps["p0"].prefills == []
        await collect(s)

    run(go())


def test_fail_policy_ends_the_stream_after_the_first_token():
    async def go():
        router, ps, ds, directory = make()
        ds["d0"].first_chunk = ERROR  # the decode engine's pull failed and its policy is `fail`
        s = await router.open(req())
        chunks = await collect(s)
        assert texts(chunks) == [" first", ""] and chunks[-1].failed and "KV transfer failed" in chunks[-1].error
        assert len(ds["d0"].generates) == 1  # not continued anywhere: the policy said fail
        assert router.pool.transfer_failures[("d0", "p0")] == 1
        assert {b.pair: b for b in directory.ledger.pair_states()}["p0->d0"].failures == 1
        await router.drain()
        assert ps["p0"].aborted == ["r1"]  # the failed pull's leased blocks are released

    run(go())


def test_recompute_policy_answer_is_delivered_but_counts_as_a_transfer_failure():
    async def go():
        router, _, ds, directory = make()
        ds["d0"].recomputed = True
        s = await router.open(req())
        chunks = await collect(s)
        assert texts(chunks) == [" first", " t1", " t2"] and chunks[1].recomputed
        assert router.pool.transfer_failures[("d0", "p0")] == 1 and router.pool.counters["recomputed"] == 1
        assert {b.pair: b for b in directory.ledger.pair_states()}["p0->d0"].failures == 1

    run(go())


def test_a_recomputed_pull_prices_its_pair_by_what_it_cost_and_a_good_pull_clears_it():
    class Ticking(FakeClock):
        def __call__(self):  # every reading a second later: every wait costs something
            self.t += 1.0
            return self.t

    async def go():
        router, _, ds, _ = make(clock=Ticking())
        ds["d0"].recomputed = True
        await collect(await router.open(req()))
        failed = router.pool.rates.failure_penalty_s("p0", "d0")
        ds["d0"].recomputed = False
        await collect(await router.open(req("r2")))
        return failed, router.pool.rates.failure_penalty_s("p0", "d0")

    failed, after_good = run(go())
    assert failed > 0 and after_good == 0.0


# ------------------------------------------------------------------ fallback
def test_no_compatible_prefill_falls_back_to_decode_local():
    async def go():
        router, ps, ds, _ = make(routes={"d0": []})
        s = await router.open(req())
        await collect(s)
        assert s.route.path == "fallback" and s.prefill_id is None
        assert ds["d0"].generates[0].kv_transfer_params is None
        assert router.pool.fallbacks["no_prefill_engine"] == 1
        assert ps["p0"].prefills == [] and ps["p1"].prefills == []

    run(go())


def test_no_compatible_prefill_with_reject_policy_is_503():
    async def go():
        router, _, ds, _ = make(routes={"d0": []}, no_prefill_fallback="reject")
        with pytest.raises(NoPrefillEngine) as err:
            await router.open(req())
        assert err.value.code == "no_prefill_engine"
        assert ds["d0"].generates == []
        assert router.pool.decode_load["d0"].requests == 0

    run(go())


def test_slo_placement_colocates_a_short_prompt_and_disaggregates_a_long_one_beside_busy_streams():
    async def go():
        router, ps, ds, _ = make(placement="slo")
        s = await router.open(req(prompt="short"))
        await collect(s)
        assert s.route.path == "local" and ps["p0"].prefills == []
        router.pool.decode_load["d0"].requests = 4  # streams decoding there: a local prefill would stall them
        long = await router.open(req("r2", prompt="x" * 400))
        await collect(long)
        assert long.route.path == "pd"

    run(go())


# ------------------------------------------------------------------ retries
def test_failed_prefill_is_retried_once_on_another_engine():
    async def go():
        router, ps, _, directory = make()
        ps["p0"].prefill_error = EngineUnavailable("actor died")
        s = await router.open(req())
        await collect(s)
        assert s.prefill_id == "p1" and s.route.attempts == 2
        assert router.pool.prefill_failures["p0"] == 1 and router.pool.counters["prefill_retries"] == 1
        assert {b.pair: b for b in directory.ledger.pair_states()}["p0->d0"].failures == 1

    run(go())


def test_retry_budget_is_one_then_fallback_or_503():
    async def go():
        for policy in ("decode_local", "reject"):
            router, ps, ds, _ = make(prefills=("p0", "p1", "p2"), no_prefill_fallback=policy)
            for p in ps.values():
                p.prefill_error = EngineUnavailable("down")
            if policy == "decode_local":
                s = await router.open(req())
                await collect(s)
                assert s.route.path == "fallback" and router.pool.fallbacks["prefill_failed"] == 1
            else:
                with pytest.raises(NoPrefillEngine) as err:
                    await router.open(req())
                assert "down" in err.value.message
            assert sum(len(p.prefills) for p in ps.values()) == 2  # the first try + one retry

    run(go())


def test_client_errors_are_400_never_retried_never_a_breaker_failure():
    async def go():
        router, ps, _, directory = make()
        ps["p0"].prefill_error = RequestRejected("token id 99999 is out of vocabulary")
        for i in range(30):
            with pytest.raises(InvalidRequest) as err:
                await router.open(req(f"bad{i}"))
            assert "vocabulary" in err.value.message
        assert ps["p1"].prefills == []  # a bad request is not retried
        assert directory.ledger.pair_states() == ()  # no breaker ever moved
        ps["p0"].prefill_error = None
        s = await router.open(req("good"))
        assert s.route.path == "pd" and s.prefill_id == "p0"  # P/D still used afterwards
        await collect(s)

    run(go())


def test_decode_engine_unavailable_before_first_token_is_503():
    async def go():
        router, ps, ds, _ = make(routes={"d0": []})
        ds["d0"].fail_after = 0
        with pytest.raises(NoDecodeEngine):
            await router.open(req())
        await router.drain()
        assert router.pool.decode_load["d0"].requests == 0

    run(go())


def test_decode_engine_dying_before_first_token_goes_to_another_decode_engine():
    async def go():
        router, ps, ds, _ = make(decodes=("d0", "d1"), routes={"d0": [], "d1": []})
        ds["d0"].fail_after = ds["d1"].fail_after = None
        ds["d0"].fail_after = 0
        s = await router.open(req("x"))
        if s.decode_id == "d0":  # round robin picked the healthy one first: ask again
            await collect(s)
            s = await router.open(req("y"))
        assert s.decode_id == "d1"
        assert texts(await collect(s)) == [" t0", " t1", " t2"]

    run(go())


# ------------------------------------------------------------------ migration
def test_stream_migrates_to_another_decode_engine_token_for_token():
    async def go():
        router, ps, ds, _ = make(decodes=("d0", "d1"))
        want = texts(await collect(await router.open(req("ref", max_tokens=6))))
        s = await router.open(req("r", max_tokens=6))
        ds[s.decode_id].fail_after = 2  # dies after two decode tokens
        other = ({"d0", "d1"} - {s.decode_id}).pop()
        chunks = await collect(s)
        assert texts(chunks) == want == [" first", " t1", " t2", " t3", " t4", " t5"]
        assert not any(c.failed for c in chunks)
        moved = ds[other].generates[-1]
        assert moved.request_id == "r-m1" and moved.kv_transfer_params is None
        assert moved.prompt_token_ids == tuple(b"hello world") + (0, 1, 2) and moved.num_resumed_tokens == 3
        assert moved.max_tokens == 3 and router.pool.migrations["engine_died"] == 1
        assert s.num_prompt_tokens == len(b"hello world") and s.num_generated == 6
        assert all(load.requests == 0 and load.tokens == 0 for load in router.pool.decode_load.values())

    run(go())


def test_local_stream_migrates_with_the_request_prompt_ids_and_what_was_streamed():
    async def go():
        router, ps, ds, _ = make(decodes=("d0", "d1"), routes={"d0": [], "d1": []})
        s = await router.open(req(max_tokens=4))
        ds[s.decode_id].fail_after = 1
        chunks = await collect(s)
        assert texts(chunks) == [" t0", " t1", " t2", " t3"]
        assert ds[s.decode_id].generates[-1].prompt_token_ids == tuple(b"hello world") + (0,)

    run(go())


def test_stream_waits_for_the_restarted_engine_when_it_is_the_only_one():
    async def go():
        router, ps, ds, directory = make(prefills=("p0",), migration_wait_s=5.0)
        s = await router.open(req(max_tokens=5))
        ds["d0"].fail_after = 1
        directory.routes_value = {}  # the coordinator evicted the dead incarnation

        async def restart():
            await asyncio.sleep(0.3)
            ds["d0"].fail_after = None
            directory.generations["d0"] = 2  # the restarted incarnation registered
            directory.routes_value = {"d0": ["p0"]}

        asyncio.ensure_future(restart())
        chunks = await collect(s)
        assert texts(chunks) == [" first", " t1", " t2", " t3", " t4"] and not chunks[-1].failed

    run(go())


def test_no_engine_to_take_the_stream_ends_it_with_an_error_after_what_was_streamed():
    async def go():
        router, ps, ds, _ = make()
        ds["d0"].fail_after = 1
        s = await router.open(req())
        chunks = await collect(s)
        assert texts(chunks[:2]) == [" first", " t1"]
        assert chunks[-1].finish_reason == "error" and "no engine could take" in chunks[-1].error
        assert router.pool.counters["migration_failed"] == 1 and ps["p1"].prefills == []
        await router.drain()
        assert ps["p0"].aborted == ["r1"]  # the prefill side is told to let go

    run(go())


# ------------------------------------------------------------------ aborts
def test_client_disconnect_mid_stream_aborts_on_both_engines():
    async def go():
        router, ps, ds, _ = make()
        s = await router.open(req(max_tokens=3))
        await s.__anext__()
        s.close()  # what the front does when the client goes away
        await router.drain()
        assert ds["d0"].aborted == ["r1"] and ps["p0"].aborted == ["r1"]
        assert router.pool.counters["aborted"] == 1
        assert router.pool.decode_load["d0"].requests == 0 and router.pool.decode_load["d0"].tokens == 0

    run(go())


def test_cancel_during_prefill_aborts_the_prefill_engine():
    async def go():
        router, ps, _, _ = make()
        ps["p0"].gate = asyncio.Event()
        task = asyncio.ensure_future(router.open(req()))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await router.drain()
        assert ps["p0"].aborted == ["r1"]
        assert router.pool.decode_load["d0"].requests == 0 and router.pool.prefill_load["p0"].requests == 0

    run(go())


# ------------------------------------------------------------------ health / directory
def test_health_reflects_usable_paths():
    async def go():
        router, _, _, directory = make(no_prefill_fallback="reject")
        assert (await router.readiness()).ready
        for _ in range(2):
            directory.ledger.prefill_failed("d0", "p0", "x")
            directory.ledger.prefill_failed("d0", "p1", "x")
        await router.routes(force=True)
        h = await router.readiness()
        assert not h.ready and "reject" in h.reason
        router2, _, _, d2 = make(routes={})
        h2 = await router2.readiness()
        assert not h2.ready and h2.reason == "no decode engine is alive"
        router3, _, _, _ = make(routes={"d0": []})  # decode_local fallback: still serving
        assert (await router3.readiness()).ready

    run(go())


def test_open_breakers_leave_the_front_ready_but_say_pd_is_degraded_and_why():
    async def go():
        router, _, _, directory = make()  # decode_local fallback
        assert (await router.readiness()).code == "ok"
        for _ in range(2):
            directory.ledger.prefill_failed("d0", "p0", "link down")
            directory.ledger.prefill_failed("d0", "p1", "link down")
        await router.routes(force=True)
        h = await router.readiness()
        assert (h.ready, h.code) == (True, "pd_degraded")
        assert "breaker p0->d0 open" in h.reason and "breaker p1->d0 open" in h.reason
        assert "prefilled on their decode engine" in h.reason

    run(go())


def test_a_prefill_engine_that_died_and_is_being_started_again_keeps_pd_degraded_after_the_pool_forgot_it():
    """Its actor is gone while the launcher starts it on another node (serving/cluster/node_loss.py):
    the pool forgets it, the directory's `lost` still names it, and readiness still says why."""
    pool = EnginePool({}, {"d0": FakeEngine("d0")})
    routes = RouteTable({"d0": ()}, generations={"d0": 3}, lost={"p0": "prefill"})
    h = Readiness.of(pool, routes, (), decode_local=True, directory_error=None)
    assert (h.ready, h.code) == (True, "pd_degraded")
    assert "p0 not registered (dead or restarting)" in h.reason
    back = Readiness.of(pool, RouteTable({"d0": ()}, generations={"d0": 3}), (), True, None)
    assert back.code == "ok"  # no prefill engine was ever there, or it left on purpose: colocated by design


def test_directory_is_cached_and_its_failure_keeps_the_last_view():
    async def go():
        clock = FakeClock()
        router, _, _, directory = make(clock=clock)
        for i in range(3):
            (await router.open(req(f"r{i}"))).close()
        assert directory.calls == 1
        clock.t += 2.0
        directory.error = RuntimeError("coordinator restarting")
        s = await router.open(req("r9"))  # served from the last view while it refreshes
        await router.drain()
        assert s.prefill_id in ("p0", "p1") and directory.calls == 2
        s.close()
        assert (await router.readiness()).directory_error.startswith("RuntimeError")

    run(go())


def test_snapshot_is_typed_with_the_ledgers_breakers():
    async def go():
        router, _, _, _ = make()
        await collect(await router.open(req()))
        await router.routes(force=True)
        snap = router.snapshot()
        breaker = {b.pair: b for b in snap.breakers}["p0->d0"]
        assert breaker.state == "closed" and breaker.failures == 0
        assert snap.counters["requests"] == 1 and snap.migrations == {}
        stats = await router.refresh_engine_stats()
        assert stats["d0"].up and stats["p0"].stats.free_blocks == 10

    run(go())


# ------------------------------------------------------------------ first token from the prefill engine
def test_first_token_from_prefill_is_streamed_and_decode_continues_from_token_two():
    async def go():
        router, ps, ds, directory = make(prefills=("p0",))
        s = await router.open(req(max_tokens=4))
        chunks = await collect(s)
        assert chunks[0].token_ids == (0,) and chunks[0].text == " first"
        sent = ds["d0"].generates[0]
        assert sent.prompt_token_ids == tuple(b"hello world") + (0,) and sent.max_tokens == 3 and sent.num_resumed_tokens == 1
        assert sent.kv_transfer_params["remote_engine_id"] == "p0"
        assert s.num_generated == 1 + 3 and directory.state("d0", "p0") == "closed"
        assert router.pool.decode_load["d0"].requests == 0 and router.pool.decode_load["d0"].tokens == 0

    run(go())


def test_max_tokens_one_is_served_by_the_prefill_engine_alone():
    async def go():
        router, ps, ds, _ = make(prefills=("p0",))
        chunks = await collect(await router.open(req(max_tokens=1)))
        assert [c.token_ids for c in chunks] == [(0,)] and chunks[-1].finish_reason == "length"
        assert ds["d0"].generates == []

    run(go())


def test_a_restarted_coordinator_that_is_still_settling_does_not_hide_engines():
    async def go():
        clock = FakeClock()
        router, ps, ds, directory = make(clock=clock, decodes=("d0", "d1"))
        await router.routes(force=True)
        fresh = directory.routes

        async def restarted():  # d1 registered again already, d0 not yet
            table = await fresh()
            return RouteTable({"d1": table.decodes["d1"]}, (), {"d1": 1}, settling=True)

        directory.routes = restarted
        routes = await router.routes(force=True)
        assert set(routes.decodes) == {"d0", "d1"}

        async def settled():
            table = await fresh()
            return RouteTable({"d1": table.decodes["d1"]}, (), {"d1": 1}, settling=False)

        directory.routes = settled
        assert set((await router.routes(force=True)).decodes) == {"d1"}  # d0 really is gone

    run(go())
