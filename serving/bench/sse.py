"""The one SSE client of `raypd bench`: a streamed OpenAI completion or chat request, timed.

`stream_request` posts the body, reads `data:` events until `[DONE]`, and fills a
`Sample`: time to the first content, the gaps between content events (ITL), the
answer's text and the usage the server reports; an error event or a non-200
status ends it as a failed sample (a failed request is a sample, never an
exception).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from serving.bench.samples import Sample

S = TypeVar("S", bound=Sample)


@dataclass(frozen=True)
class Target:
    """Where a load run sends its requests: the client, the base URL, its headers, the model, the levels."""

    client: Any
    url: str
    headers: dict
    model: str
    levels: list[int]


@contextlib.asynccontextmanager
async def target(args: argparse.Namespace, url: str | None = None) -> AsyncIterator[Target]:
    """An httpx client sized for the largest concurrency level; the model is `--model` or the server's first."""
    import httpx

    url = (url or args.url).rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get(url + "/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        yield Target(client, url, headers, model, levels)


async def stream_request(client: Any, url: str, body: dict, headers: dict, chat: bool, sample: S) -> S:
    t0 = time.perf_counter()
    last = None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with client.stream("POST", url + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                sample.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return sample
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    sample.error = obj["error"].get("message")
                    return sample
                if obj.get("usage"):
                    sample.usage(obj["usage"])
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        now = time.perf_counter()
                        if last is None:
                            sample.ttft = now - t0
                        else:
                            sample.itls.append(now - last)
                        last = now
                        sample.text += piece
        sample.e2e = time.perf_counter() - t0
        sample.ok = last is not None
        if not sample.ok:
            sample.error = "no content streamed"
    except Exception as exc:  # noqa: BLE001 - a failed request is a sample
        sample.error = f"{type(exc).__name__}: {exc}"
    return sample
