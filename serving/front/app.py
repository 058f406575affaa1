"""`create_app`: the OpenAI-compatible front (FastAPI) for one deployment.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE in the OpenAI
chunk format ending with `data: [DONE]`, or one JSON answer with `usage`),
POST /tokenize, POST /detokenize (vLLM's request and response models),
GET /v1/models, GET /version, GET /health, GET /metrics.

Every refusal is `{"error": {"message", "type", "param", "code"}}`:

  400  malformed JSON or UTF-8, a body that is not an object, anything vLLM's
       request models, renderer or SamplingParams refuse (vLLM's message and
       parameter: wrong types, out-of-range values, prompt longer than the
       context, token ids out of the vocabulary, chat template errors...),
       and what raypd does not support (n > 1, logprobs, beam search, echo...,
       see `serving.front.prepare`), client-sent transport fields
  401  missing or wrong API key
  404  unknown model, unknown route
  413  body larger than `http.max_body_bytes`
  429  more than `http.max_inflight_requests` requests in flight
  503  no engine can serve the request (no decode engine, no prefill engine
       and fallback "reject", engine failure, KV transfer failed)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.protocol.request import ModelInfo
from serving.front.api_keys import load_api_keys
from serving.config import DeploymentConfig
from serving.front import http_errors as errors
from serving.front.accounting import Accounting
from serving.front.heap import settle_heap
from serving.front.routes import FrontState, count_refusal, open_router, router
from serving.front.served_model import ServedModel, SyntheticServedModel
from serving.ops.loop_watch import LoopWatch
from serving.ops.metrics import ServiceMetrics
from serving.routing.protocols import RequestRouter


def api_keys(cfg: DeploymentConfig) -> tuple[bytes, ...]:
    """From RAYPD_API_KEYS / http.api_keys_file, never the config (serving.front.api_keys)."""
    return load_api_keys(cfg.http).keys


def synthetic_model(cfg: DeploymentConfig) -> ServedModel:
    """The synthetic deployment's model, known from its config alone."""
    return SyntheticServedModel(ModelInfo(backend="synthetic", max_model_len=cfg.max_model_len,
                                          vocab_size=cfg.synthetic.vocab_size))


def _in_ray() -> bool:
    import ray

    return ray.is_initialized()


def create_app(cfg: DeploymentConfig, router_: RequestRouter, model: ServedModel | None = None,
               metrics: ServiceMetrics | None = None, cluster_metrics: bool | None = None) -> FastAPI:
    """The front for one deployment; `router_` is a `serving.routing.router.Router` (or a fake with its API:
    `serving.routing.protocols.RequestRouter`);
    `model` comes from an engine's `model_info()` (`served_model`), synthetic deployments may omit it.
    `cluster_metrics` (default: when this process is connected to Ray) also records the metrics
    through Ray's metrics agent (`serving.ops.cluster_metrics`)."""
    if model is None:
        if cfg.backend != "synthetic":
            raise ValueError("a vLLM deployment's front needs the served model (serving.front.served_model)")
        model = synthetic_model(cfg)
    exporter = None
    cluster = None
    if cluster_metrics if cluster_metrics is not None else _in_ray():
        from serving.ops.cluster_metrics import ClusterFrontMetrics, RouterExporter

        cluster = ClusterFrontMetrics()
        exporter = RouterExporter(lambda: app.state.front.router)

    watch = LoopWatch("ingress") if cfg.http.trace else None  # lag and gc pauses, logged when long

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        settle_heap()  # the collector set for serving (serving/front/heap.py)
        if exporter is not None:
            exporter.start()
        if watch is not None:
            watch.start()
        yield
        if exporter is not None:
            exporter.stop()
        if watch is not None:
            watch.stop()

    app = FastAPI(title="raypd", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    metrics = metrics or ServiceMetrics(lambda: app.state.front.router, cluster=cluster)
    app.state.front = FrontState(cfg=cfg, router=router_, model=model, metrics=metrics,
                                 accounting=Accounting(metrics, cfg.http.max_inflight_requests),
                                 api_keys=api_keys(cfg), created=int(time.time()), watch=watch)

    async def api_error(request: Request, exc: errors.ApiError) -> JSONResponse:
        count_refusal(request, exc.status)
        return errors.error_response(exc)

    app.add_exception_handler(errors.ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, errors.http_error)
    app.add_exception_handler(Exception, errors.internal_error)
    app.include_router(open_router)
    app.include_router(router)
    return app
