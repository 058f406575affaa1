"""The P/D router: which decode engine, which prefill engine, and the handoff between them.

A request is planned (`serving.routing.planner`), prefilled remotely with one retry on another
prefill engine or locally (the fallback, or `reject`), and streamed as a `RoutedStream` that
migrates when its decode engine dies. Invariants: every engine call a client waits for has a
deadline (`serving.routing.deadlines`), and an engine that misses one is treated as hung; the only
coordinator call a request may wait for is a half-open pair's probe, everything else comes from
the router's cached view (`serving.routing.directory`). Pure asyncio: engines are `EngineClient`s
and the coordinator a `Directory`, so unit tests drive it with fakes; routing errors are
`serving.routing.route_errors`. The life cycle of one request: `Router`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from actors.protocol.request import EngineRequest, PrefillResult, Stamps, TokenChunk
from actors.routes import BreakerState, RouteTable
from serving.config import RouterConfig
from serving.routing.deadlines import EngineDeadlines
from serving.routing.decisions import Decision, DecisionReason, FallbackReason
from serving.routing.directory import Directory, DirectoryView
from serving.routing.route_errors import (
    EngineFailed,
    EngineUnavailable,
    InvalidRequest,
    NoDecodeEngine,
    NoPrefillEngine,
    RequestRejected,
)
from serving.routing.placers import RoutePlan
from serving.routing.planner import RoutePlanner, planner_for
from serving.routing.pool import DecodeCharge, EngineClient, EnginePool, EngineStatus, RouterCounter
from serving.routing.probes import ProbeGrants
from serving.routing.protocols import PoolStatusSource
from serving.routing.rates import RateEstimator, hop_of
from serving.routing.status import Readiness, RouterSnapshot
from serving.routing.stream import Route, RoutedStream, no_more_chunks

logger = logging.getLogger("raypd.router")


@dataclass
class PrefillTiming:
    ok: bool = False  # the prefill produced its first token (only then does its time teach anything)
    stamps: tuple[tuple[str, float], ...] = ()  # the first token's hops (this router's and the engine's)


class Router:
    """Life cycle of one request (`Router.open`):

      1. plan (`serving.routing.planner`): among the decode engines the directory
         (the coordinator) lists as alive, the one with the lowest score (prompt
         tokens its prefix cache lacks + tokens still owed by the requests this
         router sent it; `serving.routing.policy`), its usable prefill engines
         best first, and remote or local prefill (counted with its reason); the
         decode engine is charged for the request until its stream ends (`DecodeCharge`);
      2. remote attempts (a remote decision): the first of those prefill engines
         the directory lists as usable with that decode engine (compatible, pair
         breaker not open: the coordinator's ledger owns the breakers; a half-open
         pair is used only if this router wins its one probe, asked in the background
         while a closed pair can serve: `serving.routing.probes`) runs the prompt and returns a
         `PrefillResult`: the first token, streamed to the client at once, and the
         transfer params the decode engine pulls the KV with; the decode engine
         continues from token two and applies the transfer failure policy itself.
         A prefill that fails because of the engine is reported to the ledger and
         retried once on another prefill engine (`prefill_retries`); one refused
         because of the request is `InvalidRequest`, never retried, never reported;
         the half-open probe (`admit_probe`, within `probe_timeout_s`) is the only
         coordinator call a request may wait for, and only when half-open pairs are
         all it has left: everything else is decided from the router's cached view
         (`serving.routing.directory`), refreshed in the background;
      3. local: a local decision (the uncached prompt is short, the prefill pool
         is saturated), or no (more) usable prefill engine: the decode engine
         prefills itself (`decode_local`) or the request is refused (`reject`);
      4. the caller iterates the returned `RoutedStream`; if its decode engine
         dies mid-stream, the stream migrates (`Migrator`: this router, with the
         planner's decode choice) to another live decode engine (or the restarted
         one, within `migration_wait_s`); closing it early (client disconnect)
         aborts the request on the decode and on the prefill engine.

    Every engine call a client waits for has a deadline derived from its work
    (`serving.routing.deadlines`): a prefill, a stream's first chunk, each later
    chunk. An engine that misses one is treated as hung, like a dead one: the
    attempt fails over (another prefill engine, another decode engine, or the
    stream migrates), the engine gets no new work from this router, and the
    coordinator is told (it probes, evicts and restarts the engine). A request
    that no engine can take now is refused at once (`NoDecodeEngine`: 503).

    Pure asyncio: engines are `EngineClient`s (`serving.routing.pool`) and the
    coordinator a `Directory` (`serving.routing.directory`), so unit tests drive it
    with fakes; `serving.cluster.clients` adapts Ray actor handles. Routing errors
    are `serving.routing.route_errors`; the front maps them to HTTP statuses.
    """

    def __init__(self, prefills: dict[str, EngineClient], decodes: dict[str, EngineClient],
                 directory: Directory, config: RouterConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 resolve_engine: Callable[[str], EngineClient | None] | None = None,
                 planner: RoutePlanner | None = None, pool_status: PoolStatusSource | None = None):
        """Its settings are `config` (`DeploymentConfig.router_config()`); everything else is a
        collaborator: the engines, the directory, the clock, how to reach an engine it adopts, the
        route planner, and where the pools' status comes from."""
        if not decodes:
            raise ValueError("a router needs at least one decode engine")
        self.config = c = (config or RouterConfig()).resolved()
        # one rate model: the engines' own rates from the directory's table, this router's hops and pulls
        rates = RateEstimator(c.slo, clock)
        self.deadlines = EngineDeadlines(c, c.pull_timeout_s, clock, report=self._report_hang, rates=rates)
        self.pool = EnginePool(prefills, decodes, resolve_engine, rates, self.deadlines)
        self.directory = directory
        self.view = DirectoryView(directory, c.directory_ttl_s, clock, on_refresh=self.pool.sync)
        self.clock = clock
        self.planner = planner or planner_for(self.config)
        # half-open pairs' probes: asked off the request path, held well within the ledger's window
        self.probes = ProbeGrants(lambda d, p: self.directory.admit_probe(d, p), c.probe_timeout_s, c.probe_hold_s,
                                  clock)
        self._rr = itertools.count()
        self._states: tuple[RouteTable | None, dict[str, dict[str, BreakerState]]] = (None, {})
        # the pools' status (the autoscaler's, when one runs), asked with the engine stats and shown beside them
        self.pool_status_source = pool_status
        self.pool_status: object | None = None  # its last answer (None: no source, or it did not answer)

    async def routes(self, force: bool = False) -> RouteTable:
        return await self.view.routes(force)

    # ----------------------------------------------------------- selection
    async def pick_prefill(self, decode_id: str, routes: RouteTable, ranked: tuple[str, ...],
                           exclude: set[str]) -> str | None:
        """The first of `ranked` (the plan's order) that is usable and not excluded: a closed pair, or
        a half-open one whose probe this router holds (`serving.routing.probes`: asked in the
        background when a closed pair ranked after it serves this request). With no closed pair at
        all, the request waits to win a half-open pair's probe, within `probe_timeout_s`."""
        states = self._states_of(decode_id, routes)
        half_open = []
        for p in ranked:
            if p not in states or p not in self.pool.prefills or p in exclude:
                continue
            if states[p] == BreakerState.CLOSED or self.probes.take(decode_id, p):
                return p
            half_open.append(p)
            self.probes.ask_later(decode_id, p)
        for p in half_open:
            if await self.probes.ask_now(decode_id, p):
                return p
        return None

    def _states_of(self, decode_id: str, routes: RouteTable) -> dict[str, BreakerState]:
        """Prefill engine -> breaker state of the pair with `decode_id`, kept per table (not per request)."""
        if self._states[0] is not routes:
            self._states = (routes, {})
        states = self._states[1].get(decode_id)
        if states is None:
            states = self._states[1][decode_id] = {r.prefill_id: r.state for r in routes.decodes.get(decode_id, ())}
        return states

    # ------------------------------------------------------------- serving
    async def open(self, req: EngineRequest) -> RoutedStream:
        """Route `req`; returns its stream once the first chunk is known.

        Raises a `RoutingError` when the request cannot be served; nothing is left
        running on any engine in that case.
        """
        estimate = req.num_prompt_tokens  # the front tokenized the prompt: a real count
        self.pool.counters[RouterCounter.REQUESTS] += 1
        routes = await self.routes()
        failed_decodes: set[str] = set()
        while True:
            plan = self.planner.plan(self.pool, req, routes, next(self._rr), failed_decodes)
            if plan is None:
                self.pool.counters[RouterCounter.REJECTED_NO_DECODE] += 1
                hung = self.deadlines.suspected_in(routes.generations)
                raise NoDecodeEngine("no decode engine is available" + (
                    f" (missed their deadlines, treated as hung: {', '.join(sorted(hung))})" if hung else "") + (
                    f" (directory: {self.view.error})" if self.view.error else ""))
            decode_id = plan.decode_id
            route = Route(decode_id, decode_generation=routes.generations.get(decode_id))
            try:
                with self.pool.charge_decode(decode_id, estimate + req.max_tokens) as charge:
                    if plan.decision.remote:
                        stream = await self._remote_attempts(route, req, routes, plan, estimate, charge)
                        if stream is not None:
                            return stream
                    return await self._local(route, req, plan, charge)
            except EngineUnavailable as exc:  # the decode engine died before any output: another one
                logger.warning("%s: decode engine %s unavailable before the first token: %s",
                               req.request_id, decode_id, exc)
                failed_decodes.add(decode_id)
                self.view.invalidate()  # the directory will say so; this request does not wait for it

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
                self.pool.counters[RouterCounter.PREFILL_RETRIES] += 1
            engine_req = req.replace(request_id=self._attempt_id(req.request_id, route.attempts))
            route.prefill_id = prefill_id
            out = await self._prefill(route, engine_req, estimate)
            if out is not None:
                return self._continuation(route, req, engine_req, out, charge)
        return None

    async def _local(self, route: Route, req: EngineRequest, plan: RoutePlan, charge: DecodeCharge) -> RoutedStream:
        """The decode engine prefills itself: a local decision, or the fallback."""
        route.prefill_id = None
        if plan.decision.decision == Decision.LOCAL and plan.decision.reason != DecisionReason.NO_PREFILL_ENGINE:
            route.path = "local"
        else:
            reason = FallbackReason.PREFILL_FAILED if route.failures else FallbackReason.NO_PREFILL_ENGINE
            if self.config.no_prefill_fallback != "decode_local":
                self.pool.counters[RouterCounter.REJECTED_NO_PREFILL] += 1
                why = "; ".join(route.failures) or "no compatible prefill engine with a closed breaker"
                raise NoPrefillEngine(f"no prefill engine is available for decode engine {route.decode_id}: {why}")
            route.path = "fallback"
            self.pool.fallbacks[reason] += 1
        engine_req = req.replace(request_id=req.request_id if route.attempts == 0 else f"{req.request_id}-local")
        routed = Stamps.now(Stamps.ROUTED)
        gen = self.pool.decodes[route.decode_id].generate(engine_req)
        d = route.decode_id
        with self._timed_prefill(d, req.num_prompt_tokens) as timing:  # its queue is visible to placement
            first = await self._first_chunk(route, engine_req, gen)
            first = first.replace(stamps=(routed, *first.stamps, Stamps.now(Stamps.ROUTER_IN)))
            timing.ok, timing.stamps = not first.failed_before_output, first.stamps
        if first.failed_before_output:  # a local run has no transfer to fail: the engine failed
            self.pool.close_gen(gen)
            raise EngineFailed(f"decode engine {route.decode_id} failed: {first.error}")
        return RoutedStream(self.pool, self, req, engine_req.request_id, route, gen, first, charge)

    @staticmethod
    def _attempt_id(request_id: str, attempt: int) -> str:
        return request_id if attempt == 1 else f"{request_id}-retry{attempt - 1}"

    async def _prefill(self, route: Route, req: EngineRequest, estimate: int) -> PrefillResult | None:
        """Run the prompt on route.prefill_id; its result, or None after an engine failure (reported)."""
        p, d = route.prefill_id, route.decode_id
        seconds = self.deadlines.prefill_s(p, estimate, queued=self.pool.prefill_load[p].tokens)
        with self._timed_prefill(p, estimate) as timing:
            try:
                routed = Stamps.now(Stamps.ROUTED)
                out = await self.deadlines.within(p, self.view.generation_of(p), "prefill", seconds,
                                                  self.pool.prefills[p].prefill(req))
                out = out.replace(stamps=(routed, *out.stamps, Stamps.now(Stamps.ROUTER_IN)))
                timing.ok, timing.stamps = True, out.stamps
                return out
            except RequestRejected as exc:  # the client's mistake: no retry, no breaker
                raise InvalidRequest(str(exc)) from None
            except asyncio.CancelledError:
                self.pool.abort_prefill(p, req.request_id)
                raise
            except Exception as exc:  # noqa: BLE001 - an engine failure is a failed attempt
                msg = f"prefill engine {p} failed: {exc}"
                logger.warning("%s: %s", req.request_id, msg)
                route.failures.append(msg)
                self.pool.prefill_failures[p] += 1
                self._report_prefill_failure(d, p, str(exc))
                self.pool.abort_prefill(p, req.request_id)
                return None

    @contextlib.contextmanager
    def _timed_prefill(self, engine_id: str, tokens: int) -> Iterator[PrefillTiming]:
        """A prefill on `engine_id` (counted there while it runs); once it produced its first token,
        its stamps give this router's hop to the engine (its local correction: the engine measures
        and publishes its own rates, `serving.routing.rates`)."""
        timing = PrefillTiming()
        with self.pool.prefilling(engine_id, tokens):
            yield timing
        if timing.ok:
            self.pool.rates.observe_hop(engine_id, hop_of(timing.stamps))

    def _report_prefill_failure(self, decode_id: str, prefill_id: str, reason: str) -> None:
        try:
            self.directory.prefill_failed(decode_id, prefill_id, reason)
        except Exception as exc:  # noqa: BLE001 - the ledger being away must not fail the request
            logger.info("reporting a prefill failure of %s: %s", prefill_id, exc)
        self.outcome_reported()

    def _report_hang(self, engine_id: str, generation: int | None, reason: str) -> None:
        """An engine missed a deadline of ours: the coordinator decides (probe, evict, restart)."""
        report = getattr(self.directory, "engine_hung", None)
        if report is not None:
            report(engine_id, generation, reason)

    async def _first_chunk(self, route: Route, req: EngineRequest, gen: AsyncIterator[TokenChunk]) -> TokenChunk:
        """The decode stream's first chunk (within its deadline: a local prefill of the prompt);
        a refusal is `InvalidRequest`, a dead or hung engine `EngineUnavailable`."""
        seconds = self.deadlines.first_chunk_s(route.decode_id, req.num_prompt_tokens, pulls=False)
        try:
            return await self.deadlines.within(route.decode_id, route.decode_generation, "first chunk", seconds,
                                               gen.__anext__())
        except StopAsyncIteration:
            return TokenChunk.error_chunk(req.request_id, "the decode engine ended the stream without output")
        except RequestRejected as exc:
            raise InvalidRequest(str(exc)) from None
        except asyncio.CancelledError:
            self.pool.abort_decode(route.decode_id, req.request_id)
            self.pool.close_gen(gen)
            raise
        except EngineUnavailable:
            self.pool.close_gen(gen)
            raise
        except Exception as exc:  # noqa: BLE001
            self.pool.close_gen(gen)
            raise EngineFailed(f"decode engine {route.decode_id} failed: {exc}", code="engine_unavailable") from None

    def _continuation(self, route: Route, req: EngineRequest, engine_req: EngineRequest, out: PrefillResult,
                      charge: DecodeCharge) -> RoutedStream:
        """A stream whose first chunk is the prefill engine's token; the decode engine goes on
        (and answers a failed pull per its `transfer.failure_policy`)."""
        # the first token's text less what one engine would still hold back (stop strings): the
        # decode engine streams that tail with the next tokens
        first = TokenChunk(engine_req.request_id, out.first_token_ids, out.streamed_text,
                           num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                           logprobs=out.first_logprobs, cumulative_logprob=out.cumulative_logprob,
                           stamps=out.stamps)
        if engine_req.max_tokens <= len(out.first_token_ids) or not out.needs_decode:
            first = first.replace(text=out.first_text, finished=True, finish_reason=out.finish_reason or "length")
            if out.kv_transfer_params:  # nobody will read the KV: release the prefill engine's lease now
                self.pool.abort_prefill(route.prefill_id, engine_req.request_id)
            return RoutedStream(self.pool, self, req, engine_req.request_id, route, no_more_chunks(), first, charge)
        gen = self.pool.decodes[route.decode_id].generate(out.continuation(engine_req))
        return RoutedStream(self.pool, self, req, engine_req.request_id, route, gen, first, charge,
                            awaiting_transfer=True)

    # ------------------------------------------------- Migrator (streams)
    def generation_of(self, engine_id: str) -> int | None:
        return self.view.generation_of(engine_id)

    def outcome_reported(self) -> None:
        self.view.invalidate()

    def answered(self, engine_id: str, token_ids: tuple[int, ...]) -> None:
        self.planner.note_held(engine_id, token_ids)

    async def migration_target(self, failed: dict[str, int | None], request: EngineRequest) -> str | None:
        """A live decode engine for a stream whose engine failed (`failed`: engine -> the
        incarnation that failed), chosen as the planner chooses decode engines: another one at
        once, else a restarted one (a new generation) within `migration_wait_s`."""
        deadline = self.clock() + self.config.migration_wait_s
        delay = 0.1
        while True:
            routes = await self.routes(force=True)
            same = {d for d, gen in failed.items() if d in routes.decodes and routes.generations.get(d) == gen}
            target = self.planner.choose_decode(self.pool, request, routes, next(self._rr), same)
            if target is not None or self.clock() >= deadline:
                return target
            await asyncio.sleep(delay)  # only while no decode engine is up (a failure mode)
            delay = min(delay * 2, 1.0)

    async def drain(self) -> None:
        """Wait for background aborts and the view's refresh in flight (tests, shutdown)."""
        await self.pool.drain()
        await self.probes.drain()
        await self.view.settle()

    # -------------------------------------------------------------- status
    async def readiness(self) -> Readiness:
        """Whether this router can place a request now (the front's `/health`)."""
        return self.readiness_of(await self.routes())

    def readiness_of(self, routes: RouteTable | None) -> Readiness:
        """Readiness as a view of the directory says (`snapshot()` uses the cached one)."""
        routes = routes or RouteTable({})
        hung = tuple(sorted(self.deadlines.suspected_in(routes.generations)))
        return Readiness.of(self.pool, routes, hung, self.config.no_prefill_fallback == "decode_local",
                            self.view.error)

    async def refresh_engine_stats(self, timeout_s: float = 2.0) -> dict[str, EngineStatus]:
        """Every engine's stats, and the routes (breakers) when the cached ones are old."""
        await self.routes()
        stats = await self.pool.refresh_stats(timeout_s)
        if self.pool_status_source is not None:
            try:
                self.pool_status = await asyncio.wait_for(self.pool_status_source.status(), timeout_s)
            except Exception as exc:  # noqa: BLE001 - shown as unavailable, routing goes on
                self.pool_status = None
                logger.info("pool status unavailable: %s", exc)
        return stats

    def snapshot(self) -> RouterSnapshot:
        """For `raypd status` and the metrics collector (breakers: the ledger's)."""
        return RouterSnapshot.of(self.pool, self.view.table or RouteTable({}), self.planner.snapshot(),
                                 self.pool_status, self.readiness_of(self.view.table))
