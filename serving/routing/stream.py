"""A routed request's token stream and the decode-load charge it carries.

Invariants: a stream exists only once its first chunk is known, so routing errors surface before
any byte reaches the client; a stream whose decode engine dies, hangs or fails mid-stream migrates
from what was already streamed (a greedy stream is token for token the uninterrupted one) and ends
with finish_reason "error" only when no engine takes it; `close()` is synchronous (safe in a
cancelled task) and aborts the request on both engines in the background. The life cycle:
`RoutedStream`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from actors.protocol.request import EngineRequest, TokenChunk
from serving.routing.route_errors import EngineUnavailable, RequestRejected
from serving.routing.pool import DecodeCharge, EnginePool, RouterCounter

logger = logging.getLogger("raypd.router")

MAX_MIGRATIONS = 3


@dataclass
class Route:
    """How a request is served: decode engine, prefill engine (None: local), why."""

    decode_id: str
    prefill_id: str | None = None
    path: str = "pd"  # pd | local | fallback | migrated
    attempts: int = 0
    failures: list[str] = field(default_factory=list)
    decode_generation: int | None = None  # the decode engine's incarnation when chosen


class Migrator(Protocol):
    """What a stream asks of routing when its decode engine fails (the router answers)."""

    async def migration_target(self, failed: dict[str, int | None], request: EngineRequest) -> str | None:
        """A decode engine for the rest of `request` (`failed`: engine -> the incarnation that failed),
        chosen by the same policy as a first placement; None when none came in time."""
        ...

    def generation_of(self, engine_id: str) -> int | None: ...

    def outcome_reported(self) -> None:
        """A failure that may move a pair's breaker was seen: the next request asks the directory."""
        ...

    def answered(self, engine_id: str, token_ids: tuple[int, ...]) -> None:
        """`engine_id` finished a stream; its prefix cache holds `token_ids` (prompt + answer but its last token)."""
        ...


async def no_more_chunks() -> AsyncIterator[TokenChunk]:
    return
    yield  # an empty async generator


