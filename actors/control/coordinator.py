"""The coordinator: one named Ray actor per cluster that engines register with.

It owns the directory (registered engine incarnations, their judged pairs, the route table routers poll), the
transfer ledger and its pair breakers, liveness (deaths are events of pending `watch()` calls, hangs are found
by probes) and the prefix index. Invariants: every registration is a new incarnation (`generation`); an evicted
incarnation's pairs, handoffs and peers' agents go with it and the engine registers again; nothing here is on a
request's path to its first token (a router awaits only `admit_probe`, for a half-open pair). The life cycle of
an engine incarnation as it sees it: `Coordinator`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import ray

from actors.actor_restart import reconstructed
from actors.kv.aggregator import KVConnectorOutput
from actors.control.handoff_desk import HandoffDesk
from actors.control.breaker_config import BreakerConfig
from actors.control.ledger import LedgerSnapshot, TransferLedger, Verdict
from actors.control.fence import DeadIncarnations
from actors.control.liveness import Liveness
from actors.control.startup_watch import StartupDeadline, StartupWatch
from actors.control.route_book import RouteBook
from actors.control.ledger_records import ControlStats, EngineKills, LedgerBatch
from actors.protocol.registration import EngineInfo, EngineSummary
from actors.ray_names import COORDINATOR_NAME, NAMESPACE
from actors.routes import EngineRates, RouteDelta, RouteTable
from actors.prefix_wire import IndexCursor, IndexUpdate, KVEventsBatch
from actors.control.prefix_index import PrefixIndex
from actors.control.registry import ROLES, EngineEntry, Registration, RegistrationError, decode_registration

logger = logging.getLogger("raypd.coordinator")


class Coordinator:
    """Life cycle of an engine incarnation as the coordinator sees it:

      register_engine     every rank's handshake payload is decoded and checked (protocol, compat hash,
                          sizes); the engine is refused if its model id is known under another compatibility
                          hash; every (prefill, decode) pair it forms is judged once and the verdict (ok or
                          the reason) is kept for the routers. Each registration is a new incarnation;
      watch               one pending `watch()` call per liveness handle (the engine actor, its rank actors)
                          that only ends when that actor dies: death is an event, not found by pinging.
                          Hangs are found by probing (`actors.control.liveness`): a sweep every
                          `hang_check_s`, and at once when a router reports a missed deadline
                          (`engine_hung`); a hung incarnation is evicted and killed for restart (`kills`);
      evict               a dead or hung incarnation is removed: its pairs' breakers open, its handoffs end (the
                          prefill side is told to let go), every decode engine drops its NIXL agents, and the
                          engine's `watch_registration` call returns so it re-registers once it can (a restarted
                          engine always meets a fresh handshake);
      start-up deadline   an evicted engine (not draining) must register again within its start-up deadline (fixed,
                          or a multiple of the measured start); a restart that hangs before it registers is killed
                          for restart again past it, counted (`startup_timeouts`) and awaited anew; unregistering or
                          a dead-for-good actor ends it; a restarted coordinator awaits the engine actors that do
                          not register again (`startup_watch`);
      handshake_payloads  decode ranks fetch exactly the payloads they need;
      routes              routers fetch live decode engines -> usable prefill engines with every pair's
                          breaker (the ledger's); the table is built once per change (`RouteBook`) and
                          `routes_if_changed` answers a router whose copy is current with nothing.

    Ledger traffic from decode engines arrives as `report_batch(LedgerBatch)`: the records an engine coalesced
    since its last batch, applied in its order, one batch in flight per engine (`actors.engine.ledger_reporter`).
    The single-record methods (`open_handoff`, `report_outcomes`...) remain for tools and tests; engines and
    routers send all of these fire-and-forget. An incarnation Ray declared dead is refused (`fence`).

    Routing state it owns besides the directory: `kv_events` (a registered engine's relayed KV cache events feed
    the prefix index; routers replicate it with `prefix_index_updates`) and `set_draining` (routers stop
    choosing the engine; the autoscaler stops it once idle). If the coordinator itself restarts, engines see
    their `watch_registration` call fail and register again.
    """

    def __init__(self, hang_check_s: float = 10.0, ping_timeout_s: float = 10.0,
                 handoff_deadline_s: float = 60.0, breaker: dict | BreakerConfig | None = None,
                 probe_failure_threshold: int = 2, startup_deadline_s: float | None = None,
                 startup: StartupDeadline | None = None):
        self.ledger = TransferLedger(BreakerConfig.model_validate(breaker or {}), deadline_s=handoff_deadline_s)
        self.liveness = Liveness(self._evict, timeout_s=ping_timeout_s, interval_s=hang_check_s,
                                 failure_threshold=probe_failure_threshold)
        self._engines: dict[str, EngineEntry] = {}
        self.startups = StartupWatch(startup_deadline_s, on_event=self._event, policy=startup, registered=self._engines)
        self._model_hash: dict[str, str] = {}
        self.dead = DeadIncarnations()  # fenced: never registered again (actors/control/fence.py)
        self.book = RouteBook(self.ledger)  # the pairs and the routers' table
        self._generation = 0
        self._timers: list[asyncio.Task] = []
        self.desk = HandoffDesk(self.ledger, self._release_prefill, self._event)  # decode engines' records
        self.counters = dict.fromkeys(("kv_calls", "kv_events", "kv_blocks", "route_calls", "route_unchanged"), 0)
        self.events: list[dict[str, Any]] = []
        self.prefix_index = PrefixIndex()
        self._started_at = time.monotonic()
        self._restarted = reconstructed()  # a restarted coordinator starts empty: engines register again in ~1 s
        self.settle_s = 10.0

    async def configure(self, breaker: dict | None = None, handoff_deadline_s: float | None = None,
                        probe_interval_s: float | None = None, probe_timeout_s: float | None = None,
                        probe_failure_threshold: int | None = None, startup_deadline_s: float | None = None,
                        startup: StartupDeadline | None = None) -> None:
        """Cluster-wide settings of the ledger, the liveness probes and the start-up deadline (the
        last deployment launched sets them; pairs whose breaker already exists keep theirs)."""
        if breaker is not None:
            self.ledger.breaker_config = BreakerConfig.model_validate(breaker)
        if handoff_deadline_s is not None:
            self.ledger.deadline_s = handoff_deadline_s
        if probe_interval_s is not None:
            self.liveness.interval_s = probe_interval_s
        if probe_timeout_s is not None:
            self.liveness.timeout_s = probe_timeout_s
        if probe_failure_threshold is not None:
            self.liveness.failure_threshold = probe_failure_threshold
        if startup is not None:
            self.startups.policy = startup
        if startup_deadline_s is not None:
            self.startups.deadline_s = startup_deadline_s

    # ---------------------------------------------------------- registration
    async def register_engine(self, engine_id: str, role: str, handshakes: list[bytes],
                              handles: list[Any] | None = None, info: EngineInfo | None = None) -> Registration:
        """Register an engine incarnation (a re-registration replaces the previous one)."""
        self._ensure_timers()
        if role not in ROLES:
            raise RegistrationError(f"role must be one of {ROLES}, got {role!r}")
        ranks, raw = decode_registration(engine_id, role, handshakes)
        head = ranks[min(ranks)]
        model, chash = head.compat.model_id, head.compat.compat_hash()
        known = self._model_hash.get(model)
        if known is not None and known != chash and any(
            e.head.compat.model_id == model for e in self._engines.values() if e.engine_id != engine_id
        ):
            raise RegistrationError(
                f"engine {engine_id!r}: model {model!r} is already served with compatibility hash "
                f"{known}, this engine has {chash} (different dtype, layout or shapes)"
            )
        self.dead.check(engine_id, info)  # refuses an incarnation Ray declared dead (a healed host's process)
        old = self._engines.get(engine_id)
        if old is not None and old.raw == raw and old.role == role:  # the same incarnation again (a retried call)
            return Registration(old.generation, self.book.summary(engine_id))
        if old is not None:  # new agents under a known id: the previous incarnation is gone
            await self._remove(engine_id, "replaced by a new incarnation", died=True)
        self._generation += 1
        entry = EngineEntry(engine_id, role, ranks, raw, list(handles or []), info or EngineInfo(), self._generation)
        self._engines[engine_id] = entry
        self.startups.registered(engine_id, entry.info.start_s)  # back: no start-up deadline pending
        self._model_hash[model] = chash
        entry.watchers = [asyncio.get_running_loop().create_task(self._watch(entry, h)) for h in entry.handles]
        pairs = self.book.add(entry, self._engines)
        self._event("registered", engine_id, role=role, generation=entry.generation)
        return Registration(entry.generation, pairs)

    async def unregister_engine(self, engine_id: str, reason: str = "unregistered",
                                generation: int | None = None) -> bool:
        """An engine leaves on purpose (shutdown): its breakers go; it is neither awaited back nor missing."""
        self.startups.drop(engine_id, reason)  # e.g. a restart shut down before it registered
        self.book.left(engine_id)
        entry = self._engines.get(engine_id)
        if entry is None or (generation is not None and entry.generation != generation):
            return False
        await self._remove(engine_id, reason, died=False)
        return True

    async def watch_registration(self, engine_id: str, generation: int) -> str:
        """Returns (the reason) once this incarnation's registration is gone: evicted or
        replaced. Engines keep one such call pending; it fails if the coordinator dies."""
        entry = self._engines.get(engine_id)
        if entry is None or entry.generation != generation:
            return "not registered"
        await entry.evicted.wait()
        return entry.eviction_reason

    async def _remove(self, engine_id: str, reason: str, died: bool) -> None:
        entry = self._engines.pop(engine_id)
        pairs = self.book.drop(engine_id, entry.role if died and not entry.draining else None)  # draining: leaving
        self.prefix_index.drop_engine(engine_id)
        gone = self.ledger.engine_died(engine_id, reason, pairs) if died else self.ledger.engine_left(engine_id)
        for handoff in gone:
            self._release_prefill(handoff.prefill_id, handoff.req_id)
        entry.eviction_reason = reason
        entry.evicted.set()
        if died and entry.handles and not entry.draining:  # Ray restarts it: await its registration
            self.startups.expect(engine_id, entry.handles[0], reason)
        for task in entry.watchers:
            if task is not asyncio.current_task():
                task.cancel()
        self._event("removed", engine_id, reason=reason, generation=entry.generation)
        # every decode engine drops this incarnation's agents (fire and forget: a dead one will not answer)
        for other in self._engines.values():
            if other.serves_decode:
                for handle in other.handles:
                    try:
                        handle.drop_engine.remote(engine_id)
                    except Exception as exc:  # noqa: BLE001 - a dead handle is not our failure
                        logger.info("telling %s to drop %s: %s", other.engine_id, engine_id, exc)

    async def _watch(self, entry: EngineEntry, handle: Any) -> None:
        """Ends when the actor behind `handle` dies (its pending `watch()` call fails)."""
        try:
            await handle.watch.options(max_task_retries=0).remote()  # fail on death, never wait for a restart
            reason = "its actor stopped watching"
        except asyncio.CancelledError:
            return
        except ray.exceptions.RayError as exc:
            reason = f"actor died ({type(exc).__name__})"
            self.dead.watch_failed(entry.engine_id, entry.info, handle, exc)
        if self._engines.get(entry.engine_id) is entry:
            logger.warning("engine %s (generation %d) is dead: %s", entry.engine_id, entry.generation, reason)
            await self._remove(entry.engine_id, reason, died=True)

    # --------------------------------------------------------------- queries
    async def handshake_payloads(self, engine_id: str, pp_rank: int, tp_ranks: list[int]) -> list[bytes]:
        """The payloads of exactly these ranks of one pp stage of an engine."""
        entry = self._engines.get(engine_id)
        if entry is None:
            raise RegistrationError(f"engine {engine_id!r} is not registered")
        try:
            return [entry.raw[(pp_rank, r)] for r in tp_ranks]
        except KeyError as exc:
            raise RegistrationError(f"engine {engine_id!r} has no rank {exc.args[0]}") from None

    async def pair_verdict(self, prefill_id: str, decode_id: str) -> str | None:
        """None when the pair may be routed, else the reason it may not."""
        if prefill_id not in self._engines or decode_id not in self._engines:
            return "engine not registered"
        return self.book.problems.get((prefill_id, decode_id), "pair never judged")

    def _settling(self) -> bool:
        return self._restarted and time.monotonic() - self._started_at < self.settle_s

    async def routes(self) -> RouteTable:
        """Every live decode engine -> its usable prefill engines, and every pair's breaker."""
        self.counters["route_calls"] += 1
        return self.book.table(self._engines, self._settling(), self.liveness.hangs)

    async def routes_if_changed(self, epoch: str | None, version: int) -> RouteTable | RouteDelta | None:
        """The routers' poll: None while their copy (`epoch`, `version`) is current, the breaker moves
        since it (`RouteDelta`), or the whole table."""
        self.counters["route_calls"] += 1
        table = self.book.since(epoch, version, self._engines, self._settling(), self.liveness.hangs)
        if table is None:
            self.counters["route_unchanged"] += 1
        return table

    async def admit_probe(self, decode_id: str, prefill_id: str) -> bool:
        """A half-open pair's probe is admitted once, cluster-wide."""
        return self.ledger.admit_probe(decode_id, prefill_id)

    async def report_rates(self, engine_id: str, generation: int | None, rates: EngineRates) -> bool:
        """An engine's own rates and queues (`actors.engine.rates_publisher`), for every router's table."""
        self.liveness.heard(engine_id)
        return self.book.report_rates(engine_id, generation, rates, self._engines)

    # ------------------------------------------------------- prefix index
    async def kv_events(self, engine_id: str, batch: KVEventsBatch) -> bool:
        """A registered engine's KV cache events (in its order); False: not registered, ignored."""
        if engine_id not in self._engines:
            return False
        self.liveness.heard(engine_id)
        self.prefix_index.apply(engine_id, batch)
        c = self.counters
        c["kv_calls"] += 1
        c["kv_events"] += batch.num_engine_events
        c["kv_blocks"] += sum(len(getattr(ev, "hashes", ())) for ev in batch.events)
        return True

    async def prefix_index_updates(self, cursor: IndexCursor | None) -> IndexUpdate:
        """What a router's replica of the prefix index lacks since `cursor`."""
        return self.prefix_index.updates_since(cursor)

    # ------------------------------------------------------------- draining
    async def handoffs_in_flight(self, engine_id: str) -> int:
        """KV handoffs from or to the engine that have no verdict yet."""
        return self.ledger.in_flight_of(engine_id)

    async def set_draining(self, engine_id: str, draining: bool = True) -> bool:
        """Routers stop choosing a draining engine (`routes()` leaves it out)."""
        entry = self._engines.get(engine_id)
        if entry is None:
            return False
        entry.draining = draining
        self.book.changed()
        self._event("draining" if draining else "undrained", engine_id)
        return True

    # ---------------------------------------------------------------- ledger
    async def report_batch(self, batch: LedgerBatch) -> int:
        """A decode engine's coalesced ledger records, applied in its order; returns how many."""
        self._ensure_timers()
        self.liveness.heard(batch.decode_id)
        return self.desk.apply(batch)

    async def open_handoff(self, req_id: str, prefill_id: str, decode_id: str) -> None:
        self._ensure_timers()
        self.desk.open(req_id, prefill_id, decode_id)

    async def report_outcomes(self, decode_id: str, outputs: list[KVConnectorOutput | None]) -> list[Verdict]:
        """Per-unit transfer outcomes of a decode engine -> verdicts (they feed the breakers)."""
        self.liveness.heard(decode_id)
        return self.desk.report(decode_id, outputs)

    async def unit_died(self, decode_id: str, collected: list[KVConnectorOutput | None]) -> list[Verdict]:
        """A decode unit died mid-step: what the step collected is salvaged and replayed (the
        verdicts say `source="salvage"`). Synthetic engines only: a vLLM engine reports one merged
        outcome per request, and a dead worker takes its engine core down (docs/failure-semantics.md)."""
        return self.desk.unit_died(decode_id, collected)

    async def handshake_failed(self, decode_id: str, prefill_id: str, reason: str,
                               req_id: str | None = None) -> None:
        self.desk.handshake_failed(decode_id, prefill_id, reason, req_id)

    async def prefill_failed(self, decode_id: str, prefill_id: str, reason: str) -> None:
        """A router's prefill call failed because of the engine (client errors never come here)."""
        self.ledger.prefill_failed(decode_id, prefill_id, reason)

    async def engine_hung(self, engine_id: str, generation: int | None, reason: str) -> str | None:
        """A router saw this incarnation miss a deadline (fire and forget). The coordinator decides:
        it probes the engine at once and, when the probe times out too, evicts and kills it
        (`actors.control.liveness`). Returns the verdict (None: it answered)."""
        entry = self._engines.get(engine_id)
        if entry is None or not entry.handles or (generation is not None and entry.generation != generation):
            return None  # already gone or replaced
        self._event("hang_reported", engine_id, generation=entry.generation, reason=reason)
        return await self.liveness.judge(entry, lambda: self._engines.get(engine_id) is entry, reason)

    async def _evict(self, entry: EngineEntry, reason: str) -> None:
        if self._engines.get(entry.engine_id) is entry:
            await self._remove(entry.engine_id, reason, died=True)

    async def transfers(self) -> LedgerSnapshot:
        """In-flight handoffs, verdict counts and breaker states (for status/metrics)."""
        return self.ledger.snapshot()

    def _release_prefill(self, prefill_id: str | None, req_id: str) -> None:
        """Ask a prefill engine to let go of a request's blocks (best effort)."""
        entry = self._engines.get(prefill_id) if prefill_id else None
        if entry is not None and entry.handles:
            try:
                entry.handles[0].abort.remote(req_id)
            except Exception as exc:  # noqa: BLE001 - its lease expires anyway
                logger.info("releasing %s on %s: %s", req_id, prefill_id, exc)

    async def engines(self) -> list[EngineSummary]:
        return [e.summary() for e in self._engines.values()]

    async def control_stats(self) -> ControlStats:
        """What this incarnation absorbed so far (ledger batches, KV events, route polls)."""
        c = self.counters
        return ControlStats(len(self._engines), len(self.book.problems), len(self.ledger.in_flight()),
                            dict(self.ledger.verdicts), self.desk.batches, self.desk.records, c["kv_calls"],
                            c["kv_events"], c["kv_blocks"], sum(self.prefix_index.engines().values()),
                            self.book.builds, c["route_calls"], c["route_unchanged"],
                            dict(self.startups.timeouts), self.startups.pending(),
                            self.liveness.probe_failures, self.liveness.busy_timeouts, self.startups.deadline_s,
                            self.startups.measured_s)

    async def kills(self) -> EngineKills:
        """Engines this incarnation killed so far, by reason (cheap: the suite's false-kill guard reads it)."""
        return EngineKills(dict(self.liveness.hangs), dict(self.startups.timeouts))

    async def recent_events(self, limit: int = 100) -> list[dict]:
        return self.events[-limit:]

    async def ping(self) -> str:
        return "pong"

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def pid(self) -> int:
        return os.getpid()

    # ---------------------------------------------------------------- timers
    def _ensure_timers(self) -> None:
        if not self._timers or any(t.done() for t in self._timers):
            for t in self._timers:
                t.cancel()
            loop = asyncio.get_running_loop()
            self._timers = [loop.create_task(self.desk.run_expiry()), loop.create_task(self._hang_sweeps())]

    async def _hang_sweeps(self) -> None:
        while True:  # hangs of registered incarnations, then restarts past their start-up deadline
            await asyncio.sleep(self.liveness.interval_s)
            for check in (self.check_engines, self.startups.sweep):
                try:
                    await check()
                except Exception:  # noqa: BLE001 - the sweep must survive anything
                    logger.exception("engine check %s failed", check.__name__)

    async def check_engines(self) -> list[str]:
        """Probe every engine once (watchers see deaths, this catches hangs): one silent for `ping_timeout_s` at
        `probe_failure_threshold` sweeps in a row is evicted and killed for a restart. Returns the ids found."""
        entries = [e for e in self._engines.values() if e.handles]
        return await self.liveness.sweep(entries, lambda e: self._engines.get(e.engine_id) is e)

    def _event(self, kind: str, engine_id: str, **fields: Any) -> None:
        self.events.append({"t": time.time(), "event": kind, "engine_id": engine_id, **fields})
        del self.events[:-1000]
