"""Relays a vLLM engine's KV cache events to the prefix index owner (the coordinator) over Ray.

vLLM's engine core publishes `KVEventBatch`es on a per-engine ipc endpoint; the engine actor's
relay (an asyncio zmq SUB socket: no thread, no polling) decodes them with vLLM's own types,
coalesces what arrives while a call is in flight, and sends one call at a time. Invariants: the
owner applies an engine's events in its order; after a gap or a failed delivery the next batch is
a `reset` (the owner rebuilds the engine's entries, never claiming blocks that may be gone); a
hash scheme routers cannot match (checked on each stored prompt's first block) stops the relay and
`stats()` says why. The life cycle of one engine's event stream: `KVEventsRelay`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from actors.prefix_wire import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    HashScheme,
    HashSchemeError,
    KVEvent,
    KVEventsBatch,
    coalesce,
    external_key,
)
from actors.protocol.stats import KVEventsStats

logger = logging.getLogger("raypd.kv_events")

TOPIC = "raypd-kv"
# Routers refresh their index copy every 0.1 s (`index_refresh_s`): events 0.1 s later cost nothing, and
# at 256 engines the coordinator takes 2,560 calls/s instead of one per engine step.
MIN_INTERVAL_S = 0.1
MEDIA = (None, "GPU")  # the engine's own KV pool (vLLM labels it GPU on every platform)


def endpoint_in(folder: str) -> str:
    """The ipc endpoint of one engine's events (a socket file in its private folder)."""
    return f"ipc://{folder.rstrip('/')}/kv-events"


def vllm_kv_events_config(endpoint: str) -> Any:
    """vLLM's KVEventsConfig publishing on `endpoint` (no replay buffer: we never replay)."""
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=TOPIC,
                          buffer_steps=1)


@dataclass(frozen=True)
class KVEventsSource:
    """Where a backend's engine publishes its KV events, and how it hashes blocks."""

    endpoint: str
    scheme: HashScheme


def relay_for(backend: Any, engine_id: str, sink: Callable[[KVEventsBatch], Awaitable[Any]]
              ) -> "KVEventsRelay | None":
    """A started relay for a backend that publishes KV events (vLLM with prefix caching), else None."""
    source_of = getattr(backend, "kv_events_source", None)
    try:
        source = source_of() if source_of is not None else None
    except HashSchemeError as exc:
        logger.warning("%s: no cache-aware routing to this engine: %s", engine_id, exc)
        return None
    if source is None:
        return None
    relay = KVEventsRelay(engine_id, source.endpoint, source.scheme, sink)
    relay.start()
    return relay


