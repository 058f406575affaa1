"""Index ops as they travel (`actors.prefix_wire.PackedOps`): the same ops after pickling, read one by one or in
order, and the plain tuple where packing would gain nothing or lose a hash."""

import pickle
import random

import pytest

from actors.control.prefix_index import PrefixIndex
from actors.prefix_wire import BlocksRemoved, BlocksStored, HashScheme, IndexOp, KVEventsBatch, PackedOps
from serving.routing.prefix_replica import PrefixReplica

S16 = HashScheme(16)
rng = random.Random(4)
OPS = (IndexOp("e0", "store", tuple(rng.getrandbits(64) for _ in range(5)), S16),
       IndexOp("e1", "remove", (2**64 - 1, 0)),
       IndexOp("e0", "clear"),
       IndexOp("e2", "store", (7,), S16))


def test_packed_ops_pickle_back_to_the_same_ops_in_order_and_by_index():
    packed = pickle.loads(pickle.dumps(PackedOps.of(OPS)))
    assert isinstance(packed, PackedOps) and packed == OPS and tuple(packed) == OPS
    assert [packed[i] for i in range(len(OPS))] == list(OPS) and packed[-1] == OPS[-1]
    with pytest.raises(IndexError):
        packed[len(OPS)]


def test_hashes_that_are_not_64_bit_keys_and_empty_runs_stay_tuples():
    assert PackedOps.of([IndexOp("e0", "store", (2**64,), S16)]) == (IndexOp("e0", "store", (2**64,), S16),)
    assert PackedOps.of([]) == ()


def test_a_replica_fed_packed_updates_over_the_wire_matches_the_owner():
    owner, replica = PrefixIndex(max_blocks_per_engine=40), PrefixReplica()
    prompts = [[rng.randrange(50_000) for _ in range(16 * rng.randrange(1, 6))] for _ in range(10)]
    for step in range(120):
        e, keys = f"e{step % 4}", S16.block_hashes(rng.choice(prompts))
        ev = BlocksStored(tuple(keys)) if rng.random() < 0.7 else BlocksRemoved(tuple(keys[:1]))
        owner.apply(e, KVEventsBatch(S16, (ev,)))
        if step % 7 == 0:
            update = pickle.loads(pickle.dumps(owner.updates_since(replica.cursor if replica.epoch else None)))
            replica.apply_update(update)
    replica.apply_update(pickle.loads(pickle.dumps(owner.updates_since(replica.cursor))))
    engines = [f"e{i}" for i in range(4)]
    for prompt in prompts:
        want = {e: n for e, n in owner.cached_prefix_tokens(prompt, engines).items() if n}
        assert replica.cached_prefix_tokens(prompt, engines) == want
