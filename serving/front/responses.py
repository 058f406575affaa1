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

from serving.front.accounting import RequestTicket
from serving.front.errors import ApiError, error_body
from serving.front.prepare import PreparedRequest

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj).encode() + b"\n\n"


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
    prep, stream = shapes.prep, ticket.stream
    first = True
    try:
        if shapes.chat:
            yield _sse(shapes.chunk("", None, role=True, first=True))
            first = False
        async for chunk in stream:
            ticket.observe(chunk)
            if ticket.error is not None:
                yield _sse(error_body(ticket.error, "server_error", None, "engine_error"))
                break
            usage = ticket.usage() if prep.continuous_usage else None
            if chunk.text or chunk.token_ids:
                yield _sse(shapes.chunk(chunk.text, None, chunk.token_ids, usage=usage, first=first))
                first = False
            if chunk.finished:
                yield _sse(shapes.chunk(None if shapes.chat else "", ticket.finish_reason, usage=usage,
                                        first=first))
                break
        if prep.include_usage and ticket.error is None:
            last = shapes.chunk(None, None, usage=ticket.usage())
            last["choices"] = []
            yield _sse(last)
        yield b"data: [DONE]\n\n"
    finally:
        ticket.settle()


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

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def json_response(obj: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(_encode(obj), status_code=status, media_type="application/json", headers=headers)
