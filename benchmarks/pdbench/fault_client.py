"""The streaming client of benchmarks/faults.py: one SSE reader that tells [DONE], error events,
cut streams and hangs apart (the `openai` client of pdbench/client.py ends quietly on a stream
cut short, and raises on an error event: it cannot tell them apart).

Every request: POST /v1/completions, a prompt of token ids, greedy (temperature 0), ignore_eos,
`max_tokens` tokens, streamed. `reference` sends the prompts one at a time (batch 1);
`open_loop` sends them at pre-drawn arrival times, never waiting for answers.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from pdbench.client import random_prompt
from pdbench.fault_outcomes import Stream


def prompts(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(f"{seed}/faults/prompts")
    return [random_prompt(rng, length, vocab) for _ in range(count)]


def arrivals(seed: int, count: int, rate: float) -> list[float]:
    """Poisson arrival offsets (s), the same for every set-up and phase."""
    rng = random.Random(f"{seed}/faults/arrivals")
    t, out = 0.0, []
    for _ in range(count):
        out.append(round(t, 3))
        t += rng.expovariate(rate)
    return out


async def stream_one(client: httpx.AsyncClient, url: str, model: str, idx: int, prompt: list[int],
                     max_tokens: int, limit_s: float, t0: float) -> Stream:
    s = Stream(idx, round(time.monotonic() - t0, 3))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    parts: list[str] = []

    async def read() -> None:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            s.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    s.done = True
                    return
                try:
                    ev = json.loads(data)
                except ValueError:
                    continue
                if "error" in ev and s.error_event is None:
                    s.error_event = json.dumps(ev["error"])[:300]
                for ch in ev.get("choices") or []:
                    parts.append(ch.get("text") or "")

    try:
        await asyncio.wait_for(read(), timeout=limit_s)
    except asyncio.TimeoutError:
        s.timed_out = True
    except (httpx.HTTPError, OSError) as exc:
        s.transport_error = f"{type(exc).__name__}: {exc}"
    s.text = "".join(parts)
    s.end_s = round(time.monotonic() - t0, 3)
    return s


def _client(limit_s: float, headers: dict[str, str] | None) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(limit_s + 5), limits=httpx.Limits(max_connections=256),
                             headers=headers)


async def reference(url: str, model: str, prompts_: list[list[int]], max_tokens: int,
                    limit_s: float, headers: dict[str, str] | None = None) -> list[Stream]:
    """One request at a time (batch 1), on the healthy set-up."""
    async with _client(limit_s, headers) as c:
        t0 = time.monotonic()
        return [await stream_one(c, url, model, i, p, max_tokens, limit_s, t0) for i, p in enumerate(prompts_)]


async def open_loop(url: str, model: str, prompts_: list[list[int]], at_s: list[float], max_tokens: int,
                    limit_s: float, t0: float, headers: dict[str, str] | None = None) -> list[Stream]:
    """Send prompt i at t0 + at_s[i] (monotonic); every request ends within `limit_s` of its send."""
    async with _client(limit_s, headers) as c:
        async def at(i: int) -> Stream:
            await asyncio.sleep(max(0.0, t0 + at_s[i] - time.monotonic()))
            return await stream_one(c, url, model, i, prompts_[i], max_tokens, limit_s, t0)

        return list(await asyncio.gather(*(at(i) for i in range(len(prompts_)))))
