"""The router's engines: the one owner of their clients, the work charged to them and the counters.

Per engine it keeps the client (`EngineClient`: a Ray actor handle behind a small interface, a fake
in unit tests) and the `Load` this router sent there; per pool the counters routing reports
(`RouterCounter`, fallbacks, migrations, transfer and prefill failures) and the engines' last stats.
Invariants: selection leaves out incarnations suspected hung; a departed engine is forgotten only
once nothing of ours runs there and its actor is gone; aborts and closes run in the background (safe
from a cancelled task). What it offers the rest of routing: `EnginePool`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence, Set as AbstractSet
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from actors.protocol.request import EngineRequest, PrefillResult, TokenChunk
from actors.protocol.stats import EngineStats
from actors.routes import RouteTable
from serving.routing.deadlines import EngineDeadlines
from serving.routing.decisions import FallbackReason
from serving.routing.rates import RateEstimator

logger = logging.getLogger("raypd.router")


class EngineClient(Protocol):
    engine_id: str

    async def prefill(self, req: EngineRequest) -> PrefillResult: ...
    def generate(self, req: EngineRequest) -> AsyncIterator[TokenChunk]: ...
    async def abort(self, request_id: str) -> None: ...
    async def stats(self) -> EngineStats: ...


@dataclass
class Load:
    requests: int = 0
    tokens: int = 0
    fresh: int = 0  # requests still owed their second token (a prefill chunk now would stall that gap)


@dataclass(frozen=True)
class EngineStatus:
    """An engine's last stats call as the pool saw it: its stats, or why there are none."""

    up: bool
    stats: EngineStats | None = None
    error: str | None = None


class GivenRate:
    """Tokens given to an engine per second, recently (a counter decayed with time constant `window_s`)."""

    def __init__(self, window_s: float, now: float):
        self.window_s, self.total, self.at = window_s, 0.0, now

    def add(self, tokens: int, now: float) -> None:
        self._decay(now)
        self.total += tokens

    def per_s(self, now: float) -> float:
        self._decay(now)
        return self.total / self.window_s

    def _decay(self, now: float) -> None:
        if now > self.at:
            self.total *= math.exp(-(now - self.at) / self.window_s)
            self.at = now


class DecodeCharge:
    """The work a request owes its decode engine: charged on entry, paid back as tokens
    arrive, and refunded in full on exit unless a stream took it over (`hand_over`). Until its
    second token arrives the request counts as fresh on the engine (`Load.fresh`)."""

    def __init__(self, load: Load, tokens: int):
        self.load, self.owed = load, tokens
        self.open = True
        self.handed_over = False
        self.streamed = 0
        load.requests += 1
        load.tokens += tokens
        load.fresh += 1

    def __enter__(self) -> "DecodeCharge":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.handed_over:
            self.settle()

    def hand_over(self) -> "DecodeCharge":
        self.handed_over = True
        return self

    def pay(self, tokens: int) -> None:
        """`tokens` streamed: paid back (the second one ends the request's freshness)."""
        if self.open and self.streamed < 2 <= self.streamed + tokens:
            self.load.fresh = max(0, self.load.fresh - 1)
        self.streamed += tokens
        self._refund(tokens)

    def _refund(self, tokens: int) -> None:
        paid = min(tokens, self.owed)
        self.owed -= paid
        self.load.tokens = max(0, self.load.tokens - paid)

    def settle(self) -> None:
        """Refund what is still owed, the request slot and its freshness (once)."""
        if self.open:
            self.open = False
            self._refund(self.owed)
            self.load.requests = max(0, self.load.requests - 1)
            if self.streamed < 2:
                self.load.fresh = max(0, self.load.fresh - 1)


class RouterCounter(StrEnum):
    """What `EnginePool.counters` counts; the values are `raypd status`'s and `/metrics`' names."""

    REQUESTS = "requests"
    REJECTED_NO_DECODE = "rejected_no_decode"
    REJECTED_NO_PREFILL = "rejected_no_prefill"
    PREFILL_RETRIES = "prefill_retries"
    RECOMPUTED = "recomputed"
    MIGRATION_FAILED = "migration_failed"
    ABORTED = "aborted"


