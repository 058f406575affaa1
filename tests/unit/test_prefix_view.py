"""The router's copy of the prefix index: snapshot then deltas, one fetch for concurrent callers, stale on error."""

from __future__ import annotations

import asyncio

from actors.control.prefix_index import PrefixIndex
from actors.prefix_wire import BlocksStored, HashScheme, KVEventsBatch
from serving.routing.prefix_view import PrefixCacheView

S = HashScheme(16)
TOKENS = list(range(64))


class Owner:
    def __init__(self):
        self.index, self.calls, self.fail = PrefixIndex(), [], False
        self.gate: asyncio.Event | None = None

    async def fetch(self, cursor):
        self.calls.append(cursor)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise ConnectionError("coordinator restarting")
        return self.index.updates_since(cursor)


def store(owner, engine, tokens):
    owner.index.apply(engine, KVEventsBatch(S, (BlocksStored(tuple(S.block_hashes(tokens))),)))


def test_snapshot_first_then_deltas_within_the_refresh_interval():
    clock = [0.0]
    owner = Owner()
    view = PrefixCacheView(owner.fetch, refresh_s=0.1, clock=lambda: clock[0])

    async def go():
        store(owner, "d0", TOKENS[:32])
        await view.refresh()
        store(owner, "d1", TOKENS)
        await view.refresh()  # within 0.1 s: no fetch
        before = view.cached_tokens(TOKENS + [0], ["d0", "d1"])
        clock[0] = 0.2
        await view.refresh()
        return before, view.cached_tokens(TOKENS + [0], ["d0", "d1", "d9"])

    before, after = asyncio.run(go())
    assert before == {"d0": 32, "d1": 0}
    assert after == {"d0": 32, "d1": 64, "d9": 0}
    assert owner.calls[0] is None and owner.calls[1].seq == 1


def test_concurrent_refreshes_share_one_fetch():
    owner = Owner()
    view = PrefixCacheView(owner.fetch, refresh_s=0.0)

    async def go():
        owner.gate = asyncio.Event()
        waiting = [asyncio.ensure_future(view.refresh()) for _ in range(5)]
        await asyncio.sleep(0.01)
        owner.gate.set()
        await asyncio.gather(*waiting)

    asyncio.run(go())
    assert len(owner.calls) == 1


def test_a_failed_fetch_keeps_the_last_copy_and_says_why():
    owner = Owner()
    view = PrefixCacheView(owner.fetch, refresh_s=0.0)

    async def go():
        store(owner, "d0", TOKENS)
        await view.refresh()
        owner.fail = True
        await view.refresh()
        return view.cached_tokens(TOKENS + [0], ["d0"])

    assert asyncio.run(go()) == {"d0": 64}
    assert "restarting" in view.error
