"""The coordinator: one named Ray actor per cluster that engines register with.

Life cycle of an engine incarnation as the coordinator sees it:

  register_engine     every rank's handshake payload is decoded and checked
                      (protocol, compat hash, sizes); the engine is refused if its
                      model id is known under another compatibility hash; every
                      (prefill, decode) pair it forms is judged once and the
                      verdict (ok or the reason) is kept for the routers. Each
                      registration is a new incarnation (`generation`);
  watch               one pending `watch()` call per liveness handle (the engine
                      actor, its rank actors) that only ends when that actor dies:
                      death is an event, not something found by pinging. Hangs are
                      found by probing (`actors.control.liveness`): a sweep every
                      `hang_check_s`, and at once when a router reports a missed
                      deadline (`engine_hung`); a hung incarnation is evicted and
                      killed, so that Ray restarts it;
  evict               a dead or hung incarnation is removed: its pairs' breakers
                      open, its handoffs end (the prefill side is told to let go),
                      every decode engine drops its NIXL agents, and the engine's
                      own `watch_registration` call returns so it re-registers
                      once it can (a restarted engine always meets a fresh
                      handshake);
  handshake_payloads  decode ranks fetch exactly the payloads they need;
  routes              routers fetch live decode engines -> usable prefill engines
                      with every pair's breaker (the ledger owns the breakers).

Routing state it owns besides the directory:

  kv_events           a registered engine's relayed KV cache events feed the
                      prefix index (one owner); routers replicate it with
                      `prefix_index_updates`; an engine's entries go with it;
  set_draining        routers stop choosing the engine (`routes()` leaves it
                      out); the autoscaler stops it once idle.

If the coordinator itself restarts (Ray restarts it), engines see their
`watch_registration` call fail and register again with the new incarnation.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import ray

from actors.kv.aggregator import KVConnectorOutput
from actors.kv.compat import pair_problem
from actors.control.ledger import BreakerConfig, LedgerSnapshot, TransferLedger, Verdict
from actors.control.liveness import Liveness
from actors.protocol import EngineInfo, EngineSummary, PrefillRoute, RouteTable
from actors.control.prefix_index import IndexCursor, IndexUpdate, KVEventsBatch, PrefixIndex
from actors.control.registry import ROLES, EngineEntry, Registration, RegistrationError, decode_registration

logger = logging.getLogger("raypd.coordinator")

COORDINATOR_NAME = "raypd-coordinator"
NAMESPACE = "raypd"


class Coordinator:
    def __init__(self, hang_check_s: float = 10.0, ping_timeout_s: float = 10.0,
                 handoff_deadline_s: float = 60.0, breaker: dict | BreakerConfig | None = None):
        self.ledger = TransferLedger(BreakerConfig.model_validate(breaker or {}), deadline_s=handoff_deadline_s)
        self.liveness = Liveness(self._evict, timeout_s=ping_timeout_s, interval_s=hang_check_s)
        self._engines: dict[str, EngineEntry] = {}
        self._model_hash: dict[str, str] = {}
        self._pairs: dict[tuple[str, str], str | None] = {}  # (prefill, decode) -> problem
        self._generation = 0
        self._timers: list[asyncio.Task] = []
        self._handoff_opened: asyncio.Event | None = None
        self.events: list[dict[str, Any]] = []
        self.prefix_index = PrefixIndex()
        # a restarted coordinator starts empty; engines register again within ~1 s of its return
        self._started_at = time.monotonic()
        self._restarted = _reconstructed()
        self.settle_s = 10.0

    async def configure(self, breaker: dict | None = None, handoff_deadline_s: float | None = None,
                        probe_interval_s: float | None = None, probe_timeout_s: float | None = None) -> None:
        """Cluster-wide settings of the ledger and the liveness probes (the last deployment
        launched sets them; pairs whose breaker already exists keep theirs)."""
        if breaker is not None:
            self.ledger.breaker_config = BreakerConfig.model_validate(breaker)
        if handoff_deadline_s is not None:
            self.ledger.deadline_s = handoff_deadline_s
        if probe_interval_s is not None:
            self.liveness.interval_s = probe_interval_s
        if probe_timeout_s is not None:
            self.liveness.timeout_s = probe_timeout_s

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
        old = self._engines.get(engine_id)
        if old is not None and old.raw == raw and old.role == role:
            # the same incarnation registering again (a retried call): nothing changes
            return Registration(old.generation, self._pair_summary(engine_id))
        if old is not None:  # new agents under a known id: the previous incarnation is gone
            await self._remove(engine_id, "replaced by a new incarnation", died=True)
        self._generation += 1
        entry = EngineEntry(engine_id, role, ranks, raw, list(handles or []), info or EngineInfo(), self._generation)
        self._engines[engine_id] = entry
        self._model_hash[model] = chash
        entry.watchers = [asyncio.get_running_loop().create_task(self._watch(entry, h)) for h in entry.handles]
        pairs = {}
        for other in self._engines.values():
            if other.engine_id == engine_id:
                continue
            for p, d in ((entry, other), (other, entry)):
                if p.role in ("prefill", "both") and d.serves_decode:
                    problem = pair_problem(list(p.ranks.values()), list(d.ranks.values()))
                    self._pairs[(p.engine_id, d.engine_id)] = problem
                    pairs[f"{p.engine_id}->{d.engine_id}"] = problem or "ok"
                    if problem:
                        logger.warning("pair %s -> %s refused: %s", p.engine_id, d.engine_id, problem)
                    else:
                        self.ledger.breaker(d.engine_id, p.engine_id)  # every routable pair has a state
        self._event("registered", engine_id, role=role, generation=entry.generation)
        return Registration(entry.generation, pairs)

    def _pair_summary(self, engine_id: str) -> dict[str, str]:
        return {f"{p}->{d}": problem or "ok" for (p, d), problem in self._pairs.items() if engine_id in (p, d)}

    async def unregister_engine(self, engine_id: str, reason: str = "unregistered",
                                generation: int | None = None) -> bool:
        """An engine leaves on purpose (shutdown): its breakers go too."""
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
        pairs = [(d, p) for (p, d) in self._pairs if engine_id in (p, d)]
        self._pairs = {k: v for k, v in self._pairs.items() if engine_id not in k}
        self.prefix_index.drop_engine(engine_id)
        gone = self.ledger.engine_died(engine_id, reason, pairs) if died else self.ledger.engine_left(engine_id)
        for handoff in gone:
            self._release_prefill(handoff.prefill_id, handoff.req_id)
        entry.eviction_reason = reason
        entry.evicted.set()
        for task in entry.watchers:
            if task is not asyncio.current_task():
                task.cancel()
        self._event("removed", engine_id, reason=reason, generation=entry.generation)
        # Every decode engine drops the agents of this incarnation (fire and forget: a
        # dead one will not answer, and that is fine).
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
        return self._pairs.get((prefill_id, decode_id), "pair never judged")

    def _usable(self, decode_id: str) -> tuple[PrefillRoute, ...]:
        return tuple(PrefillRoute(p, self.ledger.route_state(decode_id, p))
                     for (p, d), problem in sorted(self._pairs.items())
                     if d == decode_id and problem is None and not self.ledger.is_open(decode_id, p)
                     and not self._engines[p].draining)

    async def routes(self) -> RouteTable:
        """Every live decode engine -> its usable prefill engines, and every pair's breaker."""
        decodes = {e.engine_id: self._usable(e.engine_id) for e in self._engines.values()
                   if e.serves_decode and not e.draining}
        settling = self._restarted and time.monotonic() - self._started_at < self.settle_s
        return RouteTable(decodes, self.ledger.pair_states(),
                          {e.engine_id: e.generation for e in self._engines.values()}, settling,
                          dict(self.liveness.hangs))

    async def admit_probe(self, decode_id: str, prefill_id: str) -> bool:
        """A half-open pair's probe is admitted once, cluster-wide."""
        return self.ledger.admit_probe(decode_id, prefill_id)

    # ------------------------------------------------------- prefix index
    async def kv_events(self, engine_id: str, batch: KVEventsBatch) -> bool:
        """A registered engine's KV cache events (in its order); False: not registered, ignored."""
        if engine_id not in self._engines:
            return False
        self.prefix_index.apply(engine_id, batch)
        return True

    async def prefix_index_updates(self, cursor: IndexCursor | None) -> IndexUpdate:
        """What a router's replica of the prefix index lacks since `cursor`."""
        return self.prefix_index.updates_since(cursor)

    # ------------------------------------------------------------- draining
    async def handoffs_in_flight(self, engine_id: str) -> int:
        """KV handoffs from or to the engine that have no verdict yet."""
        return sum(1 for h in self.ledger.in_flight() if engine_id in (h.prefill_id, h.decode_id))

    async def set_draining(self, engine_id: str, draining: bool = True) -> bool:
        """Routers stop choosing a draining engine (`routes()` leaves it out)."""
        entry = self._engines.get(engine_id)
        if entry is None:
            return False
        entry.draining = draining
        self._event("draining" if draining else "undrained", engine_id)
        return True

    # ---------------------------------------------------------------- ledger
    async def open_handoff(self, req_id: str, prefill_id: str, decode_id: str) -> None:
        self.ledger.open(req_id, prefill_id, decode_id)
        self._ensure_timers()
        self._handoff_opened.set()

    async def abort_handoff(self, req_id: str) -> None:
        """The client went away before a verdict: the handoff closes, no breaker moves."""
        self.ledger.abort(req_id)

    async def report_outcomes(self, decode_id: str, outputs: list[KVConnectorOutput | None]) -> list[Verdict]:
        """Per-unit transfer outcomes of a decode engine -> verdicts (they feed the breakers)."""
        return self._verdicts(decode_id, self.ledger.report(decode_id, outputs))

    async def unit_died(self, decode_id: str, collected: list[KVConnectorOutput | None]) -> list[Verdict]:
        """A decode unit died mid-step: what the step collected is salvaged and replayed (the
        verdicts say `source="salvage"`). Synthetic engines only: a vLLM engine reports one merged
        outcome per request, and a dead worker takes its engine core down (README)."""
        self._event("unit_died", decode_id)
        return self._verdicts(decode_id, self.ledger.unit_died(decode_id, collected))

    async def handshake_failed(self, decode_id: str, prefill_id: str, reason: str,
                               req_id: str | None = None) -> None:
        verdict = self.ledger.handshake_failed(decode_id, prefill_id, reason, req_id)
        self._event("handshake_failed", decode_id, prefill_id=prefill_id, reason=reason)
        if verdict is not None:
            self._release_prefill(prefill_id, verdict.req_id)

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

    def _verdicts(self, decode_id: str, verdicts: list[Verdict]) -> list[Verdict]:
        for v in verdicts:
            if not v.ok:
                self._event("transfer_failed", decode_id, req_id=v.req_id, prefill_id=v.prefill_id)
        return verdicts

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
        if self._handoff_opened is None:
            self._handoff_opened = asyncio.Event()
        if not self._timers or any(t.done() for t in self._timers):
            for t in self._timers:
                t.cancel()
            loop = asyncio.get_running_loop()
            self._timers = [loop.create_task(self._expire_handoffs()), loop.create_task(self._hang_sweeps())]

    async def _expire_handoffs(self) -> None:
        """Sleeps until the earliest handoff deadline (or until one is opened); nothing ticks."""
        while True:
            deadline = self.ledger.next_deadline()
            self._handoff_opened.clear()
            try:
                if deadline is None:
                    await self._handoff_opened.wait()
                else:
                    await asyncio.wait_for(self._handoff_opened.wait(),
                                           max(0.0, deadline - self.ledger.clock()) + 0.01)
            except asyncio.TimeoutError:
                pass
            for v in self.ledger.expire():
                self._event("handoff_expired", v.decode_id, req_id=v.req_id, prefill_id=v.prefill_id)
                self._release_prefill(v.prefill_id, v.req_id)

    async def _hang_sweeps(self) -> None:
        while True:
            await asyncio.sleep(self.liveness.interval_s)
            try:
                await self.check_engines()
            except Exception:  # noqa: BLE001 - the sweep must survive anything
                logger.exception("engine hang check failed")

    async def check_engines(self) -> list[str]:
        """Probe every engine once (deaths are seen at once by the watchers; this catches
        hangs): one that does not answer in `ping_timeout_s` is evicted and killed so that
        Ray restarts it (`actors.control.liveness`). Returns the ids found hung or dead."""
        entries = [e for e in self._engines.values() if e.handles]
        return await self.liveness.sweep(entries, lambda e: self._engines.get(e.engine_id) is e)

    def _event(self, kind: str, engine_id: str, **fields: Any) -> None:
        self.events.append({"t": time.time(), "event": kind, "engine_id": engine_id, **fields})
        del self.events[:-1000]


