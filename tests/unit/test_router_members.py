"""Router membership follows the directory: engines started later are adopted, departed ones forgotten."""

from __future__ import annotations

import asyncio

from serving.config import RouterConfig
from serving.routing.router import Router
from tests.unit.test_router import FakeClock, FakeDirectory, FakeEngine, collect, req


def make(routes, gone=("d0",)):
    made = []

    def resolve(eid):
        if eid in gone:
            return None  # its actor no longer exists
        made.append(eid)
        return FakeEngine(eid)

    clock = FakeClock()
    directory = FakeDirectory(routes, clock)
    router = Router({"p0": FakeEngine("p0")}, {"d0": FakeEngine("d0")}, directory,
                    RouterConfig(directory_ttl_s=0.0), clock=clock, resolve_engine=resolve)
    return router, directory, made


def test_engines_listed_later_are_adopted_and_served():
    async def go():
        router, directory, made = make({"d0": ["p0"]})
        directory.routes_value = {"d1": ["p0", "p1"]}  # d0 left, d1 and p1 arrived
        stream = await router.open(req(max_tokens=2))
        await collect(stream)
        return router, made, stream

    router, made, stream = asyncio.run(go())
    assert sorted(made) == ["d1", "p1"]
    assert stream.decode_id == "d1"
    assert (sorted(router.pool.decodes), sorted(router.pool.prefills)) == (["d1"], ["p0", "p1"])


def test_a_departed_engine_is_kept_while_a_request_of_ours_runs_there():
    async def go():
        router, directory, _ = make({"d0": ["p0"]})
        router.pool.decode_load["d0"].requests = 1
        directory.routes_value = {"d1": ["p0"]}
        await router.routes(force=True)
        kept = sorted(router.pool.decodes)
        router.pool.decode_load["d0"].requests = 0
        await router.routes(force=True)
        return kept, sorted(router.pool.decodes)

    assert asyncio.run(go()) == (["d0", "d1"], ["d1"])


def test_a_departed_engine_whose_actor_still_exists_is_kept():
    async def go():
        router, directory, _ = make({"d0": ["p0"]}, gone=())
        directory.routes_value = {"d1": ["p0"]}  # d0 died but is restarting: still shown (as down)
        await router.routes(force=True)
        return sorted(router.pool.decodes)

    assert asyncio.run(go()) == ["d0", "d1"]


def test_without_a_resolver_the_engine_set_is_fixed():
    async def go():
        router = Router({"p0": FakeEngine("p0")}, {"d0": FakeEngine("d0")},
                        FakeDirectory({"d0": ["p0"], "d9": ["p0"]}, FakeClock()))
        await router.routes()
        return sorted(router.pool.decodes)

    assert asyncio.run(go()) == ["d0"]
