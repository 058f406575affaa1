"""The P/D router: which decode engine, which prefill engine, and the handoff between them.

Life cycle of one request (`Router.open`):

  1. select: the decode engine with the least outstanding work (tokens still
     owed by the requests this router sent it, then request count) among the
     decode engines the directory (the coordinator) lists as alive; it is
     charged for the request until its stream ends (`DecodeCharge`);
  2. remote attempts: unless the prompt is short (`short_prompt_tokens`), a
     prefill engine is chosen among those the directory judged compatible
     with that decode engine and whose (decode, prefill) breaker allows
     traffic, least loaded first; it runs the prompt and returns a
     `PrefillResult`: the first token, streamed to the client at once, and
     the transfer params the decode engine pulls the KV with; the decode
     engine continues from token two. A failed prefill is retried once on
     another prefill engine (`prefill_retries`);
  3. local fallback: a short prompt, or no (more) usable prefill engine: the
     decode engine prefills itself (`decode_local`) or the request is refused
     (`reject`, 503);
  4. the caller iterates the returned `RoutedStream`; closing it early (client
     disconnect) aborts the request on the decode and on the prefill engine.

Pure asyncio: engines are `EngineClient`s and the coordinator a `Directory`, so
unit tests drive it with fakes; `serving.ray_clients` adapts Ray actor handles.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.kv.breaker import CircuitBreaker
from actors.protocol import EngineRequest, PrefillResult, TokenChunk
from serving.routed_stream import (
    DecodeCharge,
    EngineUnavailable,
    Load,
    RequestRejected,
    Route,
    RoutedStream,
    no_more_chunks,
)

__all__ = ["EngineUnavailable", "RequestRejected", "RouteError", "Router", "RouterSettings", "RoutedStream"]

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
    async def routes(self) -> dict[str, list[str]]:
        """Every live decode engine -> the live prefill engines judged compatible with it."""
        ...


# ------------------------------------------------------------------ settings
@dataclass(frozen=True)
class RouterSettings:
    short_prompt_tokens: int = 0
    no_prefill_fallback: str = "decode_local"  # or "reject"
    prefill_retries: int = 1
    breaker_failure_threshold: int = 3
    breaker_cooldown_s: float = 10.0
    breaker_probe_window_s: float = 5.0
    directory_ttl_s: float = 1.0

    @classmethod
    def from_config(cls, cfg: Any) -> "RouterSettings":
        """From a `serving.config.DeploymentConfig`."""
        return cls(
            short_prompt_tokens=cfg.router.short_prompt_tokens,
            no_prefill_fallback=cfg.router.no_prefill_fallback,
            prefill_retries=cfg.router.prefill_retries,
            breaker_failure_threshold=cfg.breaker.failure_threshold,
            breaker_cooldown_s=cfg.breaker.cooldown_s,
            breaker_probe_window_s=cfg.breaker.probe_window_s,
        )


# -------------------------------------------------------------------- router
class Router:
    def __init__(self, prefills: dict[str, EngineClient], decodes: dict[str, EngineClient],
                 directory: Directory, settings: RouterSettings | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not decodes:
            raise ValueError("a router needs at least one decode engine")
        self.prefills, self.decodes = dict(prefills), dict(decodes)
        self.directory = directory
        self.settings = settings or RouterSettings()
        self.clock = clock
        self.breakers: dict[tuple[str, str], CircuitBreaker] = {}
        self.decode_load: dict[str, Load] = {d: Load() for d in self.decodes}
        self.prefill_load: dict[str, Load] = {p: Load() for p in self.prefills}
        self.counters: Counter[str] = Counter()  # requests, fallbacks, retries, aborted...
        self.fallbacks: Counter[str] = Counter()  # reason -> count
        self.transfer_failures: Counter[tuple[str, str]] = Counter()  # (decode, prefill)
        self.prefill_failures: Counter[str] = Counter()  # prefill id
        self.engine_stats: dict[str, dict] = {}
        self._routes: dict[str, list[str]] | None = None
        self._routes_at = -math.inf
        self._routes_error: str | None = None
        self._refreshing = False
        self._rr = itertools.count()
        self._tasks: set[asyncio.Task] = set()

    # ----------------------------------------------------------- directory
    async def routes(self, force: bool = False) -> dict[str, list[str]]:
        """The directory's view, cached for `directory_ttl_s`; a failing directory keeps the last view.

        Only the first lookup (or `force`) waits for the directory: an expired view is served
        as is while one refresh runs in the background, so no request pays the coordinator's
        round trips on its way to the first token.
        """
        if force or self._routes is None:
            await self._refresh_routes()
        elif self.clock() - self._routes_at >= self.settings.directory_ttl_s and not self._refreshing:
            self._refreshing = True
            self._spawn(self._refresh_routes())
        return self._routes

    async def _refresh_routes(self) -> None:
        try:
            fresh = await self.directory.routes()
            self._routes = {d: list(ps) for d, ps in fresh.items()}
            self._routes_error = None
        except Exception as exc:  # noqa: BLE001 - the directory being away must not crash routing
            self._routes_error = f"{type(exc).__name__}: {exc}"
            logger.warning("directory unavailable, keeping the last view: %s", self._routes_error)
            if self._routes is None:
                self._routes = {}
        finally:
            self._routes_at = self.clock()
            self._refreshing = False

    def breaker(self, decode_id: str, prefill_id: str) -> CircuitBreaker:
        key = (decode_id, prefill_id)
        b = self.breakers.get(key)
        if b is None:
            s = self.settings
            b = self.breakers[key] = CircuitBreaker(
                f"{prefill_id}->{decode_id}", cooldown_s=s.breaker_cooldown_s,
                failure_threshold=s.breaker_failure_threshold, probe_window_s=s.breaker_probe_window_s,
                clock=self.clock,
            )
        return b

    # ----------------------------------------------------------- selection
    def live_decodes(self, routes: dict[str, list[str]]) -> list[str]:
        return [d for d in self.decodes if d in routes]

    def usable_prefills(self, decode_id: str, routes: dict[str, list[str]],
                        exclude: set[str] = frozenset()) -> list[str]:
        """Compatible, known, not excluded, breaker not open; least loaded first."""
        ids = [p for p in routes.get(decode_id, []) if p in self.prefills and p not in exclude
               and not self.breaker(decode_id, p).is_open]
        return sorted(ids, key=lambda p: (self.prefill_load[p].requests, self.prefill_load[p].tokens))

    def pick_decode(self, routes: dict[str, list[str]]) -> str | None:
        live = self.live_decodes(routes)
        if not live:
            return None
        turn = next(self._rr)
        # least outstanding tokens, then fewest requests, then round robin among equals
        return min(live, key=lambda d: (self.decode_load[d].tokens, self.decode_load[d].requests,
                                        (list(self.decodes).index(d) - turn) % len(self.decodes)))

    def pick_prefill(self, decode_id: str, routes: dict[str, list[str]], exclude: set[str]) -> str | None:
        for p in self.usable_prefills(decode_id, routes, exclude):
            if self.breaker(decode_id, p).allow():  # admits a half-open probe at most once
                return p
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
        decode_id = self.pick_decode(routes)
        if decode_id is None:
            self.counters["rejected_no_decode"] += 1
            raise RouteError(503, "no decode engine is available" + (
                f" (directory: {self._routes_error})" if self._routes_error else ""), code="no_decode_engine")
        route = Route(decode_id)
        with DecodeCharge(self.decode_load[decode_id], estimate + req.max_tokens) as charge:
            short = bool(self.settings.short_prompt_tokens) and estimate < self.settings.short_prompt_tokens
            if not short:
                stream = await self._remote_attempts(route, req, routes, estimate, charge)
                if stream is not None:
                    return stream
            return await self._local(route, req, short, charge)

    async def _remote_attempts(self, route: Route, req: EngineRequest, routes: dict[str, list[str]],
                               estimate: int, charge: DecodeCharge) -> RoutedStream | None:
        """Prefill on a usable prefill engine (retried once elsewhere); None when none succeeded."""
        tried: set[str] = set()
        while route.attempts < 1 + self.settings.prefill_retries:
            prefill_id = self.pick_prefill(route.decode_id, routes, tried)
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
                return self._continuation(route, engine_req, out, req.request_id, charge)
        return None

    async def _local(self, route: Route, req: EngineRequest, short: bool, charge: DecodeCharge) -> RoutedStream:
        """The decode engine prefills itself: a short prompt, or the fallback."""
        route.prefill_id = None
        if short:
            route.path = "short"
            self.counters["short_prompt_local"] += 1
        else:
            reason = "prefill_failed" if route.failures else "no_prefill_engine"
            if self.settings.no_prefill_fallback != "decode_local":
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
        return RoutedStream(self, req.request_id, engine_req.request_id, route, gen, first, charge)

    @staticmethod
    def _attempt_id(request_id: str, attempt: int) -> str:
        return request_id if attempt == 1 else f"{request_id}-retry{attempt - 1}"

    async def _prefill(self, route: Route, req: EngineRequest, estimate: int) -> PrefillResult | None:
        """Run the prompt on route.prefill_id; its result, or None after a failure (recorded)."""
        p, d = route.prefill_id, route.decode_id
        load = self.prefill_load[p]
        load.requests += 1
        load.tokens += estimate
        try:
            return await self.prefills[p].prefill(req)
        except RequestRejected as exc:
            raise RouteError(400, str(exc), type="invalid_request_error", code="invalid_prompt") from None
        except asyncio.CancelledError:
            self.abort_prefill(route, req.request_id)
            raise
        except Exception as exc:  # noqa: BLE001 - an engine failure is a failed attempt
            msg = f"prefill engine {p} failed: {exc}"
            logger.warning("%s: %s", req.request_id, msg)
            route.failures.append(msg)
            self.prefill_failures[p] += 1
            self.breaker(d, p).record_failure()
            self.abort_prefill(route, req.request_id)
            return None
        finally:
            load.requests -= 1
            load.tokens -= estimate

    async def _first_chunk(self, route: Route, req: EngineRequest, gen: AsyncIterator[TokenChunk]) -> TokenChunk:
        """The decode stream's first chunk; engine errors before it become a `RouteError`."""
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
        except Exception as exc:  # noqa: BLE001
            self.close_gen(gen)
            raise RouteError(503, f"decode engine {route.decode_id} failed: {exc}", code="engine_unavailable") from None

    def _continuation(self, route: Route, req: EngineRequest, out: PrefillResult, client_id: str,
                      charge: DecodeCharge) -> RoutedStream:
        """A stream whose first chunk is the prefill engine's token; the decode engine goes on."""
        first = TokenChunk(req.request_id, out.first_token_ids, out.first_text,
                           num_prompt_tokens=out.num_prompt_tokens)
        if req.max_tokens <= len(out.first_token_ids) or not out.needs_decode:
            first = first.replace(finished=True, finish_reason=out.finish_reason or "length")
            if out.kv_transfer_params:  # nobody will read the KV: release the prefill engine's lease now
                self.abort_prefill(route, req.request_id)
            return RoutedStream(self, client_id, req.request_id, route, no_more_chunks(), first, charge)
        gen = self._continue_decode(route, self.decodes[route.decode_id], out.continuation(req))
        return RoutedStream(self, client_id, req.request_id, route, gen, first, charge)

    async def _continue_decode(self, route: Route, decode: EngineClient, dreq: EngineRequest
                               ) -> AsyncIterator[TokenChunk]:
        """Decode after a streamed first token; a failed pull continues locally (nothing is lost
        or repeated: the decode engine recomputes the prompt and goes on from token two)."""
        gen = decode.generate(dreq)
        first = await gen.__anext__()
        self._record_transfer(route, ok=not (first.failed_before_output or first.recomputed))
        if first.failed_before_output:
            self.fallbacks["transfer_failed"] += 1
            route.failures.append(first.error or "KV transfer failed")
            self.abort_prefill(route, dreq.request_id)
            async for chunk in decode.generate(dreq.replace(kv_transfer_params=None)):
                yield chunk
            return
        yield first
        async for chunk in gen:
            yield chunk

    # ------------------------------------------------------------ outcomes
    def _record_transfer(self, route: Route, ok: bool) -> None:
        b = self.breaker(route.decode_id, route.prefill_id)
        if ok:
            b.record_success()
        else:
            self.transfer_failures[(route.decode_id, route.prefill_id)] += 1
            b.record_failure()

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
        self._spawn(self.decodes[decode_id].abort(engine_req_id))

    def abort_prefill(self, route: Route, engine_req_id: str) -> None:
        if route.prefill_id is not None:
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
        local_ok = bool(live) and (self.settings.no_prefill_fallback == "decode_local" or not self.prefills)
        healthy = any(pd_paths.values()) or local_ok
        reason = None
        if not live:
            reason = "no decode engine is alive"
        elif not healthy:
            reason = "no compatible prefill engine with a closed breaker, and the fallback is reject"
        return {"healthy": healthy, "reason": reason, "decode_engines": live,
                "pd_paths": {d: ps for d, ps in pd_paths.items()}, "decode_local": local_ok,
                "directory_error": self._routes_error}

    async def refresh_engine_stats(self, timeout_s: float = 2.0) -> dict[str, dict]:
        engines = {**self.prefills, **self.decodes}

        async def one(eid: str, eng: EngineClient) -> tuple[str, dict]:
            try:
                return eid, {"up": True, **await asyncio.wait_for(eng.stats(), timeout_s)}
            except Exception as exc:  # noqa: BLE001 - a dead engine is a status, not an error
                return eid, {"up": False, "error": f"{type(exc).__name__}: {exc}"}

        results = await asyncio.gather(*(one(e, h) for e, h in engines.items()))
        self.engine_stats = dict(results)
        return self.engine_stats

    def snapshot(self) -> dict:
        """Plain-dict view for `raypd status` and the metrics collector."""
        return {
            "decode_load": {d: vars(load).copy() for d, load in self.decode_load.items()},
            "prefill_load": {p: vars(load).copy() for p, load in self.prefill_load.items()},
            "breakers": {f"{p}->{d}": b.snapshot() for (d, p), b in self.breakers.items()},
            "counters": dict(self.counters),
            "fallbacks": dict(self.fallbacks),
            "transfer_failures": {f"{p}->{d}": n for (d, p), n in self.transfer_failures.items()},
            "prefill_failures": dict(self.prefill_failures),
            "routes": self._routes or {},
        }
