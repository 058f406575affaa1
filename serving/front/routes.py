"""The front's routes on one `APIRouter`; auth and the body limit are dependencies.

A generation request: auth -> body (limit, UTF-8, JSON object) -> vLLM's
request model -> model name -> admission (429) -> render + tokenize + sampling
(`prepare`) -> `Router.open` (routing errors surface before any byte is sent)
-> SSE stream or JSON answer. Its `RequestTicket` settles once on every path.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

from actors.protocol.request import EngineRequest, Stamps
from serving.config import DeploymentConfig
from serving.front.accounting import Accounting, RequestTicket
from serving.front.http_errors import CLIENT_ERRORS, ApiError, error_response, invalid_request, invalid_value
from serving.front.prepare import Kind, parse, prepare
from serving.front.responses import SSEResponse, Shapes, collect, json_response, sse_events
from serving.front.trace import RequestTrace
from serving.front.trace import requested as traced
from serving.front.served_model import ServedModel
from serving.ops.loop_watch import LoopWatch
from serving.ops.metrics import CONTENT_TYPE, ServiceMetrics
from serving.routing.route_errors import InvalidRequest, RoutingError
from serving.routing.protocols import RequestRouter, TokenStream
from serving.routing.status import Readiness

logger = logging.getLogger("raypd.api")

GENERATION_PATHS: dict[str, Kind] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_tokenize_request = TypeAdapter(TokenizeRequest)
_detokenize_request = TypeAdapter(DetokenizeRequest)


def _validated(adapter: TypeAdapter, body: Any, state: "FrontState") -> Any:
    """`body` as vLLM's request model for the served model; a client's mistake is a 400."""
    try:
        req = adapter.validate_python(body)
    except ValidationError as exc:
        raise invalid_request(exc) from None
    except CLIENT_ERRORS as exc:
        raise invalid_value(exc) from None
    check_model(state, req.model)
    return req


@dataclass
class FrontState:
    """Everything the routes share (one per app)."""

    cfg: DeploymentConfig
    router: RequestRouter  # serving.routing.router.Router (a fake in the front's unit tests)
    model: ServedModel
    metrics: ServiceMetrics
    accounting: Accounting
    api_keys: tuple[bytes, ...]
    created: int
    watch: LoopWatch | None = None  # event-loop lag and gc pauses (http.trace)

    @property
    def model_name(self) -> str:
        return self.cfg.served_model_name


# Dependencies are coroutines: FastAPI runs a plain `def` dependency in its thread pool,
# a thread hop per request (measured: most of the front's own time on 2 cores).
async def front(request: Request) -> FrontState:
    return request.app.state.front


Front = Annotated[FrontState, Depends(front)]


async def check_auth(request: Request, state: Front) -> None:
    if not state.api_keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    presented = token.strip().encode()
    if not any(hmac.compare_digest(presented, k) for k in state.api_keys):
        raise ApiError(401, "Incorrect API key provided", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


async def json_body(request: Request, state: Front) -> dict:
    """The body as a JSON object, refused past `http.max_body_bytes` before it is all read."""
    limit = state.cfg.http.max_body_bytes
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
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding") from None
    try:
        body = json.loads(text, parse_constant=_no_constants)
    except CLIENT_ERRORS as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


Body = Annotated[dict, Depends(json_body)]
router = APIRouter(dependencies=[Depends(check_auth)])  # routes that need a key
open_router = APIRouter()  # health and metrics: scraped and probed without keys


def check_model(state: FrontState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise ApiError(404, f"The model `{name}` does not exist. Available: `{state.model_name}`.",
                       param="model", code="model_not_found")


@open_router.get("/health")
async def health(state: Front) -> JSONResponse:
    try:
        ready = await state.router.readiness()
    except Exception as exc:  # noqa: BLE001
        ready = Readiness(False, f"readiness check failed: {type(exc).__name__}: {exc}")
    return JSONResponse({"status": "ok" if ready.ready else "unavailable", **ready.to_json()},
                        status_code=200 if ready.ready else 503)


@open_router.get("/metrics")
async def metrics(state: Front) -> Response:
    try:
        await asyncio.wait_for(state.router.refresh_engine_stats(), 3.0)
    except Exception as exc:  # noqa: BLE001 - metrics must render even if an engine is away
        logger.info("engine stats unavailable for /metrics: %s", exc)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@open_router.get("/version")
async def version() -> JSONResponse:
    from vllm import __version__ as vllm_version

    from serving import __version__ as raypd_version

    return JSONResponse({"version": vllm_version, "raypd_version": raypd_version})


@router.get("/v1/models")
async def models(state: Front) -> JSONResponse:
    cfg = state.cfg
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "raypd",
        "root": cfg.model if cfg.backend == "vllm" else cfg.synthetic.model_id,
        "max_model_len": state.model.max_model_len,
    }]})


@router.post("/tokenize")
async def tokenize(state: Front, body: Body) -> Response:
    req = _validated(_tokenize_request, body, state)
    try:
        ids, strs = await state.model.tokenize(req)
    except CLIENT_ERRORS as exc:
        raise invalid_value(exc) from None
    return json_response({"count": len(ids), "max_model_len": state.model.max_model_len, "tokens": ids,
                          "token_strs": strs})


@router.post("/detokenize")
async def detokenize(state: Front, body: Body) -> Response:
    req = _validated(_detokenize_request, body, state)
    try:
        return json_response({"prompt": await state.model.detokenize(req)})
    except CLIENT_ERRORS as exc:
        raise invalid_value(exc) from None


@router.post("/v1/completions")
async def completions(request: Request, state: Front, body: Body) -> Response:
    return await generate(request, state, body, "completions")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: Front, body: Body) -> Response:
    return await generate(request, state, body, "chat")


async def generate(request: Request, state: FrontState, body: dict, kind: Kind) -> Response:
    trace = RequestTrace()
    if state.watch is not None:
        state.watch.busy()
    ticket = state.accounting.start(kind)
    handed_over = False
    status = "500"
    try:
        parsed = parse(kind, body)
        check_model(state, parsed.model)
        ticket.admit()
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        prep = await prepare(kind, parsed, state.model, rid)
        trace.mark(Stamps.PREPARED)
        ticket.stream = stream = await open_stream(state, prep.engine_request)
        trace.extend(stream.first_stamps)
        shown = trace if traced(request.headers, state.cfg.http.trace) else None
        shapes = Shapes(prep, state.model_name)
        if prep.stream:
            handed_over = True
            return SSEResponse(sse_events(shapes, ticket), on_close=ticket.settle, media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Request-Id": rid}, trace=shown)
        answer = await collect(shapes, ticket, request)
        if answer is None:
            status = "499"
            return Response(status_code=499)
        status = "200"
        if shown is not None:
            shown.mark(Stamps.SSE)
        return json_response(answer, headers=dict([shown.header_str()]) if shown is not None else None)
    except ApiError as err:
        status = str(err.status)
        return error_response(err)
    except asyncio.CancelledError:
        status = "499"
        raise
    finally:
        if not handed_over:
            ticket.settle(status)


async def open_stream(state: FrontState, engine_request: EngineRequest) -> TokenStream:
    """The routed stream of `engine_request` (`RequestRouter.open`: `serving.routing.router.Router.open`);
    a routing error becomes the HTTP error it means."""
    try:
        return await state.router.open(engine_request)
    except RoutingError as exc:
        raise routing_error(exc) from None


def routing_error(exc: RoutingError) -> ApiError:
    """A request the engines refused is the client's (400); anything else is the service's (503, retry)."""
    if isinstance(exc, InvalidRequest):
        return ApiError(400, exc.message, type="invalid_request_error", code=exc.code)
    return ApiError(503, exc.message, type="server_error", code=exc.code, headers={"Retry-After": "1"})


def count_refusal(request: Request, status: int) -> None:
    """A generation request refused by a dependency (auth, body) still counts in raypd_requests."""
    kind = GENERATION_PATHS.get(request.url.path)
    state = getattr(request.app.state, "front", None)
    if kind is not None and state is not None:
        state.metrics.request(kind, str(status))


__all__ = ["FrontState", "RequestTicket", "count_refusal", "open_router", "router"]
