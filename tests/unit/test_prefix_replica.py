"""A router's inverted replica answers exactly as the owner's index does, after any mix of stores,
removals, clears, caps and scheme changes; a big update leaves the event loop free between slices."""

from __future__ import annotations

import asyncio
import gc
import random

from actors.control.prefix_index import PrefixIndex
from actors.prefix_wire import AllBlocksCleared, BlocksRemoved, BlocksStored, HashScheme, KVEventsBatch
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


# ------------------------------------------------ a router's own placements (claims)
def _replica_with(scheme: HashScheme, engine: str, tokens: list[int]) -> tuple[PrefixIndex, PrefixReplica]:
    owner, replica = PrefixIndex(), PrefixReplica(claim_ttl_s=10.0)
    owner.apply(engine, KVEventsBatch(scheme, (BlocksStored(tuple(scheme.block_hashes(tokens))),)))
    replica.apply_update(owner.updates_since(None))
    return owner, replica


def test_a_placement_counts_at_once_before_the_engines_events():
    convo = list(range(100))
    _, replica = _replica_with(S16, "a", list(range(500, 532)))  # the deployment's scheme is known
    replica.note_held("b", convo, now=0.0)  # routed to b a moment ago: no event yet
    assert replica.cached_prefix_tokens(convo + [7, 7]) == {"b": 96}


def test_an_eviction_event_wins_over_the_claim():
    convo = list(range(64))
    owner, replica = _replica_with(S16, "a", convo)
    replica.note_held("a", convo + list(range(64, 96)), now=0.0)
    owner.apply("a", KVEventsBatch(S16, (BlocksRemoved(tuple(S16.block_hashes(convo)[2:])),)))
    replica.apply_update(owner.updates_since(replica.cursor))
    assert replica.cached_prefix_tokens(convo + list(range(64, 100))) == {"a": 32}


def test_an_engine_cleared_loses_its_claims():
    convo = list(range(64))
    owner, replica = _replica_with(S16, "a", list(range(500, 532)))
    replica.note_held("a", convo, now=0.0)
    owner.apply("a", KVEventsBatch(S16, (AllBlocksCleared(),)))
    replica.apply_update(owner.updates_since(replica.cursor))
    assert replica.cached_prefix_tokens(convo + [1]) == {}


def test_an_unconfirmed_claim_expires_and_a_later_claim_of_the_same_blocks_stands():
    one, two = list(range(48)), list(range(32)) + [9] * 16
    _, replica = _replica_with(S16, "a", list(range(500, 532)))
    replica.note_held("b", one, now=0.0)
    replica.note_held("b", two, now=5.0)  # shares its first two blocks with `one`
    replica.expire_claims(now=10.0)  # `one`'s claim is over, `two`'s stands
    assert (replica.cached_prefix_tokens(one + [1]), replica.cached_prefix_tokens(two + [1])) == (
        {"b": 32}, {"b": 48})
    replica.expire_claims(now=15.0)
    assert replica.cached_prefix_tokens(two + [1]) == {}


def test_a_confirmed_claim_outlives_its_expiry():
    convo = list(range(64))
    owner, replica = _replica_with(S16, "a", list(range(500, 532)))
    replica.note_held("a", convo, now=0.0)
    owner.apply("a", KVEventsBatch(S16, (BlocksStored(tuple(S16.block_hashes(convo))),)))
    replica.apply_update(owner.updates_since(replica.cursor))
    replica.expire_claims(now=60.0)
    assert replica.cached_prefix_tokens(convo + [1]) == {"a": 64}


def test_no_claim_without_a_scheme_to_hash_with():
    replica = PrefixReplica()
    assert (replica.note_held("a", list(range(64)), now=0.0), replica.cached_prefix_tokens(list(range(65)))) == (0, {})


def test_a_decisions_lookup_and_its_two_claims_hash_the_prompt_once(monkeypatch):
    _, replica = _replica_with(S16, "a", list(range(64)))
    prompt = tuple(range(64)) + tuple(range(900, 964))  # a holds its first 4 blocks, nobody the other 4
    calls = []
    real = HashScheme.iter_block_hashes
    monkeypatch.setattr(HashScheme, "iter_block_hashes", lambda self, t: (calls.append(len(t)), real(self, t))[1])
    looked_up = replica.cached_prefix_tokens(prompt)  # stops hashing after a's last block
    claimed = (replica.note_held("b", prompt, now=0.0), replica.note_held("c", prompt, now=0.0))
    again = replica.cached_prefix_tokens(tuple(list(prompt)))  # an equal prompt, another tuple: hashed afresh
    assert (looked_up, claimed, again, calls) == ({"a": 64}, (8, 8), {"a": 64, "b": 127, "c": 127}, [128, 128])


def test_claims_add_no_collector_tracked_object_per_block():
    # the router claims every routed prompt's blocks: one tracked object per block made the cyclic
    # collector run twice as often at 256 engines (benchmarks/control_plane.py's router GC pauses)
    _, replica = _replica_with(S16, "a", list(range(500, 532)))
    prompts = [tuple(range(i * 1000, i * 1000 + 512)) for i in range(50)]  # 32 blocks each
    gc.collect()
    gc.disable()  # a pass would untrack int-only tuples, after they counted toward starting it
    try:
        before = len(gc.get_objects())
        for i, prompt in enumerate(prompts):
            replica.note_held("ab"[i % 2], prompt, now=0.0)  # all within the claim TTL
        added = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert added < 10 * len(prompts)  # per claim, not per block (50 claims x 32 blocks = 1600)


def test_thousands_of_blocks_over_every_shard_answer_as_the_owner_does():
    rng = random.Random(5)
    prompts = [[rng.randrange(49152) for _ in range(16 * rng.randrange(8, 40))] for _ in range(60)]
    owner, replica = PrefixIndex(max_blocks_per_engine=400), PrefixReplica()
    engines = [f"e{i}" for i in range(9)]
    for step in range(600):
        e, prompt = rng.choice(engines), rng.choice(prompts)
        keys = S16.block_hashes(prompt)
        r = rng.random()
        if r < 0.65:
            ev = BlocksStored(tuple(keys))
        elif r < 0.98:
            ev = BlocksRemoved(tuple(rng.sample(keys, rng.randrange(1, len(keys) + 1))))
        else:
            ev = AllBlocksCleared()
        owner.apply(e, KVEventsBatch(S16, (ev,)))
        if step % 7 == 0:
            replica.apply_update(owner.updates_since(replica.cursor if replica.epoch else None))
    replica.apply_update(owner.updates_since(replica.cursor))
    assert sum(owner.engines().values()) > 2000  # blocks in every one of the 64 shards
    for prompt in prompts:
        want = {e: n for e, n in owner.cached_prefix_tokens(prompt, engines).items() if n}
        assert replica.cached_prefix_tokens(prompt, engines) == want
    assert replica.engines() == owner.engines()
