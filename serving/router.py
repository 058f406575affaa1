"""The P/D router: which decode engine, which prefill engine, and the handoff between them.

Life cycle of one request (`Router.open`):

  1. the decode engine with the least outstanding work (tokens still owed by
     the requests this router sent it, then request count) is chosen among the
     decode engines the directory (the coordinator) lists as alive;
  2. unless the prompt is short (`short_prompt_tokens`), a prefill engine is
     chosen among those the directory judged compatible with that decode
     engine and whose (decode, prefill) breaker allows traffic, least loaded
     first; it runs the prompt and returns the transfer params;
  3. the decode engine is streamed from with those params; the first chunk
     carries the transfer verdict: `finish_reason == "error"` or
     `recomputed: true` is a transfer failure of that pair, anything else a
     success; both feed the pair's breaker;
  4. a failed attempt (the prefill engine raised, or the decode engine failed
     the transfer before any token) is retried once on another prefill engine
     (`prefill_retries`); when no usable prefill engine is left, the fallback
     decides: `decode_local` (the decode engine prefills itself) or `reject`
     (503). Nothing is retried once a token has been handed to the caller;
  5. the caller iterates the returned `RoutedStream`; closing it early (client
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

logger = logging.getLogger("raypd.router")


# ---------------------------------------------------------------- interfaces
class RequestRejected(Exception):
    """The engine refused the request itself (empty prompt, too long...): the client's fault."""


class EngineUnavailable(Exception):
    """The engine could not run the request (died, unreachable, out of capacity)."""


class RouteError(Exception):
    """The request cannot be served; `status` is the HTTP status the front answers with."""

    def __init__(self, status: int, message: str, type: str = "server_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param


class EngineClient(Protocol):
    engine_id: str

    async def prefill(self, req: dict) -> dict: ...
    def generate(self, req: dict) -> AsyncIterator[dict]: ...
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
    chars_per_token: float = 4.0  # prompt length estimate without a tokenizer

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
            # the synthetic backend tokenizes UTF-8 bytes: one token per byte
            chars_per_token=1.0 if cfg.backend == "synthetic" else 4.0,
        )


def estimate_prompt_tokens(req: dict, chars_per_token: float = 4.0) -> int:
    """Prompt length in tokens: exact for token ids, estimated from text otherwise."""
    if req.get("prompt_token_ids"):
        return len(req["prompt_token_ids"])
    if req.get("messages"):
        text_len = sum(len(str(m.get("content") or "").encode()) + 8 for m in req["messages"])
    else:
        text_len = len(str(req.get("prompt") or "").encode())
    return max(1, math.ceil(text_len / chars_per_token))


@dataclass
class Load:
    requests: int = 0
    tokens: int = 0


# -------------------------------------------------------------------- stream
@dataclass
class Route:
    """How a request is served: decode engine, prefill engine (None: local), why."""

    decode_id: str
    prefill_id: str | None = None
    path: str = "pd"  # pd | short | fallback
    attempts: int = 0
    failures: list[str] = field(default_factory=list)


