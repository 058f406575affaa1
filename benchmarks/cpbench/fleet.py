"""Simulated engines for the control-plane benchmark: one Ray actor (`SimFleet`) plays N engines.

What each simulated engine does, the way the real ones do it (with the production code where
it exists):

  register   `register_engine` with a valid one-rank handshake payload of SmolLM2-135M's cache
             shape (30 layers, 3 KV heads, head size 64, float32, block size 16); the fleet
             actor is every engine's liveness handle (the coordinator keeps a `watch()` pending
             on it per engine); one `watch_registration` stays pending per engine, and when it
             fails (the coordinator restarted) the engine registers again, as `EngineActor` does;
  ledger     decode engines: a real `LedgerReporter` each (`actors.engine.ledger_reporter`);
             per handoff one open record and one outcome record of `units` per-rank outputs
             (the synthetic engine's tp=2 shape; vLLM sends one merged unit);
  KV events  every engine: per request one BlocksStored (the prompt's new blocks) and one
             BlocksRemoved per evicted block (vLLM's block pool emits removals one block at a
             time), sent as `KVEventsRelay` sends them: one call in flight, what accumulates
             meanwhile coalesced (runs merged, `coalesce`), at most one call per `interval_s`.

Load is offered open loop at a rate (a 5 ms ticker that stops at its deadline); what the
coordinator applied is read from the coordinator's own counters by the caller.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from dataclasses import dataclass

import ray

from actors.prefix_wire import BlocksRemoved, BlocksStored, HashScheme, KVEventsBatch, coalesce
from actors.engine.ledger_reporter import LedgerReporter
from actors.kv.aggregator import KVConnectorOutput
from actors.kv.handshake import CompatInfo, RankHandshake
from actors.kv.plan.layout import HND, CacheGeometry
from actors.protocol.registration import EngineInfo

BLOCK_SIZE = 16
SCHEME = HashScheme(BLOCK_SIZE)
COMPAT = CompatInfo("smollm2-135m-sim", "float32", 3, 30, 64, "float32", "split")
NEW_BLOCKS = 8  # per request: a 512-token prompt whose 384-token system prefix is already cached
RESIDENT = 64  # requests' blocks an engine's cache holds before evicting (per engine, steady state)
RING = 128


def handshake(engine_id: str, role: str) -> bytes:
    bases = tuple((0x1000_0000 + layer * 0x40_0000, 0x1020_0000 + layer * 0x40_0000) for layer in range(30))
    geo = CacheGeometry(HND, 30, 0, 4096, BLOCK_SIZE, 3, 64, 4, bases)
    return RankHandshake(engine_id, role, 0, 1, 0, 1, 1, BLOCK_SIZE, f"{engine_id}-agent", b"\0sim", geo,
                         COMPAT).encode()


@dataclass
class HandoffLoad:
    offered: int = 0
    batches: int = 0
    records: int = 0
    lost_records: int = 0
    dropped: int = 0
    flushed: bool = True


@dataclass
class KVLoad:
    requests: int = 0
    events: int = 0
    calls: int = 0
    failures: int = 0


class SimFleet:
    def __init__(self, coordinator_name: str, namespace: str, engines: list[tuple[str, str]], seed: int = 0):
        self.coordinator = ray.get_actor(coordinator_name, namespace=namespace)
        self.engines = engines
        self.decodes = [e for e, r in engines if r == "decode"]
        self.prefills = [e for e, r in engines if r == "prefill"]
        self.payloads = {e: [handshake(e, r)] for e, r in engines}
        self.generation: dict[str, int] = {}
        self.closed = False
        self.aborts = 0
        self.reregistered = 0
        self._keepers: list[asyncio.Task] = []
        self._back: asyncio.Task | None = None
        self._seq = itertools.count()
        rng = random.Random(seed)
        self._events: dict[str, tuple[list[BlocksStored], list[list[BlocksRemoved]]]] = {}
        for e, _ in engines:  # a ring of requests per engine: what it stores, what storing it evicts
            blocks = [tuple(rng.getrandbits(64) for _ in range(NEW_BLOCKS)) for _ in range(RING)]
            self._events[e] = ([BlocksStored(b) for b in blocks], [[BlocksRemoved((h,)) for h in b] for b in blocks])
        self._kv_next = dict.fromkeys(self._events, 0)

    # ------------------------------------------------------- registration
    async def register_all(self) -> float:
        """Register every engine (concurrently); seconds it took. Keeps them registered afterwards."""
        me = ray.get_runtime_context().current_actor
        t0 = time.monotonic()
        await asyncio.gather(*(self._register(e, r, me) for e, r in self.engines))
        took = time.monotonic() - t0
        loop = asyncio.get_running_loop()
        self._keepers = [loop.create_task(self._keep(e, r, me)) for e, r in self.engines]
        return took

    async def _register(self, engine_id: str, role: str, me: object) -> None:
        reg = await self.coordinator.register_engine.remote(
            engine_id, role, self.payloads[engine_id], [me], EngineInfo("synthetic", COMPAT.model_id, os.getpid()))
        self.generation[engine_id] = reg.generation

    async def _keep(self, engine_id: str, role: str, me: object) -> None:
        """As EngineActor: one pending watch_registration; register again when it ends or fails."""
        while not self.closed:
            try:
                await self.coordinator.watch_registration.options(max_task_retries=0).remote(
                    engine_id, self.generation[engine_id])
            except ray.exceptions.RayError:
                await self._await_coordinator()
            delay = 0.05
            while not self.closed:
                try:
                    await self._register(engine_id, role, me)
                    self.reregistered += 1
                    break
                except ray.exceptions.RayError:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)

    async def _await_coordinator(self) -> None:
        if self._back is None or self._back.done():
            self._back = asyncio.get_running_loop().create_task(self._ping_until_up())
        await asyncio.shield(self._back)

    async def _ping_until_up(self, deadline_s: float = 120.0) -> None:
        deadline, delay = time.monotonic() + deadline_s, 0.05
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self.coordinator.ping.remote(), 5.0)
                return
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    # ------------------------------------------- liveness handle (coordinator -> engines)
    @ray.method(max_task_retries=0)
    async def watch(self) -> None:
        await asyncio.Event().wait()

    def ping(self) -> str:
        return "pong"

    def abort(self, req_id: str) -> None:
        self.aborts += 1

    def drop_engine(self, engine_id: str) -> None:
        return None

    # ------------------------------------------------------------ ledger load
    async def run_handoffs(self, rate: float, duration_s: float, units: int, max_delay_s: float,
                           fail_rate: float = 0.0) -> HandoffLoad:
        """Offer `rate` handoffs/s across the decode engines for `duration_s`; wait until delivered."""
        reporters = {d: LedgerReporter(d, lambda: self.coordinator, max_delay_s=max_delay_s) for d in self.decodes}
        decodes, prefills = itertools.cycle(self.decodes), itertools.cycle(self.prefills)
        rng = random.Random(1)
        load = HandoffLoad()
        t0 = time.monotonic()
        while (now := time.monotonic()) < t0 + duration_s:
            for _ in range(int(rate * (now - t0)) - load.offered):
                rid = f"h{next(self._seq)}"
                rep = reporters[next(decodes)]
                rep.opened(rid, next(prefills))
                failed = {rid} if fail_rate and rng.random() < fail_rate else set()
                rep.outcomes([KVConnectorOutput(finished_recving={rid}, failed_recving=set(failed),
                                                expected_finished_count=units) for _ in range(units)])
                load.offered += 1
            await asyncio.sleep(0.005)
        load.flushed = all(await asyncio.gather(*(r.flush(60.0) for r in reporters.values())))
        for r in reporters.values():
            s = r.stats
            load.batches, load.records = load.batches + s.batches, load.records + s.records
            load.lost_records, load.dropped = load.lost_records + s.lost_records, load.dropped + s.dropped
        return load

    # -------------------------------------------------------------- KV load
    async def run_kv(self, events_per_engine_s: float, duration_s: float, interval_s: float) -> KVLoad:
        """Every engine publishes `events_per_engine_s` KV events (1 + NEW_BLOCKS per request)."""
        load = KVLoad()
        per_request = 1 + NEW_BLOCKS
        end = time.monotonic() + duration_s
        await asyncio.gather(*(self._relay(e, events_per_engine_s / per_request, end, interval_s, load)
                               for e in self._events))
        return load

    async def _relay(self, engine_id: str, requests_per_s: float, end: float, interval_s: float,
                     load: KVLoad) -> None:
        stored, removed = self._events[engine_id]
        last, carry = time.monotonic() - interval_s * random.random(), 0.0
        while (now := time.monotonic()) < end:
            due = requests_per_s * (now - last) + carry
            carry, last = due - int(due), now
            events: list = []
            j = self._kv_next[engine_id]
            for _ in range(int(due)):
                events.append(stored[j % RING])
                if j >= RESIDENT:
                    events.extend(removed[(j - RESIDENT) % RING])
                j += 1
            load.requests += j - self._kv_next[engine_id]
            self._kv_next[engine_id] = j
            if events:
                try:
                    await self.coordinator.kv_events.remote(
                        engine_id, KVEventsBatch(SCHEME, coalesce(events), engine_events=len(events)))
                    load.calls += 1
                    load.events += len(events)
                except ray.exceptions.RayError:
                    load.failures += 1
            await asyncio.sleep(max(0.0, last + interval_s - time.monotonic()))

    async def publish_prompts(self, prompts: dict[str, list[tuple[int, ...]]]) -> int:
        """Engines report the blocks of these prompts stored (real vLLM hashes): what routers look up."""
        calls = [self.coordinator.kv_events.remote(
            e, KVEventsBatch(SCHEME, tuple(BlocksStored(tuple(SCHEME.block_hashes(p))) for p in ps)))
            for e, ps in prompts.items()]
        return sum(bool(ok) for ok in await asyncio.gather(*calls))

    def registered_generations(self) -> dict[str, int]:
        return dict(self.generation)

    async def stop(self) -> None:
        self.closed = True
        for t in self._keepers:
            t.cancel()