class RoutedStream:
    """The token deltas of one routed request; iterate it, and close it when done.

    Life cycle of a `RoutedStream`:

      created    by the router once the first chunk is known (the prefill
                 engine's first token, or the decode engine's first chunk), so
                 routing errors surface before any byte reaches the client;
      iterated   chunks come from the decode engine; the first decode chunk of a
                 P/D stream carries the transfer verdict (recomputed, or the error
                 of the `fail` policy: the stream ends there);
      migrated   the decode engine died, hung (missed a chunk's deadline:
                 `serving.routing.deadlines`) or failed the request mid-stream: the
                 stream continues on another live decode engine, or on the
                 restarted one within `migration_wait_s`, from what was already
                 streamed (prompt + generated token ids, `num_resumed_tokens`), so
                 a greedy stream is token for token the uninterrupted one; only
                 when no engine takes it does it end with finish_reason "error";
      finished   the last chunk settles the decode charge; an error also lets the
                 prefill side go;
      closed     early (client disconnect): the request is aborted on both engines.

    `close()` is synchronous so it is safe in a cancelled task: the aborts it issues
    run in the background.
    """

    def __init__(self, pool: EnginePool, migrator: Migrator, request: EngineRequest, engine_request_id: str,
                 route: Route, gen: AsyncIterator[TokenChunk], first: TokenChunk, charge: DecodeCharge,
                 awaiting_transfer: bool = False):
        self.pool, self.migrator = pool, migrator
        self.request, self.engine_request_id = request, engine_request_id
        self.request_id = request.request_id
        self.prefill_request_id = engine_request_id  # the prefill engine knows the request by this id
        self.route = route
        self._gen = gen
        self._pending: TokenChunk | None = first
        self.first_stamps = first.stamps  # the hops of the first token (actors.protocol.request.Stamps)
        self._charge = charge.hand_over()
        self.token_ids: list[int] = []  # every token streamed so far
        self.num_prompt_tokens = first.num_prompt_tokens
        # prompt tokens the engine that ran the prompt found in its prefix cache (vLLM; the first chunk
        # comes from that engine: the prefill engine's token, or the decode engine's local prefill)
        self.num_cached_tokens = first.num_cached_tokens
        self.num_generated = 0
        self.migrations = 0
        self._awaiting_transfer = awaiting_transfer  # the next decode chunk carries the transfer verdict
        self._last_at: float | None = None  # when the previous chunk arrived (the pull after a prefill is learned)
        self._prefill_let_go = False
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

    async def __anext__(self) -> TokenChunk:
        if self.finished or self.closed:
            raise StopAsyncIteration
        if self._pending is not None:
            chunk, self._pending = self._pending, None
            self._last_at = self.pool.rates.clock()
            self._observe(chunk)
            return chunk
        deadlines = self.pool.deadlines
        decode_id = self.decode_id
        if self._awaiting_transfer:  # the KV pull (or its recompute) and one step
            call, seconds = "first chunk", deadlines.first_chunk_s(decode_id, self.num_prompt_tokens, pulls=True)
        else:
            call, seconds = "token", deadlines.token_s(decode_id)
        try:
            chunk = await deadlines.within(decode_id, self.route.decode_generation, call, seconds,
                                           self._gen.__anext__())
        except StopAsyncIteration:
            # the engine ended the stream without a final chunk: treat as finished
            chunk = TokenChunk(self.engine_request_id, finished=True, finish_reason="stop")
        except asyncio.CancelledError:
            self.close()
            raise
        except RequestRejected as exc:  # the continuation itself was refused: no engine will take it
            chunk = TokenChunk.error_chunk(self.engine_request_id, str(exc), self.num_prompt_tokens)
        except Exception as exc:  # noqa: BLE001 - the decode engine failed: move the stream
            if not isinstance(exc, EngineUnavailable):
                logger.exception("decode stream of %s failed", self.request_id)
            chunk = await self._migrate(exc)
        self._learn(chunk)
        if self._awaiting_transfer:
            self._transfer_verdict(chunk)
        self._observe(chunk)
        return chunk

    def _learn(self, chunk: TokenChunk) -> None:
        """What this chunk's wait says that only this router sees: the first decode chunk after a
        prefill is the pair's pull plus one step (the decode engine measures its steps itself); after
        a failed pull, the failed wait plus the recompute: what choosing the pair cost."""
        now, last, self._last_at = self.pool.rates.clock(), self._last_at, self.pool.rates.clock()
        d = self.decode_id
        if last is None or not chunk.token_ids or chunk.failed or not self._awaiting_transfer:
            return
        if self.prefill_id is not None:
            rates = self.pool.rates
            batch = self.pool.decode_load[d].requests if d in self.pool.decode_load else 1
            step = rates.rates(d).decode_step_s(max(batch, rates.rates(d).decode_streams))
            if chunk.recomputed:
                rates.observe_failed_transfer(self.prefill_id, d, now - last - step)
            else:
                rates.observe_transfer(self.prefill_id, d, self.num_prompt_tokens, now - last - step)

    def _transfer_verdict(self, chunk: TokenChunk) -> None:
        """The first decode chunk after a prefill: counted as the router saw it (the ledger
        has the engines' own reports); a failed pull lets the prefill side go at once."""
        self._awaiting_transfer = False
        if chunk.recomputed or chunk.failed_before_output:
            self.pool.transfer_failures[(self.decode_id, self.prefill_id)] += 1
            self._let_prefill_go()
            self.migrator.outcome_reported()
        if chunk.recomputed:
            self.pool.counters[RouterCounter.RECOMPUTED] += 1

    async def _migrate(self, exc: Exception) -> TokenChunk:
        """Continue on another live decode engine from what was streamed; the first chunk
        there, or an error chunk when no engine takes the stream."""
        reason = ("engine_hung" if getattr(exc, "hung", False) else
                  "engine_died" if getattr(exc, "died", False) else "engine_error")
        dead = self.decode_id
        self._last_at = None  # the next engine's first chunk recomputes the stream: no gap to learn
        failed = {dead: self.route.decode_generation}  # engines (incarnations) that let this stream down
        self.pool.abort_decode(dead, self.engine_request_id)  # if it is still alive, let it go
        self.pool.close_gen(self._gen)
        self._let_prefill_go()  # the next engine recomputes: nobody will read the prefill's KV
        self._awaiting_transfer = False
        remaining = self.request.max_tokens - len(self.token_ids)
        while remaining > 0 and self.migrations < MAX_MIGRATIONS:
            req = self.request.replace(
                request_id=f"{self.request_id}-m{self.migrations + 1}", kv_transfer_params=None,
                prompt_token_ids=self.request.prompt_token_ids + tuple(self.token_ids),
                num_resumed_tokens=len(self.token_ids),
            ).with_max_tokens(remaining)
            target = await self.migrator.migration_target(failed, req)
            if target is None:
                break
            self.migrations += 1
            self._charge.settle()
            self._charge = self.pool.charge_decode(target, remaining)
            self.route.decode_id, self.route.path = target, "migrated"
            self.route.decode_generation = self.migrator.generation_of(target)
            self.engine_request_id = req.request_id
            self._gen = self.pool.decodes[target].generate(req)
            seconds = self.pool.deadlines.first_chunk_s(target, len(req.prompt_token_ids), pulls=False)
            try:
                first = await self.pool.deadlines.within(target, self.route.decode_generation, "first chunk",
                                                         seconds, self._gen.__anext__())
            except (StopAsyncIteration, RequestRejected) as err:
                return TokenChunk.error_chunk(self.engine_request_id, f"migration to {target} failed: {err}",
                                              self.num_prompt_tokens)
            except EngineUnavailable as err:
                logger.warning("%s: migration target %s failed too: %s", self.request_id, target, err)
                failed[target] = self.route.decode_generation
                continue
            self.pool.migrations[reason] += 1
            logger.warning("%s: decode engine %s failed (%s); continued on %s after %d tokens",
                           self.request_id, dead, type(exc).__name__, target, len(self.token_ids))
            return first
        self.pool.counters[RouterCounter.MIGRATION_FAILED] += 1
        return TokenChunk.error_chunk(
            self.engine_request_id, f"decode engine {dead} failed mid-stream and no engine could take the "
            f"stream over: {exc}", self.num_prompt_tokens)

    def _observe(self, chunk: TokenChunk) -> None:
        n = len(chunk.token_ids)
        self.num_generated += n
        self.token_ids.extend(chunk.token_ids)
        if chunk.num_prompt_tokens:
            self.num_prompt_tokens = chunk.num_prompt_tokens
        if n:
            self._charge.pay(n)
        if chunk.finished:
            self.finished = True
            self._release()
            if chunk.failed:
                # the engine ended the request on error; make sure the prefill side lets go too
                self._let_prefill_go()
            else:  # the next turn of this conversation finds it there at once (the last token has no KV yet)
                self.migrator.answered(self.decode_id, self.request.prompt_token_ids + tuple(self.token_ids[:-1]))

    def _let_prefill_go(self) -> None:
        """Release the prefill engine's blocks of this request (once; a no-op once read)."""
        if not self._prefill_let_go:
            self._prefill_let_go = True
            self.pool.abort_prefill(self.route.prefill_id, self.prefill_request_id)

    def _release(self) -> None:
        if not self.closed:
            self.closed = True
            self._charge.settle()

    def close(self) -> None:
        """Stop: if the request had not finished, abort it on both engines."""
        if self.closed:
            return
        unfinished = not self.finished
        self._release()
        if unfinished:
            self.pool.counters[RouterCounter.ABORTED] += 1
            self.pool.abort_decode(self.decode_id, self.engine_request_id)
            self._let_prefill_go()
        self.pool.close_gen(self._gen)

    async def aclose(self) -> None:
        self.close()
