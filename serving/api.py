"""The OpenAI-compatible HTTP front: FastAPI app factory over a `Router`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as SSE
in the OpenAI chunk format ending with `data: [DONE]`, or one JSON object with
`usage`), GET /v1/models, GET /health, GET /metrics.

Every refusal is an OpenAI-style body `{"error": {"message", "type", "param",
"code"}}`:

  400  malformed JSON, invalid UTF-8, a body that is not an object, values out
       of range (max_tokens, temperature, top_p, stop...), n > 1 and other
       unsupported parameters, a prompt the engine refuses (empty, too long)
  401  missing or wrong API key (when RAYPD_API_KEYS / http.api_keys_file give keys)
  404  unknown model, unknown route
  413  body larger than `http.max_body_bytes`
  422  body does not match the schema (wrong types, missing fields)
  429  more than `http.max_inflight_requests` requests in flight
  503  no engine can serve the request (no decode engine, no prefill engine
       and fallback "reject", engine failure, KV transfer failed)

The body is parsed by hand (not by FastAPI's signature binding) so each of
those cases gets its own status and message.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.protocol import EngineRequest, SamplingSpec, TokenChunk
from serving.api_keys import load_api_keys
from serving.config import DeploymentConfig
from serving.metrics import CONTENT_TYPE, ServiceMetrics
from serving.router import RouteError

logger = logging.getLogger("raypd.api")

MAX_STOP_SEQUENCES = 16
INT64 = 2**63


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status,
                        headers=err.headers)


# ------------------------------------------------------------------ schemas
class _Lax(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Lax):
    include_usage: bool | None = None


class ContentPart(_Lax):
    type: str
    text: str | None = None


class ChatMessage(_Lax):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _SamplingRequest(_Lax):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


# Parameters the OpenAI API has and raypd does not implement: refused unless
# given their neutral value (so clients that send defaults keep working).
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "logit_bias": lambda v: v in (None, {}),
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "tools": lambda v: v in (None, []),
    "functions": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
}


def _validation_error(exc: ValidationError) -> ApiError:
    def is_branch(part: Any) -> bool:  # union branch names pydantic puts in locations ("str", "list[int]")
        return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))

    def where(loc: tuple) -> str:
        return ".".join(str(p) for p in loc if not is_branch(p)) or "(body)"

    errors = exc.errors()
    problems = "; ".join(f"{where(e['loc'])}: {e['msg']}" for e in errors[:5])
    return ApiError(422, f"invalid request: {problems}", param=where(errors[0]["loc"]), code="invalid_type")


def _check_range(name: str, value: Any, ok: bool, rule: str) -> None:
    if not ok:
        raise ApiError(400, f"Invalid '{name}': {value!r}; {rule}", param=name, code="invalid_value")


def _validate_sampling(p: _SamplingRequest, body: dict, cfg: DeploymentConfig, default_max: int) -> dict:
    """Common sampling checks; returns the engine-request fields."""
    for name, neutral in UNSUPPORTED.items():
        if name in body and not neutral(body[name]):
            raise ApiError(400, f"'{name}' is not supported by raypd", param=name, code="unsupported_parameter")
    if p.n not in (None, 1):
        raise ApiError(400, f"n={p.n} is not supported: raypd returns exactly one choice (n=1)",
                       param="n", code="unsupported_parameter")
    max_tokens = getattr(p, "max_completion_tokens", None) or p.max_tokens
    param = "max_completion_tokens" if getattr(p, "max_completion_tokens", None) else "max_tokens"
    if max_tokens is None:
        max_tokens = default_max
    _check_range(param, max_tokens, 1 <= max_tokens <= cfg.max_model_len,
                 f"it must be between 1 and the context length {cfg.max_model_len}")
    out: dict[str, Any] = {"max_tokens": max_tokens}
    if p.temperature is not None:
        _check_range("temperature", p.temperature, 0.0 <= p.temperature <= 2.0, "it must be between 0 and 2")
        out["temperature"] = p.temperature
    if p.top_p is not None:
        _check_range("top_p", p.top_p, 0.0 < p.top_p <= 1.0, "it must be in (0, 1]")
        out["top_p"] = p.top_p
    if p.seed is not None:
        _check_range("seed", p.seed, -INT64 <= p.seed < INT64, "it must fit in 64 bits")
        out["seed"] = p.seed
    if p.stop is not None:
        stops = [p.stop] if isinstance(p.stop, str) else list(p.stop)
        _check_range("stop", p.stop, len(stops) <= MAX_STOP_SEQUENCES,
                     f"at most {MAX_STOP_SEQUENCES} stop sequences")
        stops = [s for s in stops if s]
        if stops:
            out["stop"] = stops
    if p.ignore_eos:
        out["ignore_eos"] = True
    return out


def parse_completion(body: dict, cfg: DeploymentConfig) -> tuple[CompletionRequest, dict]:
    try:
        p = CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    fields = _validate_sampling(p, body, cfg, default_max=16)
    prompt = p.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"batched prompts ({len(prompt)}) are not supported: send one prompt per request",
                           param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        fields["prompt"] = prompt
    else:
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        if any(t < 0 for t in prompt):
            raise ApiError(400, "token ids must be >= 0", param="prompt", code="invalid_value")
        fields["prompt_token_ids"] = list(prompt)
    return p, fields


def parse_chat(body: dict, cfg: DeploymentConfig) -> tuple[ChatCompletionRequest, dict]:
    try:
        p = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    fields = _validate_sampling(p, body, cfg, default_max=min(cfg.http.default_max_tokens, cfg.max_model_len))
    if not p.messages:
        raise ApiError(400, "messages must not be empty", param="messages", code="invalid_value")
    messages = []
    for i, m in enumerate(p.messages):
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{i}]: content part type {part.type!r} is not supported "
                                   "(text only)", param=f"messages.{i}.content", code="unsupported_parameter")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = m.content or ""
        msg = {"role": m.role, "content": content}
        if m.name:
            msg["name"] = m.name
        messages.append(msg)
    if not any(m["content"] for m in messages):
        raise ApiError(400, "every message is empty", param="messages", code="invalid_value")
    fields["messages"] = messages
    return p, fields


def engine_request(request_id: str, fields: dict) -> EngineRequest:
    """The parsed request fields as the engines' typed request."""
    sampling = SamplingSpec(
        max_tokens=fields["max_tokens"], temperature=fields.get("temperature"), top_p=fields.get("top_p"),
        seed=fields.get("seed"), stop=tuple(fields.get("stop") or ()), ignore_eos=bool(fields.get("ignore_eos")),
    )
    ids = fields.get("prompt_token_ids")
    messages = fields.get("messages")
    return EngineRequest(request_id, sampling, prompt_token_ids=tuple(ids) if ids else None,
                         prompt=fields.get("prompt"), messages=tuple(messages) if messages else None)