class RoutedStream:
    """The token deltas of one routed request; iterate it, and close it when done.

    The first chunk was already received when the router handed this out
    (so routing errors surfaced as `RouteError` before any byte reached the
    client). An engine failure mid-stream becomes a final chunk with
    finish_reason "error" - never a retry. `close()` is synchronous so it is
    safe in a cancelled task: the aborts it issues run in the background.
    """

    def __init__(self, router: "Router", request_id: str, engine_request_id: str, route: Route,
                 gen: AsyncIterator[dict], first: dict, max_tokens: int, prompt_estimate: int):
        self.router, self.request_id, self.engine_request_id = router, request_id, engine_request_id
        self.route = route
        self._gen = gen
        self._pending: dict | None = first
        self._owed = prompt_estimate + max_tokens  # what open() charged the decode engine
        self.num_prompt_tokens = int(first.get("num_prompt_tokens") or 0)
        self.num_generated = 0
        self.finished = False
        self.closed = False

    @property
    def decode_id(self) -> str:
        return self.route.decode_id

    @property
    def prefill_id(self) -> str | None:
        return self.route.prefill_id

    def __aiter__(self) -> "RoutedStream":
        return self

    async def __anext__(self) -> dict:
        if self.finished or self.closed:
            raise StopAsyncIteration
        if self._pending is not None:
            chunk, self._pending = self._pending, None
        else:
            try:
                chunk = await self._gen.__anext__()
            except StopAsyncIteration:
                # the engine ended the stream without a final chunk: treat as finished
                chunk = {"request_id": self.engine_request_id, "token_ids": [], "text": "",
                         "finished": True, "finish_reason": "stop"}
            except (EngineUnavailable, RequestRejected) as exc:
                chunk = self._error_chunk(f"decode engine {self.decode_id} failed mid-stream: {exc}")
            except asyncio.CancelledError:
                self.close()
                raise
            except Exception as exc:  # noqa: BLE001 - any engine failure ends this stream, cleanly
                logger.exception("decode stream of %s failed", self.request_id)
                chunk = self._error_chunk(f"decode engine {self.decode_id} failed mid-stream: {exc}")
        self._observe(chunk)
        return chunk

    def _error_chunk(self, message: str) -> dict:
        return {"request_id": self.engine_request_id, "token_ids": [], "text": "", "finished": True,
                "finish_reason": "error", "error": message, "num_prompt_tokens": self.num_prompt_tokens}

    def _observe(self, chunk: dict) -> None:
        n = len(chunk.get("token_ids") or [])
        self.num_generated += n
        if chunk.get("num_prompt_tokens"):
            self.num_prompt_tokens = int(chunk["num_prompt_tokens"])
        if n:
            owed = min(n, self._owed)
            self._owed -= owed
            self.router._charge_decode(self.decode_id, -owed)
        if chunk.get("finished"):
            self.finished = True
            self._release()
            if chunk.get("finish_reason") == "error":
                # the engine ended the request on error; make sure the prefill side lets go too
                self.router._abort_prefill(self.route, self.engine_request_id)

    def _release(self) -> None:
        if not self.closed:
            self.closed = True
            self.router._charge_decode(self.decode_id, -self._owed, requests=-1)
            self._owed = 0

    def close(self) -> None:
        """Stop: if the request had not finished, abort it on both engines."""
        if self.closed:
            return
        unfinished = not self.finished
        self._release()
        if unfinished:
            self.router.counters["aborted"] += 1
            self.router._abort_decode(self.decode_id, self.engine_request_id)
            self.router._abort_prefill(self.route, self.engine_request_id)
        self.router._close_gen(self._gen)

    async def aclose(self) -> None:
        self.close()


