"""The P/D router: which decode engine, which prefill engine, and the handoff between them.

Life cycle of one request (`Router.open`):

  1. plan (`serving.routing.planner`): among the decode engines the directory
     (the coordinator) lists as alive, the one with the lowest score (prompt
     tokens its prefix cache lacks + tokens still owed by the requests this
     router sent it; `serving.routing.policy`), its usable prefill engines
     best first, and remote or local prefill (counted with its reason); the
     decode engine is charged for the request until its stream ends (`DecodeCharge`);
  2. remote attempts (a remote decision): the first of those prefill engines
     the directory lists as usable with that decode engine (compatible, pair
     breaker not open: the coordinator's ledger owns the breakers; a half-open
     pair is used only if this router wins its one probe) runs the prompt and returns a
     `PrefillResult`: the first token, streamed to the client at once, and the
     transfer params the decode engine pulls the KV with; the decode engine
     continues from token two and applies the transfer failure policy itself.
     A prefill that fails because of the engine is reported to the ledger and
     retried once on another prefill engine (`prefill_retries`); one refused
     because of the request is a 400, never retried, never reported;
  3. local: a local decision (the uncached prompt is short, the prefill pool
     is saturated), or no (more) usable prefill engine: the decode engine
     prefills itself (`decode_local`) or the request is refused (`reject`, 503);
  4. the caller iterates the returned `RoutedStream`; if its decode engine
     dies mid-stream, the stream migrates to another live decode engine (or
     the restarted one, within `migration_wait_s`); closing it early (client
     disconnect) aborts the request on the decode and on the prefill engine.

Pure asyncio: engines are `EngineClient`s and the coordinator a `Directory`, so
unit tests drive it with fakes; `serving.cluster.clients` adapts Ray actor handles.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, replace
from typing import Any, Protocol

from actors.control.ledger import RouteTable
from actors.protocol import EngineRequest, PrefillResult, TokenChunk
from serving.config import RouterConfig
from serving.routing.planner import RoutePlan, RoutePlanner, planner_for
from serving.routing.stream import (
    DecodeCharge,
    EngineUnavailable,
    Load,
    RequestRejected,
    Route,
    RoutedStream,
    no_more_chunks,
)

__all__ = ["EngineUnavailable", "RequestRejected", "RouteError", "Router", "RoutedStream"]

logger = logging.getLogger("raypd.router")


# ---------------------------------------------------------------- interfaces
class RouteError(Exception):
    """The request cannot be served; `status` is the HTTP status the front answers with."""

    def __init__(self, status: int, message: str, type: str = "server_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param


class EngineClient(Protocol):
    engine_id: str

    async def prefill(self, req: EngineRequest) -> PrefillResult: ...
    def generate(self, req: EngineRequest) -> AsyncIterator[TokenChunk]: ...
    async def abort(self, request_id: str) -> None: ...
    async def stats(self) -> dict: ...


class Directory(Protocol):
    async def routes(self) -> RouteTable:
        """Live decode engines -> usable prefill engines, and every pair's breaker."""
        ...

    async def admit_probe(self, decode_id: str, prefill_id: str) -> bool:
        """Win the half-open pair's probe (granted once, cluster-wide)."""
        ...

    def prefill_failed(self, decode_id: str, prefill_id: str, reason: str) -> None:
        """Report an engine-caused prefill failure to the ledger (fire and forget)."""
        ...


