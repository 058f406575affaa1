"""The prefix index's memory per engine, measured with tracemalloc on the real classes: the owner's
(`PrefixIndex` in the coordinator, with its replication log) and a router's `PrefixReplica`, filled the
way the benchmark's engines fill them (their resident blocks, none shared: the replica's worst case)."""

from __future__ import annotations

import pickle
import random
import tracemalloc

from actors.control.prefix_index import PrefixIndex
from actors.prefix_wire import BlocksStored, KVEventsBatch
from serving.routing.prefix_replica import PrefixReplica
from cpbench.fleet import NEW_BLOCKS, RESIDENT, SCHEME


def index_memory(engines: int, blocks_per_engine: int = RESIDENT * NEW_BLOCKS, seed: int = 0) -> dict[str, float]:
    """Bytes per engine and per block of an owner index (with its log) and of a router's replica.

    Events are made inside the traced region (the coordinator keeps the unpickled hashes), and the
    replica is fed a pickled snapshot (what a router receives over Ray)."""
    rng = random.Random(seed)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    owner = PrefixIndex()
    for i in range(engines):
        batch = KVEventsBatch(SCHEME, tuple(BlocksStored(tuple(rng.getrandbits(64) for _ in range(NEW_BLOCKS)))
                                            for _ in range(blocks_per_engine // NEW_BLOCKS)))
        owner.apply(f"e{i}", batch)
        del batch
    owner_bytes = tracemalloc.get_traced_memory()[0] - base
    wire = pickle.dumps(owner.updates_since(None))
    base = tracemalloc.get_traced_memory()[0]
    replica = PrefixReplica()
    update = pickle.loads(wire)
    replica.apply_update(update)
    del update
    replica_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    blocks = engines * blocks_per_engine
    return {"engines": engines, "blocks_per_engine": blocks_per_engine, "snapshot_wire_bytes": len(wire),
            "owner_bytes_per_engine": owner_bytes / engines, "owner_bytes_per_block": owner_bytes / blocks,
            "replica_bytes_per_engine": replica_bytes / engines, "replica_bytes_per_block": replica_bytes / blocks}