def _reconstructed() -> bool:
    if not ray.is_initialized():  # not inside an actor (unit tests): asking would start a local Ray
        return False
    try:
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not inside an actor (unit tests)
        return False


def coordinator_options(name: str = COORDINATOR_NAME, detached: bool = False, on_head_node: bool = False,
                        max_restarts: int = 5) -> dict[str, Any]:
    """Ray options of the coordinator: a waiting actor (no CPU) that Ray restarts (bounded);
    its calls are retried on the new incarnation unless they say otherwise (`watch*`)."""
    options: dict[str, Any] = dict(
        name=name, namespace=NAMESPACE, num_cpus=0, get_if_exists=True, max_concurrency=10_000,
        max_restarts=max_restarts, max_task_retries=3 if max_restarts else 0,
    )
    if detached:
        options["lifetime"] = "detached"
    if on_head_node:
        # Ray gives the head node this marker resource; the directory lives as long as the cluster
        options["resources"] = {"node:__internal_head__": 0.001}
    return options


def start_coordinator(detached: bool = False, on_head_node: bool = False, name: str = COORDINATOR_NAME,
                      max_restarts: int = 5, **kwargs: Any) -> Any:
    """Get or create the cluster's coordinator actor (on the head node if asked)."""
    options = coordinator_options(name, detached, on_head_node, max_restarts)
    return ray.remote(Coordinator).options(**options).remote(**kwargs)


def get_coordinator() -> Any:
    return ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