class EnginePool:
    """What the rest of routing reads of it:

      membership  `sync(routes)` adopts engines the directory lists that the pool has
                  no client for (scaled up, recreated), and forgets departed ones
                  once nothing of ours runs there and their actor is gone;
      selection   `live_decodes` / `usable_prefills` intersect the directory's view
                  with the engines the pool knows, least loaded first, leaving out the
                  incarnations that missed a deadline (`deadlines`, suspected hung);
      charges     `charge_decode` opens a `DecodeCharge` (paid back as tokens stream);
                  `prefilling` counts a prefill's prompt tokens on the engine running it
                  (a prefill engine's, or a decode engine's own local prefill);
      rates       `rates` reads each engine's prefill rate, step time and queues as the
                  engine published them (every router the same: adopted with each table in
                  `sync`), and keeps what only this router sees: its hop to each engine and
                  each pair's pull (`serving.routing.rates`); the deadlines read the same;
      cleanup     `abort_decode`, `abort_prefill`, `close_gen` run in the background
                  (safe from a cancelled task); `drain()` waits for them.
    """

    def __init__(self, prefills: dict[str, EngineClient], decodes: dict[str, EngineClient],
                 resolve_engine: Callable[[str], EngineClient | None] | None = None,
                 rates: RateEstimator | None = None, deadlines: EngineDeadlines | None = None):
        self.prefills, self.decodes = dict(prefills), dict(decodes)
        # every engine call's deadline, the engines' measured rates, the incarnations suspected hung
        self.deadlines = deadlines or EngineDeadlines(rates=rates)
        # engines the directory lists that the pool has no client for yet (scaled up, restarted)
        self.resolve_engine = resolve_engine
        self.decode_load: dict[str, Load] = {d: Load() for d in self.decodes}
        self.prefill_load: dict[str, Load] = {p: Load() for p in self.prefills}
        self.counters: Counter[RouterCounter] = Counter()
        self.fallbacks: Counter[FallbackReason] = Counter()
        self.migrations: Counter[str] = Counter()  # reason -> streams moved to another decode engine
        self.transfer_failures: Counter[tuple[str, str]] = Counter()  # (decode, prefill), as observed
        self.prefill_failures: Counter[str] = Counter()  # prefill id
        self.engine_stats: dict[str, EngineStatus] = {}
        self.rates = rates or self.deadlines.rates  # one model: placement and the deadlines read the same
        self._given: dict[str, GivenRate] = {}  # prompt tokens given to each engine to prefill, recently
        self._tasks: set[asyncio.Task] = set()
        # per directory table: decode engine -> its listed prefill engines that this pool knows
        self._routed: tuple[RouteTable | None, dict[str, tuple[tuple[str, ...], frozenset[str]]]] = (None, {})

    # ---------------------------------------------------------- membership
    def sync(self, routes: RouteTable) -> None:
        """Adopt the engines the directory lists; forget departed ones once nothing of ours runs there
        and their actor is gone (a dead engine that is still there stays, shown as down)."""
        self._routed = (None, {})  # membership may change below
        self.rates.adopt(routes.rates)  # the engines' own rates, as this table has them
        if self.resolve_engine is None:
            return
        listed = {d: (self.decodes, self.decode_load) for d in routes.decodes}
        listed.update({r.prefill_id: (self.prefills, self.prefill_load)
                       for rs in routes.decodes.values() for r in rs})
        for eid, (pool, loads) in listed.items():
            if eid not in pool:
                client = self.resolve_engine(eid)
                if client is not None:
                    pool[eid] = client
                    loads.setdefault(eid, Load())
        for pool, loads in ((self.decodes, self.decode_load), (self.prefills, self.prefill_load)):
            for eid in [e for e in pool if e not in listed and not loads[e].requests
                        and self.resolve_engine(e) is None]:
                del pool[eid], loads[eid]
                self.engine_stats.pop(eid, None)
                self.rates.forget(eid)

    def role_of(self, engine_id: str) -> str:
        """prefill | decode | both, as far as this pool uses the engine."""
        p, d = engine_id in self.prefills, engine_id in self.decodes
        return "both" if p and d else "prefill" if p else "decode"

    # ----------------------------------------------------------- selection
    def hung(self, engine_id: str, routes: RouteTable) -> bool:
        """This incarnation of the engine missed a deadline of ours (held back, see `deadlines`)."""
        return self.deadlines.suspected(engine_id, routes.generations.get(engine_id))

    def live_decodes(self, routes: RouteTable, exclude: set[str] = frozenset()) -> list[str]:
        table = routes.decodes
        live = [d for d in self.decodes if d in table and d not in exclude]
        return [d for d in live if not self.hung(d, routes)] if self.deadlines.suspects else live

    def usable_prefills(self, decode_id: str, routes: RouteTable, exclude: set[str] = frozenset(),
                        ordered: bool = True) -> list[str]:
        """Usable per the ledger, known here, not excluded, not suspected hung; least loaded first
        (`ordered=False`: in the directory's order, for a caller that picks its own)."""
        routed, _ = self._routed_prefills(decode_id, routes)
        ids = [p for p in routed if p not in exclude] if exclude else list(routed)
        if self.deadlines.suspects:
            ids = [p for p in ids if not self.hung(p, routes)]
        return sorted(ids, key=self.prefill_order) if ordered else ids

    def usable_prefill_set(self, decode_id: str, routes: RouteTable) -> tuple[Sequence[str], AbstractSet[str]]:
        """`usable_prefills(decode_id, routes, ordered=False)` and the same engines as a set: the table's
        own (shared, not to be changed) while no engine is suspected hung, a shortlist's per request."""
        if self.deadlines.suspects:
            ids = self.usable_prefills(decode_id, routes, ordered=False)
            return ids, set(ids)
        return self._routed_prefills(decode_id, routes)

    def _routed_prefills(self, decode_id: str, routes: RouteTable) -> tuple[tuple[str, ...], frozenset[str]]:
        """The table's prefill engines for `decode_id` that this pool knows, once per table and decode
        engine (not per request: O(prefills))."""
        if self._routed[0] is not routes:
            self._routed = (routes, {})
        routed = self._routed[1].get(decode_id)
        if routed is None:
            known = self.prefills
            ids = tuple(r.prefill_id for r in routes.decodes.get(decode_id, ()) if r.prefill_id in known)
            routed = self._routed[1][decode_id] = (ids, frozenset(ids))
        return routed

    def prefill_order(self, prefill_id: str) -> tuple[int, int]:
        """Least loaded first: requests, then queued prompt tokens."""
        x = self.prefill_load[prefill_id]
        return x.requests, x.tokens

    def prefill_keys(self, prefill_ids: list[str]) -> list[tuple[int, int]]:
        """`prefill_order` of each of `prefill_ids`, in one pass (a shortlist sorts by them per request)."""
        return [(x.requests, x.tokens) for x in map(self.prefill_load.__getitem__, prefill_ids)]

    def decode_keys(self, decode_ids: list[str]) -> list[tuple[int, int]]:
        """Each decode engine's load, least loaded first: streams, then their tokens."""
        return [(x.requests, x.tokens) for x in map(self.decode_load.__getitem__, decode_ids)]

    # ------------------------------------------------------------- charges
    def charge_decode(self, decode_id: str, tokens: int) -> DecodeCharge:
        return DecodeCharge(self.decode_load[decode_id], tokens)

    @contextlib.contextmanager
    def prefilling(self, prefill_id: str, tokens: int) -> Iterator[None]:
        """A prefill in flight on `prefill_id` (its prompt tokens count as queued work there)."""
        load = self.prefill_load.setdefault(prefill_id, Load())
        now = self.rates.clock()
        self._given.setdefault(prefill_id, GivenRate(self.rates.config.prefill_busy_window_s, now)).add(tokens, now)
        load.requests += 1
        load.tokens += tokens
        try:
            yield
        finally:
            load.requests -= 1
            load.tokens -= tokens

    def prefill_busy(self, engine_id: str) -> float:
        """The share of its recent time `engine_id` spent prefilling: the prompt tokens given to it per
        second (the larger of this router's and what the engine published) at its prefill rate."""
        given = self._given.get(engine_id)
        rates = self.rates.rates(engine_id)
        mine = given.per_s(self.rates.clock()) if given is not None else 0.0
        return max(mine, rates.prompt_tokens_per_s) / rates.prefill_tokens_per_s

    # -------------------------------------------------------------- status
    async def refresh_stats(self, timeout_s: float = 2.0) -> dict[str, EngineStatus]:
        """Every engine's stats (a dead engine is a status, not an error)."""
        engines = {**self.prefills, **self.decodes}

        async def one(eid: str, eng: EngineClient) -> tuple[str, EngineStatus]:
            try:
                return eid, EngineStatus(True, await asyncio.wait_for(eng.stats(), timeout_s))
            except Exception as exc:  # noqa: BLE001
                return eid, EngineStatus(False, error=f"{type(exc).__name__}: {exc}")

        self.engine_stats = dict(await asyncio.gather(*(one(e, h) for e, h in engines.items())))
        return self.engine_stats

    # ---------------------------------------------------------- background
    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop (called at interpreter shutdown): best effort
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.info("background abort failed: %s", task.exception())

    def abort_decode(self, decode_id: str, engine_req_id: str) -> None:
        if decode_id in self.decodes:  # else it left the pool: nothing of the request is left there
            self.spawn(self.decodes[decode_id].abort(engine_req_id))

    def abort_prefill(self, prefill_id: str | None, engine_req_id: str) -> None:
        if prefill_id in self.prefills:
            self.spawn(self.prefills[prefill_id].abort(engine_req_id))

    def close_gen(self, gen: AsyncIterator[TokenChunk]) -> None:
        aclose = getattr(gen, "aclose", None)  # async generators and engine streams have one
        if aclose is not None:
            self.spawn(aclose())

    async def drain(self) -> None:
        """Wait for background aborts (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