# ------------------------------------------------------------------- app
def create_app(cfg: DeploymentConfig, router: Any, metrics: ServiceMetrics | None = None) -> FastAPI:
    """The front for one deployment; `router` is a `serving.router.Router` (or a fake with its API)."""
    app = FastAPI(title="raypd", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.cfg = cfg
    app.state.router = router
    app.state.metrics = metrics or ServiceMetrics(lambda: app.state.router)
    app.state.inflight = 0
    model_name = cfg.served_model_name
    created = int(time.time())
    keys = load_api_keys(cfg.http).keys  # from RAYPD_API_KEYS / http.api_keys_file, never the config

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, code),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", None, None),
                            status_code=500)

    def check_auth(request: Request) -> None:
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        presented = token.strip().encode()
        if not any(hmac.compare_digest(presented, k) for k in keys):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def read_json(request: Request) -> dict:
        limit = cfg.http.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                           code="request_too_large")
        size, parts = 0, []
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            parts.append(part)
        raw = b"".join(parts)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start})",
                           code="invalid_encoding") from None

        def no_constants(name: str) -> float:
            raise ValueError(f"{name} is not valid JSON")

        try:
            body = json.loads(text, parse_constant=no_constants)
        except ValueError as exc:
            raise ApiError(400, f"We could not parse the JSON body of your request: {exc}",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(404, f"The model `{name}` does not exist. Available: `{model_name}`.",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            h = await app.state.router.health()
        except Exception as exc:  # noqa: BLE001
            h = {"healthy": False, "reason": f"health check failed: {type(exc).__name__}: {exc}"}
        return JSONResponse({"status": "ok" if h["healthy"] else "unavailable", **h},
                            status_code=200 if h["healthy"] else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        try:
            await asyncio.wait_for(app.state.router.refresh_engine_stats(), 3.0)
        except Exception as exc:  # noqa: BLE001 - metrics must render even if an engine is away
            logger.info("engine stats unavailable for /metrics: %s", exc)
        return Response(app.state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            check_auth(request)
        except ApiError as err:
            return error_response(err)
        return JSONResponse({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "raypd",
            "root": cfg.model if cfg.backend == "vllm" else cfg.synthetic.model_id,
            "max_model_len": cfg.max_model_len,
        }]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve_request(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve_request(request, "chat")

    async def serve_request(request: Request, kind: str) -> Response:
        t0 = time.perf_counter()
        m = app.state.metrics
        admitted = False
        stream = None
        handed_over = False
        status = "500"
        try:
            check_auth(request)
            body = await read_json(request)
            parsed, fields = (parse_chat if kind == "chat" else parse_completion)(body, cfg)
            check_model(parsed.model)
            if app.state.inflight >= cfg.http.max_inflight_requests:
                raise ApiError(429, f"too many requests in flight ({cfg.http.max_inflight_requests}); retry later",
                               type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
            app.state.inflight += 1
            admitted = True
            rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            try:
                stream = await app.state.router.open(engine_request(rid, fields))
            except RouteError as exc:
                raise ApiError(exc.status, exc.message, type=exc.type if exc.status < 500 else "server_error",
                               param=exc.param, code=exc.code,
                               headers={"Retry-After": "1"} if exc.status == 503 else None) from None
            ctx = _Ctx(app, kind, rid, model_name, t0, stream)
            if parsed.stream:
                include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
                handed_over = True
                return _SSEResponse(_sse_events(ctx, include_usage), on_close=ctx.finish,
                                    media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
            resp = await _collect(ctx, request)
            status = str(resp.status_code)
            return resp
        except ApiError as err:
            status = str(err.status)
            return error_response(err)
        except asyncio.CancelledError:
            status = "499"
            raise
        finally:
            if not handed_over:
                if stream is not None:
                    stream.close()
                if admitted:
                    app.state.inflight -= 1
                m.requests.labels(kind, status).inc()
                if status == "200":
                    m.e2e.labels(kind).observe(time.perf_counter() - t0)

    return app


# -------------------------------------------------------------- responses
class _Ctx:
    """One admitted request: its stream, timings and the once-only finish."""

    def __init__(self, app: FastAPI, kind: str, rid: str, model: str, t0: float, stream: Any):
        self.app, self.kind, self.rid, self.model, self.t0, self.stream = app, kind, rid, model, t0, stream
        self.created = int(time.time())
        self.last_token_at: float | None = None
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.done = False

    def observe(self, chunk: TokenChunk) -> None:
        now = time.perf_counter()
        m = self.app.state.metrics
        if chunk.token_ids or chunk.text:
            if self.last_token_at is None:
                m.ttft.labels(self.kind).observe(now - self.t0)
            else:
                m.itl.labels(self.kind).observe(now - self.last_token_at)
            self.last_token_at = now
        if chunk.finished:
            self.finish_reason = chunk.finish_reason or "stop"
            if chunk.failed:
                self.error = chunk.error or "the engine failed the request"

    @property
    def usage(self) -> dict:
        p, c = self.stream.num_prompt_tokens, self.stream.num_generated
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def finish(self, status: str | None = None) -> None:
        """Idempotent: close the stream (aborting it if unfinished), count, free the slot."""
        if self.done:
            return
        self.done = True
        self.stream.close()
        self.app.state.inflight -= 1
        m = self.app.state.metrics
        if status is None:
            status = "200" if self.error is None and self.finish_reason else ("stream_error" if self.error else "499")
        m.requests.labels(self.kind, status).inc()
        if status == "200":
            m.e2e.labels(self.kind).observe(time.perf_counter() - self.t0)
            m.prompt_tokens.inc(self.usage["prompt_tokens"])
        m.generation_tokens.inc(self.stream.num_generated)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _chunk(ctx: _Ctx, delta_text: str | None, finish_reason: str | None, role: bool = False) -> dict:
    if ctx.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if delta_text is not None:
            delta["content"] = delta_text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": ctx.rid, "object": obj, "created": ctx.created, "model": ctx.model, "choices": [choice]}


async def _sse_events(ctx: _Ctx, include_usage: bool) -> AsyncIterator[str]:
    try:
        if ctx.kind == "chat":
            yield _sse(_chunk(ctx, "", None, role=True))
        async for chunk in ctx.stream:
            ctx.observe(chunk)
            if ctx.error is not None:
                yield _sse(error_body(ctx.error, "server_error", None, "engine_error"))
                break
            if chunk.text:
                yield _sse(_chunk(ctx, chunk.text, None))
            if chunk.finished:
                yield _sse(_chunk(ctx, None if ctx.kind == "chat" else "", ctx.finish_reason))
                break
        if include_usage and ctx.error is None:
            usage_obj = _chunk(ctx, None, None)
            usage_obj["choices"] = []
            usage_obj["usage"] = ctx.usage
            yield _sse(usage_obj)
        yield "data: [DONE]\n\n"
    finally:
        ctx.finish()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(ctx: _Ctx, request: Request) -> Response:
    """Non-streamed answer; the request is aborted if the client goes away meanwhile."""

    async def drain() -> None:
        async for chunk in ctx.stream:
            ctx.observe(chunk)
            if chunk.text:
                ctx.text_parts.append(chunk.text)
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
        ctx.stream.close()
        return Response(status_code=499)
    work.result()
    if ctx.error is not None:
        raise ApiError(503, ctx.error, type="server_error", code="engine_error", headers={"Retry-After": "1"})
    text = "".join(ctx.text_parts)
    if ctx.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": ctx.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": ctx.finish_reason}
        obj = "text_completion"
    usage = ctx.usage
    m = ctx.app.state.metrics
    m.prompt_tokens.inc(usage["prompt_tokens"])
    m.generation_tokens.inc(ctx.stream.num_generated)
    return JSONResponse({"id": ctx.rid, "object": obj, "created": ctx.created, "model": ctx.model,
                         "choices": [choice], "usage": usage})


class _SSEResponse(StreamingResponse):
    """A StreamingResponse whose `on_close` always runs, even when the client vanished mid-stream.

    Starlette cancels the body iterator when the client disconnects; the
    iterator's own `finally` may then run late (at garbage collection).
    `on_close` is synchronous: it closes the routed stream, which aborts the
    request on both engines in the background.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