class KVEventsRelay:
    """Life cycle of one engine's event stream:

      configured  `vllm_kv_events_config(endpoint)`: vLLM's engine core (a child
                  process of the engine actor) publishes `KVEventBatch`es on a
                  per-engine ipc endpoint (its PUB socket binds);
      subscribed  `KVEventsRelay.start()`: an asyncio zmq SUB socket in the engine
                  actor connects (no thread, no polling: the event loop wakes on data);
      relayed     each message is decoded with vLLM's own msgspec types and turned
                  into typed `KVEventsBatch` events; whatever arrives while a Ray
                  call is in flight is coalesced into the next one (runs of stores
                  or of removals merged, `coalesce`), and calls are at least
                  `min_interval_s` apart; one call at a time, so the owner applies
                  them in the engine's order;
      lost        a sequence gap (the publisher's high-water mark dropped messages)
                  or a delivery that failed (coordinator restarting) makes the next
                  batch a `reset` one: the owner drops the engine's entries and
                  rebuilds them from later events, never claiming blocks that may be gone;
      stopped     `stop()` cancels the tasks and closes the socket.

    The first block of every stored prompt is re-hashed here with the engine's
    `HashScheme`: a mismatch means routers could never match this engine's
    hashes (another algorithm, a hybrid model's hash block size), so relaying
    stops and `stats()` says why.
    """

    def __init__(self, engine_id: str, endpoint: str, scheme: HashScheme,
                 sink: Callable[[KVEventsBatch], Awaitable[Any]], max_pending_events: int = 100_000,
                 min_interval_s: float = MIN_INTERVAL_S):
        self.engine_id, self.endpoint, self.scheme = engine_id, endpoint, scheme
        self.sink = sink
        self.max_pending_events = max_pending_events
        self.min_interval_s = min_interval_s  # one call per engine per this, at most (the owner's load)
        self.stats = KVEventsStats(endpoint, scheme.block_size, scheme.algo)
        self._pending: list[KVEvent] = []
        self._reset = False
        self._last_seq: int | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._socket: Any = None
        self._ctx: Any = None
        self._decoder: Any = None

    # ------------------------------------------------------------ life cycle
    def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.endpoint)
        self._socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._send())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._socket is not None:
            self._socket.close(linger=0)
            self._ctx.term()
            self._socket = self._ctx = None

    # ---------------------------------------------------------------- intake
    async def _read(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                self.ingest(frames)
            except Exception:  # noqa: BLE001 - one bad message must not end the relay
                logger.exception("%s: undecodable KV events message", self.engine_id)
                self._reset = True
            self._wake.set()

    def ingest(self, frames: list[bytes]) -> None:
        """One published message: (topic, 8-byte sequence number, msgpack KVEventBatch)."""
        if len(frames) != 3:
            raise ValueError(f"expected 3 frames, got {len(frames)}")
        seq = int.from_bytes(frames[1], "big")
        if self._last_seq is not None and seq != self._last_seq + 1:
            self._count(gaps=1)
            self._lose()
        self._last_seq = seq
        if self.stats.hash_mismatch is not None:
            return
        for ev in self._decode(frames[2]).events:
            typed = self._convert(ev)
            if typed is not None:
                self._pending.append(typed)
        if len(self._pending) > self.max_pending_events:
            self._count(dropped=len(self._pending))
            self._lose()

    def _decode(self, payload: bytes) -> Any:
        """vLLM's own message type, decoded with vLLM's msgspec schema."""
        if self._decoder is None:
            import msgspec
            from vllm.distributed.kv_events import KVEventBatch

            self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        return self._decoder.decode(payload)

    def _lose(self) -> None:
        self._pending.clear()
        self._reset = True

    def _convert(self, ev: Any) -> KVEvent | None:
        name = type(ev).__name__
        if name == "BlockStored":
            if ev.lora_name is not None or ev.lora_id is not None or ev.medium not in MEDIA or any(ev.extra_keys or ()):
                self._count(skipped=len(ev.block_hashes))
                return None
            if ev.parent_block_hash is None and not self._check_hash(ev):
                return None
            return BlocksStored(tuple(external_key(h) for h in ev.block_hashes))
        if name == "BlockRemoved":
            return BlocksRemoved(tuple(external_key(h) for h in ev.block_hashes)) if ev.medium in MEDIA else None
        if name == "AllBlocksCleared":
            return AllBlocksCleared()
        return None

    def _check_hash(self, ev: Any) -> bool:
        """A prompt's first block, re-hashed with the engine's scheme, must give the engine's hash."""
        self._count(hash_checks=1)
        ours = self.scheme.block_hashes(ev.token_ids[:self.scheme.block_size], max_blocks=1)
        if ev.block_size == self.scheme.block_size and ours and ours[0] == external_key(ev.block_hashes[0]):
            return True
        self.stats = replace(self.stats, hash_mismatch=(
            f"block hash mismatch (engine block_size {ev.block_size}, ours {self.scheme}): the router cannot "
            f"key this engine's prefix cache; cache-aware routing ignores {self.engine_id}"))
        logger.warning("%s: %s", self.engine_id, self.stats.hash_mismatch)
        self._pending.clear()
        self._reset = True  # and nothing after it: the owner drops what it had
        return False

    # ---------------------------------------------------------------- output
    def take(self) -> KVEventsBatch | None:
        if not self._pending and not self._reset:
            return None
        batch = KVEventsBatch(self.scheme, coalesce(self._pending), reset=self._reset,
                              engine_events=len(self._pending))
        self._pending, self._reset = [], False
        return batch

    async def _send(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch = self.take()
            if batch is None:
                continue
            sent_at = time.monotonic()
            try:
                await self.sink(batch)
                self._count(batches=1, events=batch.num_engine_events)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the owner is away: resend from a clean slate
                self._count(delivery_failures=1)
                logger.info("%s: KV events not delivered (%s); the next batch resets", self.engine_id, exc)
                self._reset = True
            await asyncio.sleep(max(0.0, sent_at + self.min_interval_s - time.monotonic()))  # what arrives joins

    def _count(self, **added: int) -> None:
        self.stats = replace(self.stats, **{k: getattr(self.stats, k) + n for k, n in added.items()})

    def snapshot(self) -> KVEventsStats:
        return self.stats