# -------------------------------------------------------------------- router
class Router:
    def __init__(self, prefills: dict[str, EngineClient], decodes: dict[str, EngineClient],
                 directory: Directory, config: RouterConfig | None = None,
                 directory_ttl_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 resolve_engine: Callable[[str], EngineClient | None] | None = None,
                 planner: RoutePlanner | None = None):
        if not decodes:
            raise ValueError("a router needs at least one decode engine")
        self.prefills, self.decodes = dict(prefills), dict(decodes)
        self.directory = directory
        self.config = config or RouterConfig()
        self.directory_ttl_s = directory_ttl_s
        self.clock = clock
        self.decode_load: dict[str, Load] = {d: Load() for d in self.decodes}
        self.prefill_load: dict[str, Load] = {p: Load() for p in self.prefills}
        self.counters: Counter[str] = Counter()  # requests, retries, aborted, recomputed...
        self.fallbacks: Counter[str] = Counter()  # reason -> count
        self.migrations: Counter[str] = Counter()  # reason -> streams moved to another decode engine
        self.transfer_failures: Counter[tuple[str, str]] = Counter()  # (decode, prefill), as observed
        self.prefill_failures: Counter[str] = Counter()  # prefill id
        self.engine_stats: dict[str, dict] = {}
        self._routes: RouteTable | None = None
        self._routes_at = -math.inf
        self._routes_error: str | None = None
        self._refreshing = False
        self._stale = False  # an outcome that may move a breaker was reported since the last view
        self._rr = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        # engines the directory lists that this router has no client for yet (scaled up, restarted)
        self.resolve_engine = resolve_engine
        self.autoscaler: Any = None  # its status() is shown with the engine stats (serving.cluster.autoscaler)
        self.pool_status: Any = None
        self.planner = planner or planner_for(self.config)

    # ----------------------------------------------------------- directory
    async def routes(self, force: bool = False) -> RouteTable:
        """The directory's view, cached for `directory_ttl_s`; a failing directory keeps the last view.

        Only the first lookup, `force`, or the first lookup after a reported failure (which may
        have moved a breaker in the ledger) waits for the directory: an expired view is served
        as is while one refresh runs in the background, so no request pays the coordinator's
        round trips on its way to the first token.
        """
        if force or self._routes is None or self._stale:
            self._stale = False
            await self._refresh_routes()
        elif self.clock() - self._routes_at >= self.directory_ttl_s and not self._refreshing:
            self._refreshing = True
            self._spawn(self._refresh_routes())
        return self._routes

    async def _refresh_routes(self) -> None:
        try:
            fresh = await self.directory.routes()
            if fresh.settling and self._routes is not None:
                # a restarted coordinator, engines still registering: keep those we knew
                kept = {d: ps for d, ps in self._routes.decodes.items() if d not in fresh.decodes}
                fresh = replace(fresh, decodes={**kept, **fresh.decodes},
                                generations={**self._routes.generations, **fresh.generations})
            self._routes = fresh
            self._routes_error = None
            self._sync_members(fresh)
        except Exception as exc:  # noqa: BLE001 - the directory being away must not crash routing
            self._routes_error = f"{type(exc).__name__}: {exc}"
            logger.warning("directory unavailable, keeping the last view: %s", self._routes_error)
            if self._routes is None:
                self._routes = RouteTable({})
        finally:
            self._routes_at = self.clock()
            self._refreshing = False

    def _sync_members(self, routes: RouteTable) -> None:
        """Adopt the engines the directory lists; forget departed ones once nothing of ours runs there
        and their actor is gone (a dead engine that is still there stays, shown as down)."""
        if self.resolve_engine is None:
            return
        listed = {d: (self.decodes, self.decode_load) for d in routes.decodes}
        listed.update({r.prefill_id: (self.prefills, self.prefill_load) for rs in routes.decodes.values() for r in rs})
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

    # ----------------------------------------------------------- selection
    def live_decodes(self, routes: RouteTable, exclude: set[str] = frozenset()) -> list[str]:
        return [d for d in self.decodes if d in routes.decodes and d not in exclude]

    def usable_prefills(self, decode_id: str, routes: RouteTable, exclude: set[str] = frozenset()) -> list[str]:
        """Usable per the ledger, known here, not excluded; least loaded first."""
        ids = [r.prefill_id for r in routes.decodes.get(decode_id, ())
               if r.prefill_id in self.prefills and r.prefill_id not in exclude]
        return sorted(ids, key=lambda p: (self.prefill_load[p].requests, self.prefill_load[p].tokens))

    def pick_decode(self, routes: RouteTable, exclude: set[str] = frozenset()) -> str | None:
        live = self.live_decodes(routes, exclude)
        if not live:
            return None
        turn = next(self._rr)
        # least outstanding tokens, then fewest requests, then round robin among equals
        return min(live, key=lambda d: (self.decode_load[d].tokens, self.decode_load[d].requests,
                                        (list(self.decodes).index(d) - turn) % len(self.decodes)))

    async def pick_prefill(self, decode_id: str, routes: RouteTable, ranked: tuple[str, ...],
                           exclude: set[str]) -> str | None:
        """The first of `ranked` (the plan's order) that is usable and not excluded; a half-open
        pair only if this router wins its probe."""
        states = {r.prefill_id: r.state for r in routes.decodes.get(decode_id, ())}
        for p in ranked:
            if p not in states or p not in self.prefills or p in exclude:
                continue
            if states[p] == "closed":
                return p
            try:  # half-open: one probe cluster-wide, asked of the ledger
                if await self.directory.admit_probe(decode_id, p):
                    return p
            except Exception as exc:  # noqa: BLE001 - no answer: do not probe
                logger.info("probe of %s->%s not admitted: %s", p, decode_id, exc)
        return None

    # ------------------------------------------------------------- serving
    async def open(self, req: EngineRequest) -> RoutedStream:
        """Route `req`; returns its stream once the first chunk is known.

        Raises `RouteError` when the request cannot be served; nothing is left
        running on any engine in that case.
        """
        estimate = req.num_prompt_tokens  # the front tokenized the prompt: a real count
        self.counters["requests"] += 1
        routes = await self.routes()
        failed_decodes: set[str] = set()
        while True:
            plan = self.planner.plan(self, req, routes, next(self._rr), failed_decodes)
            if plan is None:
                self.counters["rejected_no_decode"] += 1
                raise RouteError(503, "no decode engine is available" + (
                    f" (directory: {self._routes_error})" if self._routes_error else ""), code="no_decode_engine")
            decode_id = plan.decode_id
            route = Route(decode_id, decode_generation=routes.generations.get(decode_id))
            try:
                with DecodeCharge(self.decode_load[decode_id], estimate + req.max_tokens) as charge:
                    if plan.decision.remote:
                        stream = await self._remote_attempts(route, req, routes, plan, estimate, charge)
                        if stream is not None:
                            return stream
                    return await self._local(route, req, plan, charge)
            except EngineUnavailable as exc:  # the decode engine died before any output: another one
                logger.warning("%s: decode engine %s unavailable before the first token: %s",
                               req.request_id, decode_id, exc)
                failed_decodes.add(decode_id)
                routes = await self.routes(force=True)

    async def _remote_attempts(self, route: Route, req: EngineRequest, routes: RouteTable, plan: RoutePlan,
                               estimate: int, charge: DecodeCharge) -> RoutedStream | None:
        """Prefill on a usable prefill engine (retried once elsewhere); None when none succeeded."""
        tried: set[str] = set()
        while route.attempts < 1 + self.config.prefill_retries:
            prefill_id = await self.pick_prefill(route.decode_id, routes, plan.prefill_ids, tried)
            if prefill_id is None:
                return None
            tried.add(prefill_id)
            route.attempts += 1
            if route.attempts > 1:
                self.counters["prefill_retries"] += 1
            engine_req = req.replace(request_id=self._attempt_id(req.request_id, route.attempts))
            route.prefill_id = prefill_id
            out = await self._prefill(route, engine_req, estimate)
            if out is not None:
                return self._continuation(route, req, engine_req, out, charge)
        return None

    async def _local(self, route: Route, req: EngineRequest, plan: RoutePlan, charge: DecodeCharge) -> RoutedStream:
        """The decode engine prefills itself: a local decision, or the fallback."""
        route.prefill_id = None
        if plan.decision.decision == "local" and plan.decision.reason != "no_prefill_engine":
            route.path = "local"
        else:
            reason = "prefill_failed" if route.failures else "no_prefill_engine"
            if self.config.no_prefill_fallback != "decode_local":
                self.counters["rejected_no_prefill"] += 1
                why = "; ".join(route.failures) or "no compatible prefill engine with a closed breaker"
                raise RouteError(503, f"no prefill engine is available for decode engine {route.decode_id}: {why}",
                                 code="no_prefill_engine")
            route.path = "fallback"
            self.fallbacks[reason] += 1
        engine_req = req.replace(request_id=req.request_id if route.attempts == 0 else f"{req.request_id}-local")
        gen = self.decodes[route.decode_id].generate(engine_req)
        first = await self._first_chunk(route, engine_req, gen)
        if first.failed_before_output:  # a local run has no transfer to fail: the engine failed
            self.close_gen(gen)
            raise RouteError(503, f"decode engine {route.decode_id} failed: {first.error}", code="engine_error")
        return RoutedStream(self, req, engine_req.request_id, route, gen, first, charge)

    @staticmethod
    def _attempt_id(request_id: str, attempt: int) -> str:
        return request_id if attempt == 1 else f"{request_id}-retry{attempt - 1}"

    async def _prefill(self, route: Route, req: EngineRequest, estimate: int) -> PrefillResult | None:
        """Run the prompt on route.prefill_id; its result, or None after an engine failure (reported)."""
        p, d = route.prefill_id, route.decode_id
        load = self.prefill_load[p]
        load.requests += 1
        load.tokens += estimate
        try:
            return await self.prefills[p].prefill(req)
        except RequestRejected as exc:  # the client's mistake: no retry, no breaker
            raise RouteError(400, str(exc), type="invalid_request_error", code="invalid_prompt") from None
        except asyncio.CancelledError:
            self.abort_prefill(route, req.request_id)
            raise
        except Exception as exc:  # noqa: BLE001 - an engine failure is a failed attempt
            msg = f"prefill engine {p} failed: {exc}"
            logger.warning("%s: %s", req.request_id, msg)
            route.failures.append(msg)
            self.prefill_failures[p] += 1
            self._report_prefill_failure(d, p, str(exc))
            self.abort_prefill(route, req.request_id)
            return None
        finally:
            load.requests -= 1
            load.tokens -= estimate

    def _report_prefill_failure(self, decode_id: str, prefill_id: str, reason: str) -> None:
        try:
            self.directory.prefill_failed(decode_id, prefill_id, reason)
        except Exception as exc:  # noqa: BLE001 - the ledger being away must not fail the request
            logger.info("reporting a prefill failure of %s: %s", prefill_id, exc)
        self.invalidate_routes()

    def invalidate_routes(self) -> None:
        """An outcome was reported that may move a breaker: the next request asks the directory."""
        self._stale = True

    async def _first_chunk(self, route: Route, req: EngineRequest, gen: AsyncIterator[TokenChunk]) -> TokenChunk:
        """The decode stream's first chunk; a refusal is a 400, a dead engine `EngineUnavailable`."""
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return TokenChunk.error_chunk(req.request_id, "the decode engine ended the stream without output")
        except RequestRejected as exc:
            raise RouteError(400, str(exc), type="invalid_request_error", code="invalid_prompt") from None
        except asyncio.CancelledError:
            self.abort_decode(route.decode_id, req.request_id)
            self.close_gen(gen)
            raise
        except EngineUnavailable:
            self.close_gen(gen)
            raise
        except Exception as exc:  # noqa: BLE001
            self.close_gen(gen)
            raise RouteError(503, f"decode engine {route.decode_id} failed: {exc}", code="engine_unavailable") from None

    def _continuation(self, route: Route, req: EngineRequest, engine_req: EngineRequest, out: PrefillResult,
                      charge: DecodeCharge) -> RoutedStream:
        """A stream whose first chunk is the prefill engine's token; the decode engine goes on
        (and answers a failed pull per its `kv_load_failure_policy`)."""
        first = TokenChunk(engine_req.request_id, out.first_token_ids, out.first_text,
                           num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens)
        if engine_req.max_tokens <= len(out.first_token_ids) or not out.needs_decode:
            first = first.replace(finished=True, finish_reason=out.finish_reason or "length")
            if out.kv_transfer_params:  # nobody will read the KV: release the prefill engine's lease now
                self.abort_prefill(route, engine_req.request_id)
            return RoutedStream(self, req, engine_req.request_id, route, no_more_chunks(), first, charge)
        gen = self.decodes[route.decode_id].generate(out.continuation(engine_req))
        return RoutedStream(self, req, engine_req.request_id, route, gen, first, charge,
                            awaiting_transfer=True)

    # ----------------------------------------------------------- migration
    def generation_of(self, decode_id: str) -> int | None:
        return self._routes.generations.get(decode_id) if self._routes else None

    async def migration_target(self, failed: dict[str, int | None]) -> str | None:
        """A live decode engine for a stream whose engine failed (`failed`: engine -> the
        incarnation that failed): another one at once, else a restarted one (a new generation)
        within `migration_wait_s`; None when none came."""
        deadline = self.clock() + self.config.migration_wait_s
        delay = 0.1
        while True:
            routes = await self.routes(force=True)
            same = {d for d, gen in failed.items() if d in routes.decodes and routes.generations.get(d) == gen}
            target = self.pick_decode(routes, same)
            if target is not None or self.clock() >= deadline:
                return target
            await asyncio.sleep(delay)  # only while no decode engine is up (a failure mode)
            delay = min(delay * 2, 1.0)

    # ------------------------------------------------------------ outcomes
    def _spawn(self, coro: Any) -> None:
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
            self._spawn(self.decodes[decode_id].abort(engine_req_id))

    def abort_prefill(self, route: Route, engine_req_id: str) -> None:
        if route.prefill_id in self.prefills:
            self._spawn(self.prefills[route.prefill_id].abort(engine_req_id))

    def close_gen(self, gen: Any) -> None:
        aclose = getattr(gen, "aclose", None)
        if aclose is not None:
            self._spawn(aclose())

    async def drain(self) -> None:
        """Wait for background aborts (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -------------------------------------------------------------- status
    async def health(self) -> dict:
        routes = await self.routes()
        live = self.live_decodes(routes)
        pd_paths = {d: self.usable_prefills(d, routes) for d in live}
        local_ok = bool(live) and (self.config.no_prefill_fallback == "decode_local" or not self.prefills)
        healthy = any(pd_paths.values()) or local_ok
        reason = None
        if not live:
            reason = "no decode engine is alive"
        elif not healthy:
            reason = "no compatible prefill engine with a closed breaker, and the fallback is reject"
        return {"healthy": healthy, "reason": reason, "decode_engines": live,
                "pd_paths": pd_paths, "decode_local": local_ok, "directory_error": self._routes_error}

    async def refresh_engine_stats(self, timeout_s: float = 2.0) -> dict[str, dict]:
        """Every engine's stats, and the routes (breakers) when the cached ones are old."""
        await self.routes()
        engines = {**self.prefills, **self.decodes}

        async def one(eid: str, eng: EngineClient) -> tuple[str, dict]:
            try:
                return eid, {"up": True, **await asyncio.wait_for(eng.stats(), timeout_s)}
            except Exception as exc:  # noqa: BLE001 - a dead engine is a status, not an error
                return eid, {"up": False, "error": f"{type(exc).__name__}: {exc}"}

        results = await asyncio.gather(*(one(e, h) for e, h in engines.items()))
        self.engine_stats = dict(results)
        if self.autoscaler is not None:
            try:
                self.pool_status = await asyncio.wait_for(self.autoscaler.status(), timeout_s)
            except Exception as exc:  # noqa: BLE001 - shown as unavailable, routing goes on
                self.pool_status = None
                logger.info("autoscaler status unavailable: %s", exc)
        return self.engine_stats

    def snapshot(self) -> dict:
        """Plain-dict view for `raypd status` and the metrics collector (breakers: the ledger's)."""
        routes = self._routes or RouteTable({})
        return {
            "decode_load": {d: vars(load).copy() for d, load in self.decode_load.items()},
            "prefill_load": {p: vars(load).copy() for p, load in self.prefill_load.items()},
            "breakers": {b.pair: asdict(b) for b in routes.breakers},
            "counters": dict(self.counters),
            "fallbacks": dict(self.fallbacks),
            "migrations": dict(self.migrations),
            "transfer_failures": {f"{p}->{d}": n for (d, p), n in self.transfer_failures.items()},
            "prefill_failures": dict(self.prefill_failures),
            "routes": {d: [r.prefill_id for r in rs] for d, rs in routes.decodes.items()},
            "pools": asdict(self.pool_status) if self.pool_status is not None else None,
            **self.planner.snapshot(),
        }
