"""Prefix index: vLLM-identical block hashes, events in, longest cached prefix out, caps, replicas."""

from __future__ import annotations

import pytest

from actors.control.prefix_index import PrefixIndex
from actors.prefix_wire import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    HashScheme,
    HashSchemeError,
    IndexCursor,
    KVEventsBatch,
    external_key,
)

S16 = HashScheme(16)


def stored(scheme: HashScheme, tokens: list[int], reset: bool = False) -> KVEventsBatch:
    return KVEventsBatch(scheme, (BlocksStored(tuple(scheme.block_hashes(tokens))),), reset=reset)


# ------------------------------------------------------------------ hashing
@pytest.fixture(scope="module")
def vllm_hashing():
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    hashing = pytest.importorskip("vllm.utils.hashing")
    return kv_cache_utils, hashing


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_block_hashes_equal_vllms_chained_hashes_as_its_events_report_them(vllm_hashing, algo, monkeypatch):
    kv_cache_utils, hashing = vllm_hashing
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = hashing.get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    tokens = [(7 * i + 3) % 50000 for i in range(16 * 5 + 9)]  # 5 full blocks and a partial one
    parent, theirs = None, []
    for b in range(5):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[16 * b:16 * (b + 1)])
        theirs.append(kv_cache_utils.maybe_convert_block_hash(parent))  # what BlockStored carries
    assert HashScheme(16, algo).block_hashes(tokens) == theirs


def test_a_pythonhashseed_changes_the_first_parent_like_vllms(vllm_hashing, monkeypatch):
    kv_cache_utils, hashing = vllm_hashing
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    kv_cache_utils.init_none_hash(hashing.sha256)
    try:
        theirs = kv_cache_utils.maybe_convert_block_hash(kv_cache_utils.hash_block_tokens(hashing.sha256, None,
                                                                                          list(range(16))))
    finally:
        monkeypatch.delenv("PYTHONHASHSEED")
        kv_cache_utils.init_none_hash(hashing.sha256)
    assert HashScheme(16, seed="1234").block_hashes(list(range(16))) == [theirs]


def test_bytes_and_int_event_hashes_give_the_same_key():
    digest = bytes(range(32))
    assert external_key(digest) == external_key(int.from_bytes(digest, "big"))


def test_an_unreproducible_algorithm_is_refused_by_name():
    with pytest.raises(HashSchemeError, match="xxhash"):
        HashScheme(16, "xxhash")


# -------------------------------------------------------------------- index
def test_longest_cached_prefix_per_engine_stops_at_the_first_missing_block():
    index = PrefixIndex()
    system = list(range(100, 164))  # 4 blocks
    index.apply("d0", stored(S16, system + list(range(500, 532))))  # 6 blocks
    index.apply("d1", stored(S16, system[:32]))  # 2 blocks
    prompt = system + list(range(500, 516)) + list(range(900, 940))
    assert index.cached_prefix_tokens(prompt) == {"d0": 80, "d1": 32}


def test_a_fully_cached_prompt_still_leaves_its_last_token_to_compute():
    index = PrefixIndex()
    index.apply("d0", stored(S16, list(range(32))))
    assert index.cached_prefix_tokens(list(range(32))) == {"d0": 31}


def test_removed_blocks_break_the_prefix_and_cleared_engines_hold_nothing():
    index = PrefixIndex()
    tokens = list(range(64))
    keys = S16.block_hashes(tokens)
    index.apply("d0", stored(S16, tokens))
    index.apply("d0", KVEventsBatch(S16, (BlocksRemoved((keys[1],)),)))
    assert index.cached_prefix_tokens(tokens + [1]) == {"d0": 16}
    index.apply("d0", KVEventsBatch(S16, (AllBlocksCleared(),)))
    assert index.cached_prefix_tokens(tokens + [1]) == {}


def test_engines_with_other_block_sizes_are_matched_with_their_own_hashes():
    index = PrefixIndex()
    s32 = HashScheme(32)
    tokens = list(range(96))
    index.apply("p0", stored(S16, tokens))
    index.apply("d0", stored(s32, tokens[:64]))
    assert index.cached_prefix_tokens(tokens + [0]) == {"p0": 96, "d0": 64}


def test_dropping_an_engine_removes_its_entries_only():
    index = PrefixIndex()
    index.apply("d0", stored(S16, list(range(32))))
    index.apply("d1", stored(S16, list(range(32))))
    index.drop_engine("d0")
    assert index.engines() == {"d1": 2}


def test_a_reset_batch_forgets_what_the_engine_had_before_its_events():
    index = PrefixIndex()
    index.apply("d0", stored(S16, list(range(64))))
    index.apply("d0", stored(S16, list(range(1000, 1016)), reset=True))
    assert index.engines() == {"d0": 1}


def test_the_per_engine_cap_evicts_oldest_blocks_first():
    index = PrefixIndex(max_blocks_per_engine=4)
    old, new = list(range(48)), list(range(2000, 2048))
    index.apply("d0", stored(S16, old))
    index.apply("d0", stored(S16, new))
    assert index.engines() == {"d0": 4}
    assert index.evicted == 2
    assert index.cached_prefix_tokens(new + [0]) == {"d0": 48}


# ----------------------------------------------------------------- replicas
def replicate(owner: PrefixIndex, replica: PrefixIndex) -> bool:
    update = owner.updates_since(replica.cursor if replica.seq else None)
    replica.apply_update(update)
    return update.full


def test_a_replica_follows_the_owner_with_deltas_including_evictions():
    owner, replica = PrefixIndex(max_blocks_per_engine=3), PrefixIndex(max_blocks_per_engine=None)
    owner.apply("d0", stored(S16, list(range(32))))
    assert replicate(owner, replica) is True  # first contact: a snapshot
    owner.apply("d0", stored(S16, list(range(500, 532))))  # evicts the oldest block
    owner.apply("d1", stored(S16, list(range(16))))
    owner.drop_engine("d1")
    assert replicate(owner, replica) is False
    probe = list(range(500, 532)) + [0]
    assert replica.engines() == owner.engines() == {"d0": 3}
    assert replica.cached_prefix_tokens(probe) == owner.cached_prefix_tokens(probe) == {"d0": 32}


def test_a_replica_behind_the_log_or_from_another_owner_gets_a_snapshot():
    owner = PrefixIndex(max_log_hashes=4)
    replica = PrefixIndex(max_blocks_per_engine=None)
    owner.apply("d0", stored(S16, list(range(16))))
    replicate(owner, replica)
    owner.apply("d0", stored(S16, list(range(3000, 3096))))  # 6 hashes: the log no longer reaches back
    assert replicate(owner, replica) is True
    assert replica.engines() == owner.engines()
    restarted = PrefixIndex()
    update = restarted.updates_since(replica.cursor)
    assert update.full and update.ops == ()
    replica.apply_update(update)
    assert replica.engines() == {}


def test_an_up_to_date_replica_gets_no_ops():
    owner = PrefixIndex()
    owner.apply("d0", stored(S16, list(range(16))))
    update = owner.updates_since(IndexCursor(owner.epoch, owner.seq))
    assert (update.full, update.ops) == (False, ())
