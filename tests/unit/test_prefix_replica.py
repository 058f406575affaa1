"""A router's inverted replica answers exactly as the owner's index does, after any mix of stores,
removals, clears, caps and scheme changes; a big update leaves the event loop free between slices."""

from __future__ import annotations

import asyncio
import random

from actors.control.prefix_index import AllBlocksCleared, BlocksRemoved, BlocksStored, HashScheme, KVEventsBatch, PrefixIndex
from serving.routing.prefix_replica import PrefixReplica
from serving.routing.prefix_view import PrefixCacheView

S16, S32 = HashScheme(16), HashScheme(32)


def test_the_replica_answers_as_the_owner_does():
    rng = random.Random(11)
    prompts = [[rng.randrange(50) for _ in range(rng.choice((40, 64, 100)))] for _ in range(12)]
    owner, replica = PrefixIndex(max_blocks_per_engine=20), PrefixReplica()
    engines = [f"e{i}" for i in range(6)]
    for step in range(300):
        e = rng.choice(engines)
        scheme = S32 if e == "e5" and step > 150 else S16  # one engine changes its block size midway
        prompt = rng.choice(prompts)
        keys = scheme.block_hashes(prompt)
        kind = rng.random()
        if kind < 0.6:
            ev = BlocksStored(tuple(keys[:rng.randrange(1, len(keys) + 1)]))
        elif kind < 0.95:
            ev = BlocksRemoved(tuple(rng.sample(keys, rng.randrange(1, len(keys) + 1))))
        else:
            ev = AllBlocksCleared()
        owner.apply(e, KVEventsBatch(scheme, (ev,), reset=rng.random() < 0.02))
        if rng.random() < 0.3:  # the replica follows by deltas, sometimes late
            replica.apply_update(owner.updates_since(replica.cursor if replica.epoch else None))
    replica.apply_update(owner.updates_since(replica.cursor))
    for prompt in prompts:
        want = {e: n for e, n in owner.cached_prefix_tokens(prompt, engines).items() if n}
        assert replica.cached_prefix_tokens(prompt, engines) == want
        assert replica.cached_prefix_tokens(prompt, engines[:2]) == {e: n for e, n in want.items() if e in engines[:2]}
    assert replica.engines() == {e: n for e, n in owner.engines().items()}


def test_a_big_update_is_applied_in_slices_with_the_loop_free_in_between():
    owner = PrefixIndex()
    rng = random.Random(2)
    for i in range(40):
        owner.apply(f"e{i}", KVEventsBatch(S16, tuple(BlocksStored((rng.getrandbits(64),) * 1) for _ in range(500))))

    async def fetch(cursor):
        return owner.updates_since(cursor)

    async def go():
        view = PrefixCacheView(fetch, refresh_s=0.0, slice_hashes=1000)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.get_running_loop().create_task(ticker())
        await view.refresh()
        t.cancel()
        return ticks, view.index.engines()

    ticks, engines = asyncio.run(go())
    assert ticks >= 15 and len(engines) == 40 and all(n == 500 for n in engines.values())
