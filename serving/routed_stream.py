"""A routed request's token stream and the decode-load charge it carries.

Life cycle of a `RoutedStream`:

  created    by the router once the first chunk is known (the prefill
             engine's first token, or the decode engine's first chunk), so
             routing errors surface before any byte reaches the client;
  iterated   chunks come from the decode engine; an engine failure mid-stream
             becomes a final chunk with finish_reason "error";
  finished   the last chunk settles the decode charge; an error also lets the
             prefill side go;
  closed     early (client disconnect): the request is aborted on both engines.

`close()` is synchronous so it is safe in a cancelled task: the aborts it issues
run in the background.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.protocol import TokenChunk

if TYPE_CHECKING:
    from serving.router import Router

logger = logging.getLogger("raypd.router")


class RequestRejected(Exception):
    """The engine refused the request itself (empty prompt, too long...): the client's fault."""


class EngineUnavailable(Exception):
    """The engine could not run the request (died, unreachable, out of capacity)."""


@dataclass
class Load:
    requests: int = 0
    tokens: int = 0


@dataclass
class Route:
    """How a request is served: decode engine, prefill engine (None: local), why."""

    decode_id: str
    prefill_id: str | None = None
    path: str = "pd"  # pd | short | fallback
    attempts: int = 0
    failures: list[str] = field(default_factory=list)


class DecodeCharge:
    """The work a request owes its decode engine: charged on entry, paid back as tokens
    arrive, and refunded in full on exit unless a stream took it over (`hand_over`)."""

    def __init__(self, load: Load, tokens: int):
        self.load, self.owed = load, tokens
        self.open = True
        self.handed_over = False
        load.requests += 1
        load.tokens += tokens

    def __enter__(self) -> "DecodeCharge":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.handed_over:
            self.settle()

    def hand_over(self) -> "DecodeCharge":
        self.handed_over = True
        return self

    def pay(self, tokens: int) -> None:
        paid = min(tokens, self.owed)
        self.owed -= paid
        self.load.tokens = max(0, self.load.tokens - paid)

    def settle(self) -> None:
        """Refund what is still owed and the request slot (once)."""
        if self.open:
            self.open = False
            self.pay(self.owed)
            self.load.requests = max(0, self.load.requests - 1)


async def no_more_chunks() -> AsyncIterator[TokenChunk]:
    return
    yield  # an empty async generator


class RoutedStream:
    """The token deltas of one routed request; iterate it, and close it when done."""

    def __init__(self, router: "Router", request_id: str, engine_request_id: str, route: Route,
                 gen: AsyncIterator[TokenChunk], first: TokenChunk, charge: DecodeCharge):
        self.router, self.request_id, self.engine_request_id = router, request_id, engine_request_id
        self.route = route
        self._gen = gen
        self._pending: TokenChunk | None = first
        self._charge = charge.hand_over()
        self.num_prompt_tokens = first.num_prompt_tokens
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

    async def __anext__(self) -> TokenChunk:
        if self.finished or self.closed:
            raise StopAsyncIteration
        if self._pending is not None:
            chunk, self._pending = self._pending, None
        else:
            try:
                chunk = await self._gen.__anext__()
            except StopAsyncIteration:
                # the engine ended the stream without a final chunk: treat as finished
                chunk = TokenChunk(self.engine_request_id, finished=True, finish_reason="stop")
            except asyncio.CancelledError:
                self.close()
                raise
            except Exception as exc:  # noqa: BLE001 - any engine failure ends this stream, cleanly
                if not isinstance(exc, (EngineUnavailable, RequestRejected)):
                    logger.exception("decode stream of %s failed", self.request_id)
                chunk = TokenChunk.error_chunk(
                    self.engine_request_id, f"decode engine {self.decode_id} failed mid-stream: {exc}",
                    self.num_prompt_tokens)
        self._observe(chunk)
        return chunk

    def _observe(self, chunk: TokenChunk) -> None:
        n = len(chunk.token_ids)
        self.num_generated += n
        if chunk.num_prompt_tokens:
            self.num_prompt_tokens = chunk.num_prompt_tokens
        if n:
            self._charge.pay(n)
        if chunk.finished:
            self.finished = True
            self._release()
            if chunk.failed:
                # the engine ended the request on error; make sure the prefill side lets go too
                self.router.abort_prefill(self.route, self.engine_request_id)

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
            self.router.counters["aborted"] += 1
            self.router.abort_decode(self.decode_id, self.engine_request_id)
            self.router.abort_prefill(self.route, self.engine_request_id)
        self.router.close_gen(self._gen)

    async def aclose(self) -> None:
        self.close()
