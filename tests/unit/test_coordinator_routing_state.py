"""The coordinator's routing state without Ray: the prefix index it owns, draining, handoffs per engine."""

from __future__ import annotations

import asyncio

from actors.control.coordinator import Coordinator
from actors.prefix_wire import BlocksStored, HashScheme, KVEventsBatch
from tests.unit.test_handshake import payload

SCHEME = HashScheme(16)
TOKENS = list(range(48))


def batch() -> KVEventsBatch:
    return KVEventsBatch(SCHEME, (BlocksStored(tuple(SCHEME.block_hashes(TOKENS))),))


async def pair() -> Coordinator:
    c = Coordinator(hang_check_s=3600)
    await c.register_engine("P", "prefill", [payload(engine_id="P", role="prefill", tp_rank=0, tp_size=1).encode()])
    await c.register_engine("D", "decode", [payload(engine_id="D", role="decode", tp_rank=0, tp_size=1).encode()])
    return c


def test_registered_engines_events_feed_the_index_and_leave_with_the_engine():
    async def go():
        c = await pair()
        accepted = [await c.kv_events("D", batch()), await c.kv_events("X", batch())]
        held = c.prefix_index.cached_prefix_tokens(TOKENS + [0])
        await c.unregister_engine("D", "test")
        update = await c.prefix_index_updates(None)
        for t in c._timers:
            t.cancel()
        return accepted, held, update

    accepted, held, update = asyncio.run(go())
    assert accepted == [True, False]  # an unregistered engine's events are ignored
    assert held == {"D": 48}
    assert (update.full, update.ops) == (True, ())


def test_a_draining_prefill_engine_leaves_the_routes_and_handoffs_count_per_engine():
    async def go():
        c = await pair()
        before = [r.prefill_id for r in (await c.routes()).decodes["D"]]
        await c.open_handoff("r1", "P", "D")
        counts = (await c.handoffs_in_flight("P"), await c.handoffs_in_flight("D"), await c.handoffs_in_flight("Q"))
        marked = (await c.set_draining("P"), await c.set_draining("nobody"))
        after = [r.prefill_id for r in (await c.routes()).decodes["D"]]
        draining = {e.engine_id: e.draining for e in await c.engines()}
        for t in c._timers:
            t.cancel()
        return before, counts, marked, after, draining

    before, counts, marked, after, draining = asyncio.run(go())
    assert before == ["P"]
    assert counts == (1, 1, 0)
    assert marked == (True, False)
    assert after == []
    assert draining == {"P": True, "D": False}


def test_an_engine_that_died_stays_in_the_tables_lost_until_it_registers_again_one_that_left_does_not():
    async def go():
        c = await pair()
        seen = []
        await c._remove("P", "actor died", died=True)  # what its watcher does when the actor dies
        seen.append(dict((await c.routes()).lost))
        await c.register_engine("P", "prefill", [payload(engine_id="P", role="prefill", tp_rank=0, tp_size=1).encode()])
        seen.append(dict((await c.routes()).lost))
        await c._remove("P", "actor died", died=True)
        await c.unregister_engine("P", "scaled in")  # its replacement is not coming: no longer missing
        await c.unregister_engine("D", "shutdown")
        seen.append(dict((await c.routes()).lost))
        await c.register_engine("P", "prefill", [payload(engine_id="P", role="prefill", tp_rank=0, tp_size=1).encode()])
        await c.set_draining("P")  # the autoscaler removes it: its death is its leaving
        await c._remove("P", "actor died", died=True)
        seen.append(dict((await c.routes()).lost))
        for t in c._timers:
            t.cancel()
        return seen

    assert asyncio.run(go()) == [{"P": "prefill"}, {}, {}, {}]
