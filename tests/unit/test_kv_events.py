"""KV events relay: vLLM's own publisher and message format in, typed ordered batches out (no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from actors.engine.vllm.kv_events import TOPIC, KVEventsRelay, endpoint_in
from actors.control.prefix_index import PrefixIndex
from actors.prefix_wire import AllBlocksCleared, BlocksRemoved, BlocksStored, HashScheme

kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")

SCHEME = HashScheme(16)
TOKENS = list(range(200, 264))  # 4 blocks
KEYS = SCHEME.block_hashes(TOKENS)


def vllm_stored(keys: list[int], tokens: list[int], parent: int | None = None, **kw) -> object:
    return kv_events.BlockStored(block_hashes=keys, parent_block_hash=parent, token_ids=tokens, block_size=16,
                                 lora_id=None, medium="GPU", lora_name=None, **kw)


def frames(seq: int, *events: object) -> list[bytes]:
    payload = msgspec.msgpack.encode(kv_events.KVEventBatch(ts=0.0, events=list(events)))
    return [TOPIC.encode(), seq.to_bytes(8, "big"), payload]


class Sink:
    def __init__(self, fail: int = 0):
        self.batches, self.fail = [], fail
        self.arrived = asyncio.Event()

    async def __call__(self, batch):
        if self.fail:
            self.fail -= 1
            raise ConnectionError("coordinator restarting")
        self.batches.append(batch)
        self.arrived.set()


def relay(sink=None) -> KVEventsRelay:
    return KVEventsRelay("d0", "ipc:///unused", SCHEME, sink or Sink())  # fed by ingest(), not started


def test_events_become_typed_batches_in_the_engines_order():
    r = relay()
    r.ingest(frames(0, vllm_stored(KEYS[:2], TOKENS[:32])))
    r.ingest(frames(1, vllm_stored(KEYS[2:], TOKENS[32:], parent=KEYS[1]),
                    kv_events.BlockRemoved(block_hashes=[KEYS[0]], medium="GPU"), kv_events.AllBlocksCleared()))
    batch = r.take()  # consecutive stores travel as one run, in the engine's order
    assert batch.events == (BlocksStored(tuple(KEYS[:2]) + tuple(KEYS[2:])), BlocksRemoved((KEYS[0],)),
                            AllBlocksCleared())
    assert (batch.reset, batch.num_engine_events, r.take()) == (False, 4, None)


def test_blocks_a_router_cannot_key_are_skipped():
    r = relay()
    r.ingest(frames(0, vllm_stored(KEYS[:1], TOKENS[:16], extra_keys=[("salt",)]),
                    kv_events.BlockStored(block_hashes=KEYS[:1], parent_block_hash=None, token_ids=TOKENS[:16],
                                          block_size=16, lora_id=1, medium="GPU", lora_name="a")))
    assert r.take() is None
    assert r.stats.skipped == 2


def test_a_sequence_gap_makes_the_next_batch_a_reset():
    r = relay()
    r.ingest(frames(0, vllm_stored(KEYS[:1], TOKENS[:16])))
    r.ingest(frames(5, vllm_stored(KEYS[1:2], TOKENS[16:32], parent=KEYS[0])))  # 1..4 were dropped
    batch = r.take()
    assert (batch.reset, batch.events, r.stats.gaps) == (True, (BlocksStored((KEYS[1],)),), 1)


def test_a_hash_mismatch_stops_relaying_and_resets_the_engine():
    r = KVEventsRelay("d0", "ipc:///unused", HashScheme(16, seed="not-the-engines"), Sink())
    r.ingest(frames(0, vllm_stored(KEYS[:1], TOKENS[:16])))
    r.ingest(frames(1, vllm_stored(KEYS[:1], TOKENS[:16])))
    batch = r.take()
    assert (batch.reset, batch.events) == (True, ())
    assert "mismatch" in r.stats.hash_mismatch


def test_relay_over_vllms_zmq_publisher_feeds_an_index(tmp_path):
    async def go():
        sink = Sink(fail=1)
        endpoint = endpoint_in(str(tmp_path))
        r = KVEventsRelay("d0", endpoint, SCHEME, sink)
        r.start()
        pub = kv_events.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic=TOPIC, buffer_steps=1)
        index = PrefixIndex()
        try:
            while not sink.batches:  # the subscription takes a moment to reach the publisher
                pub.publish(kv_events.KVEventBatch(ts=0.0, events=[kv_events.AllBlocksCleared()]))
                await asyncio.sleep(0.05)
            assert sink.batches[0].reset  # the first delivery failed: the owner starts over
            sink.arrived.clear()
            pub.publish(kv_events.KVEventBatch(ts=0.0, events=[vllm_stored(KEYS, TOKENS)]))
            await asyncio.wait_for(sink.arrived.wait(), 10)
            for batch in sink.batches:
                index.apply("d0", batch)
        finally:
            pub.shutdown()
            await r.stop()
        return index.cached_prefix_tokens(TOKENS + [1]), r.stats

    cached, stats = asyncio.run(go())
    assert cached == {"d0": 64}
    assert (stats.delivery_failures, stats.hash_checks, stats.hash_mismatch) == (1, 1, None)
