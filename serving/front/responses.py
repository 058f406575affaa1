"""OpenAI response shapes: SSE chunks (ending with `data: [DONE]`) or one JSON answer.

Both paths end in `RequestTicket.settle()`: the SSE response calls it when the
body is done or the client vanished (`SSEResponse.on_close`), the JSON path
in the route's `finally`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from actors.protocol.request import Stamps
from serving.front.accounting import RequestTicket
from serving.front.http_errors import ApiError, error_body
from serving.front.prepare import PreparedRequest
from serving.front.trace import RequestTrace

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj).encode() + b"\n\n"


_TEXT_SLOT = "\x00raypd-text\x00"  # a string no JSON encoder leaves as it is


class _TextEvent:
    """The SSE event of a plain text delta, encoded once per request: prefix + the text as JSON +
    suffix is byte for byte what `_sse(shapes.chunk(text, None))` gives, for a tenth of its work."""

    def __init__(self, shapes: "Shapes"):
        whole = _sse(shapes.chunk(_TEXT_SLOT, None))
        prefix, _, suffix = whole.partition(_encode(_TEXT_SLOT).encode())
        self.prefix, self.suffix = prefix, suffix

    def __call__(self, text: str) -> bytes:
        return self.prefix + _encode(text).encode() + self.suffix


class Shapes:
    """The chunk and answer objects of one request."""

    def __init__(self, prep: PreparedRequest, model: str):
        self.prep, self.model = prep, model
        self.rid = prep.engine_request.request_id
        self.created = int(time.time())
        self.chat = prep.kind == "chat"

    def chunk(self, text: str | None, finish_reason: str | None, token_ids: tuple[int, ...] = (),
              role: bool = False, usage: dict | None = None, first: bool = False) -> dict:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        out = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if self.prep.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if first:
                ids = list(self.prep.engine_request.prompt_token_ids)
                (out if self.chat else choice)["prompt_token_ids"] = ids
        if usage is not None:
            out["usage"] = usage
        return out

    def answer(self, text: str, finish_reason: str | None, token_ids: list[int], usage: dict) -> dict:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        out = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
               "usage": usage}
        if self.prep.return_token_ids:
            choice["token_ids"] = token_ids
            (out if self.chat else choice)["prompt_token_ids"] = list(self.prep.engine_request.prompt_token_ids)
        return out


async def sse_events(shapes: Shapes, ticket: RequestTicket) -> AsyncIterator[bytes]:
    """One body write per routed chunk as it arrives (a chunk holds every token the consumer had
    not taken yet: `TokenChunk.merge`). The chunks have the shape of vLLM's own server: the finish
    reason rides on the last chunk's tokens (no empty finish chunk after them), and that event, the
    usage and `[DONE]` go together."""
    prep, stream = shapes.prep, ticket.stream
    first = True
    # plain text deltas (no token ids, no per-chunk usage): the pre-encoded event
    fast = None if prep.return_token_ids or prep.continuous_usage else _TextEvent(shapes)
    try:
        if shapes.chat:
            usage = ticket.usage(details=False) if prep.continuous_usage else None
            yield _sse(shapes.chunk("", None, role=True, usage=usage, first=True))
            first = False
        async for chunk in stream:
            ticket.observe(chunk)
            if ticket.error is not None:
                yield _sse(error_body(ticket.error, "server_error", None, "engine_error")) + b"data: [DONE]\n\n"
                return
            if not chunk.finished:
                if chunk.text or chunk.token_ids:
                    if fast is not None and not first:
                        yield fast(chunk.text)
                    else:
                        usage = ticket.usage(details=False) if prep.continuous_usage else None
                        yield _sse(shapes.chunk(chunk.text, None, chunk.token_ids, usage=usage, first=first))
                    first = False
                continue
            # the last chunk: its tokens (none when the stream ended without one) and the finish reason
            usage = ticket.usage(details=False) if prep.continuous_usage else None
            yield (_sse(shapes.chunk(chunk.text, ticket.finish_reason, chunk.token_ids, usage=usage, first=first))
                   + _tail(shapes, ticket))
            return
        yield _tail(shapes, ticket)
    finally:
        ticket.settle()


def _tail(shapes: Shapes, ticket: RequestTicket) -> bytes:
    """The usage chunk (when asked for) and `[DONE]`."""
    out = b""
    if shapes.prep.include_usage and ticket.error is None:
        last = shapes.chunk(None, None, usage=ticket.usage())
        last["choices"] = []
        out = _sse(last)
    return out + b"data: [DONE]\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(shapes: Shapes, ticket: RequestTicket, request: Request) -> dict | None:
    """The whole answer; None when the client went away first (the request is aborted)."""
    parts: list[str] = []
    token_ids: list[int] = []

    async def drain() -> None:
        async for chunk in ticket.stream:
            ticket.observe(chunk)
            parts.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            if chunk.finished:
                break

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            if not t.done():
                t.cancel()
    if not work.done() or work.cancelled():
        return None
    work.result()
    if ticket.error is not None:
        raise ApiError(503, ticket.error, type="server_error", code="engine_error", headers={"Retry-After": "1"})
    return shapes.answer("".join(parts), ticket.finish_reason, token_ids, ticket.usage())


class SSEResponse(StreamingResponse):
    """A StreamingResponse whose `on_close` always runs, even when the client vanished mid-stream.

    Starlette cancels the body iterator when the client disconnects; the
    iterator's own `finally` may then run late (at garbage collection).
    `on_close` is synchronous: it closes the routed stream, which aborts the
    request on both engines in the background.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], trace: RequestTrace | None = None,
                 **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close
        self._trace = trace  # shown in a header (or None)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            if self._trace is not None:
                self._trace.mark(Stamps.SSE)
                self.raw_headers.append(self._trace.header())
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def json_response(obj: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(_encode(obj), status_code=status, media_type="application/json", headers=headers)
