"""Router: engine selection, breakers, fallbacks, retry-once, no retry after streaming, aborts (fakes, no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from actors.protocol import EngineRequest, PrefillResult, SamplingSpec, TokenChunk
from serving.router import (
    EngineUnavailable,
    RequestRejected,
    RouteError,
    Router,
    RouterSettings,
)


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


ERROR = TokenChunk("x", finished=True, finish_reason="error", error="KV transfer failed: boom")


class FakeEngine:
    """A prefill/decode engine; behaviour is set per instance (or per call via queues)."""

    def __init__(self, engine_id, tokens=None, prefill_error=None, first_chunk=None, fail_after=None,
                 recomputed=False, gate=None):
        self.engine_id = engine_id
        self.tokens = tokens  # None: as many as max_tokens asks
        self.prefill_error = prefill_error  # exception raised by prefill()
        self.first_chunk = first_chunk  # a TokenChunk replacing the first chunk (e.g. an error chunk)
        self.fail_after = fail_after  # raise EngineUnavailable after this many tokens
        self.recomputed = recomputed
        self.gate = gate  # asyncio.Event awaited before answering
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
        return PrefillResult((7, 8, 9), (42,), " first", "length", params)

    async def generate(self, req):
        self.generates.append(req)
        if self.gate is not None:
            await self.gate.wait()
        rid = req.request_id
        if self.first_chunk is not None:
            yield self.first_chunk.replace(request_id=rid)
            return
        n = req.max_tokens if self.tokens is None else self.tokens
        for i in range(n):
            if self.fail_after is not None and i == self.fail_after:
                raise EngineUnavailable("actor died")
            last = i == n - 1
            yield TokenChunk(rid, (i,), f" t{i}", finished=last, finish_reason="length" if last else None,
                             recomputed=self.recomputed and i == 0, num_prompt_tokens=5)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def stats(self):
        return {"free_blocks": 10, "num_blocks": 10}


class FakeDirectory:
    def __init__(self, routes):
        self.routes_value = routes
        self.calls = 0
        self.error = None

    async def routes(self):
        self.calls += 1
        if self.error:
            raise self.error
        return self.routes_value


def make(prefills=("p0", "p1"), decodes=("d0",), routes=None, clock=None, **settings):
    ps = {p: FakeEngine(p) for p in prefills}
    ds = {d: FakeEngine(d) for d in decodes}
    if routes is None:
        routes = {d: list(prefills) for d in decodes}
    directory = FakeDirectory(routes)
    s = RouterSettings(**{"breaker_failure_threshold": 2, "breaker_cooldown_s": 10.0,
                          "breaker_probe_window_s": 5.0, **settings})
    router = Router(ps, ds, directory, s, clock=clock or FakeClock())
    return router, ps, ds, directory


def req(rid="r1", prompt="hello world", max_tokens=3):
    """The prompt as the front tokenizes it for the synthetic model: one token per UTF-8 byte."""
    return EngineRequest(rid, SamplingSpec(max_tokens=max_tokens), prompt_token_ids=tuple(prompt.encode()))


async def collect(stream):
    chunks = [c async for c in stream]
    stream.close()
    return chunks


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------ selection
def test_pd_path_passes_transfer_params_and_streams_every_token():
    async def go():
        router, ps, ds, _ = make()
        stream = await router.open(req())
        chunks = await collect(stream)
        assert [c.text for c in chunks] == [" first", " t0", " t1"]
        assert stream.prefill_id == "p0" and stream.route.path == "pd"
        sent = ds["d0"].generates[0]
        assert sent.kv_transfer_params["remote_engine_id"] == "p0"
        assert ps["p0"].prefills[0].request_id == "r1"
        assert router.breaker("d0", "p0").snapshot()["consecutive_failures"] == 0
        await router.drain()
        assert ds["d0"].aborted == [] and ps["p0"].aborted == []  # finished: nothing to abort
        assert router.decode_load["d0"].requests == 0 and router.decode_load["d0"].tokens == 0

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
        assert all(load.requests == 0 and load.tokens == 0 for load in router.decode_load.values())

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
        assert router.prefill_load["p1"].requests == 1
        second = await router.open(req("b"))
        assert second.prefill_id == "p2"  # p1 is busy, p0 is not compatible with d0
        gate.set()
        s1 = await first
        assert s1.prefill_id == "p1" and ps["p0"].prefills == []
        for s in (s1, second):
            await collect(s)
        assert all(load.requests == 0 for load in router.prefill_load.values())

    run(go())


def test_dead_decode_engine_is_not_chosen_and_none_alive_is_503():
    async def go():
        router, _, _, directory = make(decodes=("d0", "d1"), routes={"d1": ["p0"]})
        s = await router.open(req())
        assert s.decode_id == "d1"
        s.close()
        directory.routes_value = {}
        await router.routes(force=True)
        with pytest.raises(RouteError) as err:
            await router.open(req("x"))
        assert err.value.status == 503 and "no decode engine" in err.value.message

    run(go())


# ------------------------------------------------------------------ breakers
def test_open_breaker_is_skipped_then_probed_after_cooldown():
    async def go():
        clock = FakeClock()
        router, ps, _, _ = make(clock=clock, prefill_retries=0)
        ps["p0"].prefill_error = EngineUnavailable("boom")
        for i in range(2):  # threshold 2: two failed prefills on p0 open its breaker
            s = await router.open(req(f"f{i}"))
            assert s.route.path == "fallback"  # retries=0: straight to the decode-local fallback
            await collect(s)
        assert router.breaker("d0", "p0").state == "open"
        s = await router.open(req("ok"))
        assert s.prefill_id == "p1"
        await collect(s)
        ps["p0"].prefill_error = None
        clock.t += 10.0  # cooldown over: the next request probes p0 (least loaded and first)
        s = await router.open(req("probe"))
        assert s.prefill_id == "p0"
        await collect(s)
        assert router.breaker("d0", "p0").state == "closed"

    run(go())


def test_transfer_failure_feeds_the_breaker_and_the_prefill_blocks_are_released():
    async def go():
        router, ps, ds, _ = make()
        orig = ds["d0"].generate

        def flaky(r):  # the pull fails before any decode token
            ds["d0"].first_chunk = ERROR if r.kv_transfer_params else None
            return orig(r)

        ds["d0"].generate = flaky
        s = await router.open(req())
        chunks = await collect(s)
        assert [c.text for c in chunks] == [" first", " t0", " t1"]  # continued locally
        assert router.transfer_failures[("d0", "p0")] == 1
        assert router.breaker("d0", "p0").consecutive_failures == 1
        await router.drain()
        assert ps["p0"].aborted == ["r1"]  # the failed pull's leased blocks are released

    run(go())


def test_recomputed_answer_is_delivered_but_counts_as_a_transfer_failure():
    async def go():
        router, _, ds, _ = make()
        ds["d0"].recomputed = True
        s = await router.open(req())
        chunks = await collect(s)
        assert len(chunks) == 3 and s.route.attempts == 1 and chunks[1].recomputed
        assert router.transfer_failures[("d0", "p0")] == 1

    run(go())


# ------------------------------------------------------------------ fallback
def test_no_compatible_prefill_falls_back_to_decode_local():
    async def go():
        router, ps, ds, _ = make(routes={"d0": []})
        s = await router.open(req())
        await collect(s)
        assert s.route.path == "fallback" and s.prefill_id is None
        assert ds["d0"].generates[0].kv_transfer_params is None
        assert router.fallbacks["no_prefill_engine"] == 1
        assert ps["p0"].prefills == [] and ps["p1"].prefills == []

    run(go())


def test_no_compatible_prefill_with_reject_policy_is_503():
    async def go():
        router, _, ds, _ = make(routes={"d0": []}, no_prefill_fallback="reject")
        with pytest.raises(RouteError) as err:
            await router.open(req())
        assert err.value.status == 503 and err.value.code == "no_prefill_engine"
        assert ds["d0"].generates == []
        assert router.decode_load["d0"].requests == 0

    run(go())


def test_short_prompt_skips_remote_prefill():
    async def go():
        router, ps, ds, _ = make(short_prompt_tokens=50)
        s = await router.open(req(prompt="short"))
        await collect(s)
        assert s.route.path == "short" and ps["p0"].prefills == []
        long = await router.open(req("r2", prompt="x" * 80))
        await collect(long)
        assert long.route.path == "pd"

    run(go())


# ------------------------------------------------------------------ retries
def test_failed_prefill_is_retried_once_on_another_engine():
    async def go():
        router, ps, _, _ = make()
        ps["p0"].prefill_error = EngineUnavailable("actor died")
        s = await router.open(req())
        await collect(s)
        assert s.prefill_id == "p1" and s.route.attempts == 2
        assert router.prefill_failures["p0"] == 1 and router.counters["prefill_retries"] == 1

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
                assert s.route.path == "fallback" and router.fallbacks["prefill_failed"] == 1
            else:
                with pytest.raises(RouteError) as err:
                    await router.open(req())
                assert err.value.status == 503 and "down" in err.value.message
            assert sum(len(p.prefills) for p in ps.values()) == 2  # the first try + one retry

    run(go())


def test_bad_request_from_prefill_is_400_and_not_a_breaker_failure():
    async def go():
        router, ps, _, _ = make()
        ps["p0"].prefill_error = RequestRejected("the prompt is empty")
        with pytest.raises(RouteError) as err:
            await router.open(req())
        assert err.value.status == 400 and "empty" in err.value.message
        assert router.breaker("d0", "p0").consecutive_failures == 0
        assert ps["p1"].prefills == []  # a bad request is not retried

    run(go())


def test_no_retry_after_tokens_were_streamed():
    async def go():
        router, ps, ds, _ = make()
        ds["d0"].fail_after = 1
        s = await router.open(req())
        chunks = await collect(s)
        assert [c.text for c in chunks[:2]] == [" first", " t0"]
        assert chunks[-1].finish_reason == "error" and "mid-stream" in chunks[-1].error
        assert len(ds["d0"].generates) == 1 and ps["p1"].prefills == []
        await router.drain()
        assert ps["p0"].aborted == ["r1"]  # the prefill side is told to let go

    run(go())


def test_decode_engine_unavailable_before_first_token_is_503():
    async def go():
        router, ps, ds, _ = make(routes={"d0": []})
        ds["d0"].fail_after = 0
        with pytest.raises(RouteError) as err:
            await router.open(req())
        assert err.value.status == 503
        await router.drain()
        assert router.decode_load["d0"].requests == 0

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
        assert router.counters["aborted"] == 1
        assert router.decode_load["d0"].requests == 0 and router.decode_load["d0"].tokens == 0

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
        assert router.decode_load["d0"].requests == 0 and router.prefill_load["p0"].requests == 0

    run(go())


# ------------------------------------------------------------------ health / directory
def test_health_reflects_usable_paths():
    async def go():
        clock = FakeClock()
        router, _, _, directory = make(clock=clock, no_prefill_fallback="reject")
        assert (await router.health())["healthy"]
        for _ in range(2):
            router.breaker("d0", "p0").record_failure()
            router.breaker("d0", "p1").record_failure()
        h = await router.health()
        assert not h["healthy"] and "reject" in h["reason"]
        router2, _, _, d2 = make(routes={})
        h2 = await router2.health()
        assert not h2["healthy"] and h2["reason"] == "no decode engine is alive"
        router3, _, _, _ = make(routes={"d0": []})  # decode_local fallback: still serving
        assert (await router3.health())["healthy"]

    run(go())


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
        assert (await router.health())["directory_error"].startswith("RuntimeError")

    run(go())


def test_snapshot_is_plain_data():
    async def go():
        router, _, _, _ = make()
        await collect(await router.open(req()))
        snap = router.snapshot()
        assert snap["breakers"]["p0->d0"]["state"] == "closed"
        assert snap["counters"]["requests"] == 1
        stats = await router.refresh_engine_stats()
        assert stats["d0"]["up"] and stats["p0"]["free_blocks"] == 10

    run(go())


# ------------------------------------------------------------------ first token from the prefill engine
def test_first_token_from_prefill_is_streamed_and_decode_continues_from_token_two():
    async def go():
        router, ps, ds, _ = make(prefills=("p0",))
        s = await router.open(req(max_tokens=4))
        chunks = await collect(s)
        assert chunks[0].token_ids == (42,) and chunks[0].text == " first"
        sent = ds["d0"].generates[0]
        assert sent.prompt_token_ids == (7, 8, 9, 42) and sent.max_tokens == 3 and sent.num_resumed_tokens == 1
        assert sent.kv_transfer_params["remote_engine_id"] == "p0"
        assert s.num_generated == 1 + 3 and router.breaker("d0", "p0").consecutive_failures == 0
        assert router.decode_load["d0"].requests == 0 and router.decode_load["d0"].tokens == 0

    run(go())


def test_first_token_then_failed_pull_continues_locally():
    async def go():
        router, ps, ds, _ = make(prefills=("p0",))
        orig = ds["d0"].generate

        def flaky(r):
            ds["d0"].first_chunk = ERROR if r.kv_transfer_params else None
            return orig(r)

        ds["d0"].generate = flaky
        s = await router.open(req(max_tokens=4))
        chunks = await collect(s)
        assert [c.text for c in chunks] == [" first", " t0", " t1", " t2"]  # nothing lost or repeated
        assert ds["d0"].generates[1].kv_transfer_params is None
        assert ds["d0"].generates[1].prompt_token_ids == (7, 8, 9, 42)
        assert router.transfer_failures[("d0", "p0")] == 1 and router.fallbacks["transfer_failed"] == 1

    run(go())


def test_max_tokens_one_is_served_by_the_prefill_engine_alone():
    async def go():
        router, ps, ds, _ = make(prefills=("p0",))
        chunks = await collect(await router.open(req(max_tokens=1)))
        assert [c.token_ids for c in chunks] == [(42,)] and chunks[-1].finish_reason == "length"
        assert ds["d0"].generates == []

    run(go())
