#!/usr/bin/env python
"""The HTTP hop in front of plain vLLM servers, for set-ups (a2) and (c).

  python benchmarks/pdbench/proxy.py --port P balance --backend URL --backend URL
  python benchmarks/pdbench/proxy.py --port P pd --prefill URL --decode URL

`balance` (a2): each completion goes to the backend with the fewest requests in
flight through this proxy (ties: round robin), streamed back unchanged.

`pd` (c): what vLLM's documented disaggregated proxy
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) does: the request
goes to the prefill server with `max_tokens: 1`, `stream: false` and
`kv_transfer_params: {do_remote_decode: true, ...}`; its answer's
`kv_transfer_params` are added to the original request, which then streams from
the decode server. Both requests carry the same `X-Request-Id`.

FastAPI + httpx, one uvicorn worker, like vLLM's proxy.
"""

from __future__ import annotations

import argparse
import itertools
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def make_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = httpx.AsyncClient(timeout=None, limits=limits)
    backends = args.backend if args.mode == "balance" else [args.decode]
    inflight = {b: 0 for b in backends}
    turn = itertools.count()

    def pick() -> str:
        least = min(inflight.values())
        tied = [b for b in backends if inflight[b] == least]
        return tied[next(turn) % len(tied)]

    async def stream_from(url: str, body: dict, headers: dict, on_close) -> StreamingResponse:
        req = client.build_request("POST", url, json=body, headers=headers)
        resp = await client.send(req, stream=True)

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
                on_close()

        return StreamingResponse(relay(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type", "text/event-stream"))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        r = await client.get(backends[0] + "/v1/models")
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        rid = str(uuid.uuid4())
        headers = {"X-Request-Id": rid}
        if args.mode == "balance":
            target = pick()
            inflight[target] += 1

            def done(t: str = target) -> None:
                inflight[t] -= 1

            try:
                return await stream_from(target + "/v1/completions", body, headers, done)
            except BaseException:
                done()
                raise
        pre = dict(body, max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        r = await client.post(args.prefill + "/v1/completions", json=pre, headers=headers)
        if r.status_code != 200:
            return JSONResponse(r.json(), status_code=r.status_code)
        params = r.json().get("kv_transfer_params")
        if params:
            body = dict(body, kv_transfer_params=params)
        return await stream_from(args.decode + "/v1/completions", body, headers, lambda: None)

    @app.on_event("shutdown")
    async def close() -> None:
        await client.aclose()

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    sub = p.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("balance")
    b.add_argument("--backend", action="append", required=True)
    d = sub.add_parser("pd")
    d.add_argument("--prefill", required=True)
    d.add_argument("--decode", required=True)
    args = p.parse_args()
    uvicorn.run(make_app(args), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