async def _no_more() -> AsyncIterator[dict]:
    return
    yield  # an empty async generator


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
        self._rr = itertools.count()
        self._tasks: set[asyncio.Task] = set()

    # ----------------------------------------------------------- directory
    async def routes(self, force: bool = False) -> dict[str, list[str]]:
        """The directory's view, cached for `directory_ttl_s`; a failing directory keeps the last view."""
        now = self.clock()
        if force or self._routes is None or now - self._routes_at >= self.settings.directory_ttl_s:
            try:
                fresh = await self.directory.routes()
                self._routes = {d: list(ps) for d, ps in fresh.items()}
                self._routes_error = None
            except Exception as exc:  # noqa: BLE001 - the directory being away must not crash routing
                self._routes_error = f"{type(exc).__name__}: {exc}"
                logger.warning("directory unavailable, keeping the last view: %s", self._routes_error)
                if self._routes is None:
                    self._routes = {}
            self._routes_at = now
        return self._routes

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
    async def open(self, req: dict, max_tokens: int | None = None) -> RoutedStream:
        """Route `req` (an engine request dict with `request_id`); returns its stream after the first chunk.

        Raises `RouteError` when the request cannot be served; nothing is left
        running on any engine in that case.
        """
        request_id = req["request_id"]
        max_tokens = int(max_tokens if max_tokens is not None else req.get("max_tokens") or 16)
        estimate = estimate_prompt_tokens(req, self.settings.chars_per_token)
        self.counters["requests"] += 1
        routes = await self.routes()
        decode_id = self.pick_decode(routes)
        if decode_id is None:
            self.counters["rejected_no_decode"] += 1
            raise RouteError(503, "no decode engine is available" + (
                f" (directory: {self._routes_error})" if self._routes_error else ""), code="no_decode_engine")
        decode = self.decodes[decode_id]
        route = Route(decode_id)
        self._charge_decode(decode_id, estimate + max_tokens, requests=1)
        charged = True
        try:
            short = self.settings.short_prompt_tokens and estimate < self.settings.short_prompt_tokens
            tried: set[str] = set()
            budget = 1 + self.settings.prefill_retries
            while not short and route.attempts < budget:
                prefill_id = self.pick_prefill(decode_id, routes, tried)
                if prefill_id is None:
                    break
                tried.add(prefill_id)
                route.attempts += 1
                if route.attempts > 1:
                    self.counters["prefill_retries"] += 1
                engine_req_id = request_id if route.attempts == 1 else f"{request_id}-retry{route.attempts - 1}"
                route.prefill_id = prefill_id
                out = await self._prefill(route, {**req, "request_id": engine_req_id}, estimate)
                if out is None:
                    continue  # the prefill failed; its breaker knows; try another engine
                if out.get("first_token_ids") is not None:
                    # The prefill engine sampled the first token: stream it now (TTFT is the
                    # prefill engine's) and let the decode engine continue from token two.
                    charged = False
                    return self._continuation(route, decode, req, out, request_id, engine_req_id,
                                              max_tokens, estimate)
                params = out["kv_transfer_params"]
                stream = await self._start_decode(route, decode, {
                    **req, "request_id": engine_req_id, "kv_transfer_params": params},
                    request_id, max_tokens, estimate)
                if stream is not None:
                    charged = False
                    return stream
            # served locally: a short prompt, or no (more) usable prefill engine
            route.prefill_id = None
            if short:
                route.path = "short"
                self.counters["short_prompt_local"] += 1
            else:
                reason = "prefill_failed" if route.failures else "no_prefill_engine"
                if self.settings.no_prefill_fallback != "decode_local":
                    self.counters["rejected_no_prefill"] += 1
                    why = "; ".join(route.failures) or "no compatible prefill engine with a closed breaker"
                    raise RouteError(503, f"no prefill engine is available for decode engine {decode_id}: {why}",
                                     code="no_prefill_engine")
                route.path = "fallback"
                self.fallbacks[reason] += 1
            engine_req_id = request_id if route.attempts == 0 else f"{request_id}-local"
            stream = await self._start_decode(route, decode, {**req, "request_id": engine_req_id},
                                              request_id, max_tokens, estimate)
            if stream is None:  # a local run has no transfer to fail; an error chunk is final
                raise RouteError(503, f"decode engine {decode_id} failed: {route.failures[-1]}",
                                 code="engine_error")
            charged = False
            return stream
        finally:
            if charged:
                self._charge_decode(decode_id, -(estimate + max_tokens), requests=-1)

    async def _prefill(self, route: Route, req: dict, estimate: int) -> dict | None:
        """Run the prompt on route.prefill_id; its output (transfer params, maybe the first
        token), or None after a failure (recorded)."""
        p, d = route.prefill_id, route.decode_id
        load = self.prefill_load[p]
        load.requests += 1
        load.tokens += estimate
        try:
            out = await self.prefills[p].prefill(req)
            params = out.get("kv_transfer_params") if isinstance(out, dict) else None
            if not params and not (isinstance(out, dict) and out.get("first_token_ids") is not None):
                raise EngineUnavailable(f"prefill engine {p} returned no kv_transfer_params")
            return out
        except RequestRejected as exc:
            raise RouteError(400, str(exc), type="invalid_request_error", code="invalid_prompt") from None
        except asyncio.CancelledError:
            self._abort_prefill(route, req["request_id"])
            raise
        except Exception as exc:  # noqa: BLE001 - an engine failure is a failed attempt
            msg = f"prefill engine {p} failed: {exc}"
            logger.warning("%s: %s", req["request_id"], msg)
            route.failures.append(msg)
            self.prefill_failures[p] += 1
            self.breaker(d, p).record_failure()
            self._abort_prefill(route, req["request_id"])
            return None
        finally:
            load.requests -= 1
            load.tokens -= estimate

    async def _start_decode(self, route: Route, decode: EngineClient, req: dict, request_id: str,
                            max_tokens: int, estimate: int) -> RoutedStream | None:
        """Start the decode; the stream once its first chunk is good, None on a retryable failure.

        The first chunk carries the transfer verdict of a remote prefill (the KV
        is pulled before the first token): it alone feeds the pair's breaker.
        """
        engine_req_id = req["request_id"]
        gen = decode.generate(req)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = {"request_id": engine_req_id, "token_ids": [], "text": "", "finished": True,
                     "finish_reason": "error", "error": "the decode engine ended the stream without output"}
        except RequestRejected as exc:
            self._abort_prefill(route, engine_req_id)
            raise RouteError(400, str(exc), type="invalid_request_error", code="invalid_prompt") from None
        except asyncio.CancelledError:
            self._abort_decode(route.decode_id, engine_req_id)
            self._abort_prefill(route, engine_req_id)
            self._close_gen(gen)
            raise
        except Exception as exc:  # noqa: BLE001
            self._abort_prefill(route, engine_req_id)
            self._close_gen(gen)
            raise RouteError(503, f"decode engine {route.decode_id} failed: {exc}", code="engine_unavailable") from None
        failed = first.get("finish_reason") == "error" and not first.get("token_ids")
        if route.prefill_id is not None:
            if failed or first.get("recomputed"):
                self._record_transfer(route, ok=False)
            else:
                self._record_transfer(route, ok=True)
        if failed:
            route.failures.append(first.get("error") or f"decode engine {route.decode_id} failed the request")
            self._abort_prefill(route, engine_req_id)
            self._close_gen(gen)
            return None
        return RoutedStream(self, request_id, engine_req_id, route, gen, first, max_tokens, estimate)

    def _continuation(self, route: Route, decode: EngineClient, req: dict, out: dict, request_id: str,
                      engine_req_id: str, max_tokens: int, estimate: int) -> RoutedStream:
        """A stream whose first chunk is the prefill engine's token; the decode engine goes on."""
        params = out.get("kv_transfer_params")
        first = {"request_id": engine_req_id, "token_ids": list(out["first_token_ids"]),
                 "text": out.get("first_text") or "", "finished": False, "finish_reason": None,
                 "num_prompt_tokens": int(out.get("num_prompt_tokens") or 0)}
        if max_tokens <= 1 or not params or out.get("finish_reason") == "stop":
            first.update(finished=True, finish_reason=out.get("finish_reason") or "length")
            if params:  # nobody will read the KV: release the prefill engine's lease now
                self._abort_prefill(route, engine_req_id)
            return RoutedStream(self, request_id, engine_req_id, route, _no_more(), first, max_tokens, estimate)
        dreq = {k: v for k, v in req.items() if k not in ("messages", "prompt")}
        dreq.update(request_id=engine_req_id, max_tokens=max_tokens - 1, kv_transfer_params=params,
                    prompt_token_ids=list(out["prompt_token_ids"]) + list(out["first_token_ids"]))
        gen = self._continue_decode(route, decode, dreq)
        return RoutedStream(self, request_id, engine_req_id, route, gen, first, max_tokens, estimate)

    async def _continue_decode(self, route: Route, decode: EngineClient, dreq: dict) -> AsyncIterator[dict]:
        """Decode after a streamed first token; a failed pull continues locally (nothing is lost
        or repeated: the decode engine recomputes the prompt and goes on from token two)."""
        gen = decode.generate(dreq)
        first = await gen.__anext__()
        failed = first.get("finish_reason") == "error" and not first.get("token_ids")
        self._record_transfer(route, ok=not (failed or first.get("recomputed")))
        if failed:
            self.fallbacks["transfer_failed"] += 1
            route.failures.append(first.get("error") or "KV transfer failed")
            self._abort_prefill(route, dreq["request_id"])
            local = {k: v for k, v in dreq.items() if k != "kv_transfer_params"}
            async for chunk in decode.generate(local):
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

    def _charge_decode(self, decode_id: str, tokens: int, requests: int = 0) -> None:
        load = self.decode_load[decode_id]
        load.tokens = max(0, load.tokens + tokens)
        load.requests = max(0, load.requests + requests)

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

    def _abort_decode(self, decode_id: str, engine_req_id: str) -> None:
        self._spawn(self.decodes[decode_id].abort(engine_req_id))

    def _abort_prefill(self, route: Route, engine_req_id: str) -> None:
        if route.prefill_id is not None:
            self._spawn(self.prefills[route.prefill_id].abort(engine_req_id))

    def _close_gen(self, gen: Any) -> None:
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
