"""The coordinator is off the request path: once a router has a view, no request waits for the
directory (expiry and invalidation refresh in the background, a slow or dead directory changes
nothing); a half-open pair's probe is asked in the background while a closed pair can serve, and
awaited (within a deadline) only by a request that has nothing else left."""

from __future__ import annotations

import asyncio

from tests.unit.test_router import FakeClock, collect, make, req


def never_answers_probes(directory) -> None:
    """The coordinator gets `admit_probe` calls and answers none of them (for 10 s)."""
    probe = directory.admit_probe

    async def hung(decode_id, prefill_id):
        await asyncio.sleep(10)
        return await probe(decode_id, prefill_id)

    directory.admit_probe = hung


def test_no_request_waits_for_a_slow_directory_once_the_view_exists():
    async def go():
        clock = FakeClock()
        router, ps, _, directory = make(clock=clock)
        await collect(await router.open(req("warm")))  # the first lookup waits once
        fetch = directory.routes
        gate = asyncio.Event()

        async def slow():
            await gate.wait()  # the coordinator is busy (or restarting)
            return await fetch()

        directory.routes = slow
        clock.t += 5.0  # the view expired
        served = [await router.open(req(f"r{i}")) for i in range(3)]
        ps["p0"].prefill_error = RuntimeError("boom")  # a failure invalidates the view...
        served.append(await router.open(req("after-failure")))  # ...and still nobody waits
        for s in served:
            await collect(s)
        waited = router.view.waits
        gate.set()
        await router.drain()
        return waited, served, directory.calls

    waited, served, calls = asyncio.run(go())
    assert waited == 1  # the very first lookup only
    assert all(s.finished for s in served) and calls >= 2


def test_the_probe_is_asked_only_for_a_half_open_pair_and_never_awaited_while_a_closed_pair_serves():
    async def go():
        clock = FakeClock()
        router, ps, _, directory = make(clock=clock, prefills=("p0", "p1"))
        router.probe_timeout_s = 0.05
        for _ in range(2):
            directory.ledger.prefill_failed("d0", "p0", "x")
        await router.routes(force=True)
        for i in range(3):  # p0 open: skipped without asking anyone
            await collect(await router.open(req(f"closed{i}")))
        asked_while_open = router.probes.asked
        clock.t += 10.0  # cooldown over: p0 is half-open
        await router.routes(force=True)
        never_answers_probes(directory)
        ps["p1"].prefills.clear()
        t0 = asyncio.get_running_loop().time()
        s = await router.open(req("half-open"))  # p0 ranks first (least loaded ties keep order)
        took = asyncio.get_running_loop().time() - t0
        await collect(s)
        await router.drain()  # the background ask ends at its deadline: not granted
        return asked_while_open, router.probes.asked, router.probes.waited, took, s.prefill_id

    asked_while_open, asked, waited, took, chosen = asyncio.run(go())
    assert asked_while_open == 0 and asked == 1 and waited == 0
    assert took < 0.05 and chosen == "p1"  # the closed pair serves at once; the coordinator is asked aside


def test_a_request_with_only_a_half_open_pair_waits_for_its_probe_within_the_deadline():
    async def go():
        clock = FakeClock()
        router, ps, _, directory = make(clock=clock, prefills=("p0",), prefill_retries=0)
        router.probes.timeout_s = 0.05
        for _ in range(2):
            directory.ledger.prefill_failed("d0", "p0", "x")
        clock.t += 10.0  # cooldown over: p0 is half-open, and the only prefill engine
        await router.routes(force=True)
        s = await router.open(req("won"))  # nothing closed to take: it waits, wins and carries the probe
        won = (s.prefill_id, router.probes.waited, router.probes.carried)
        await collect(s)
        for _ in range(2):  # open again
            directory.ledger.prefill_failed("d0", "p0", "x")
        clock.t += 10.0
        await router.routes(force=True)
        never_answers_probes(directory)
        t0 = asyncio.get_running_loop().time()
        s = await router.open(req("unanswered"))
        took = asyncio.get_running_loop().time() - t0
        await collect(s)
        await router.drain()
        return won, took, s.route.path

    won, took, path = asyncio.run(go())
    assert won == ("p0", 1, 1)
    assert took < 1.0 and path == "fallback"  # no answer within the deadline: the decode engine prefills
