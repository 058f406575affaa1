"""The one SSE client of `raypd bench`: a streamed OpenAI completion or chat request, timed.

`stream_request` posts the body, reads `data:` events until `[DONE]`, and fills a
`Sample`: time to the first content, the gaps between content events (ITL), the
answer's text and the usage the server reports; an error event or a non-200
status ends it as a failed sample (a failed request is a sample, never an
exception).
"""

from __future__ import annotations

import json
import time
from typing import Any, TypeVar

from serving.bench.samples import Sample

S = TypeVar("S", bound=Sample)


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
