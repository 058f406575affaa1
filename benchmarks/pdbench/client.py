"""The one client path of every set-up: the official `openai` client streaming /v1/completions.

Every request is the same for every set-up: a prompt of random token ids
(exact length, a fresh prompt per request so no prefix cache ever hits), greedy
(`temperature 0`), `ignore_eos` so each answer has exactly `max_tokens` tokens,
`stream_options.include_usage`, `X-Raypd-Trace: 1` (raypd answers with its per-hop
stamps; other servers ignore it). A token chunk is a streamed chunk with non-empty
text; its arrival time is taken when the client has parsed it.

Workloads: `low_load` sends requests one at a time, cycling over the prompt
lengths; `poisson` sends a pre-drawn open-loop stream (exponential gaps at a
fixed rate, prompt lengths from a fixed weighted mix), never waiting for answers.
Streams are drawn from seeds that depend only on (seed, round, length or rate),
so every set-up gets identical requests; under load, every rate of a round sends the
same lengths with the same (scaled) gaps, and the mix's proportions exactly.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx
from openai import AsyncOpenAI

from serving.front.trace import HEADER as TRACE_HEADER
from serving.front.trace import parse as parse_trace


@dataclass
class Request:
    idx: int
    prompt: list[int]
    max_tokens: int
    at_s: float = 0.0  # arrival offset within its phase (open loop)

    @property
    def length(self) -> int:
        return len(self.prompt)


@dataclass
class Record:
    idx: int
    length: int
    at_s: float
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # token chunks, from the request's send
    completion_tokens: int | None = None
    end_s: float | None = None  # last byte, from the phase start
    text: str = ""
    sent_mono: float | None = None  # time.monotonic() at send (the clock raypd's trace stamps use)
    headers_s: float | None = None  # response headers parsed, from the request's send
    trace: list | None = None  # raypd's X-Raypd-Trace stamps [[hop, monotonic s], ...] (serving.front.trace)

    def to_json(self) -> dict:
        d = asdict(self)
        d["token_times_s"] = [round(t, 5) for t in self.token_times_s]
        return d


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


def low_load_requests(seed: int, rnd: int, lengths: list[int], reps: int, max_tokens: int,
                      vocab: int) -> list[Request]:
    """`reps` requests per length, interleaved (so a drift of the host hits every length alike)."""
    out = []
    per_len = {n: random.Random(f"{seed}/low/{rnd}/{n}") for n in lengths}
    for i in range(reps):
        for n in lengths:
            out.append(Request(len(out), random_prompt(per_len[n], n, vocab), max_tokens))
    return out


def mix_counts(mix: dict[int, float], count: int) -> dict[int, int]:
    """Exact counts per prompt length for `count` requests (largest remainder), so that a
    small stream holds the mix's proportions instead of whatever a random draw gives."""
    total = sum(mix.values())
    raw = {n: count * w / total for n, w in mix.items()}
    out = {n: int(v) for n, v in raw.items()}
    for n in sorted(raw, key=lambda n: raw[n] - out[n], reverse=True)[:count - sum(out.values())]:
        out[n] += 1
    return out


def poisson_requests(seed: int, rnd: int, rate: float, count: int, mix: dict[int, float], max_tokens: int,
                     vocab: int) -> list[Request]:
    """One round's open-loop stream at `rate`, identical for every set-up.

    Every rate of a round gets the same prompt lengths in the same order and the
    same Poisson gaps scaled by 1/rate (unit exponential gaps / rate), so rates
    differ only in pace; the prompts' tokens are fresh per rate (prefix caching
    is on: a repeated prompt would be served from the cache). The `count` unit
    gaps are scaled to sum to `count` (a Poisson stream conditioned on its
    count-th arrival at count / rate: arrivals stay uniformly scattered), so that
    every round offers exactly `rate` and lasts as long as planned."""
    shape = random.Random(f"{seed}/load/{rnd}")
    tokens = random.Random(f"{seed}/load/{rnd}/{rate}")
    lengths = [n for n, k in mix_counts(mix, count).items() for _ in range(k)]
    shape.shuffle(lengths)
    gaps = [shape.expovariate(1.0) for _ in lengths]
    scale = len(gaps) / sum(gaps) if gaps else 1.0
    t, out = 0.0, []
    for i, (n, g) in enumerate(zip(lengths, gaps)):
        out.append(Request(i, random_prompt(tokens, n, vocab), max_tokens, at_s=t / rate))
        t += g * scale
    return out


def make_client(base_url: str, timeout_s: float) -> AsyncOpenAI:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    return AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                       http_client=httpx.AsyncClient(timeout=timeout_s, limits=limits))


async def send(client: AsyncOpenAI, model: str, req: Request, phase_t0: float) -> Record:
    rec = Record(req.idx, req.length, req.at_s)
    parts: list[str] = []
    t0 = time.perf_counter()
    rec.sent_mono = time.monotonic()
    try:
        raw = await client.completions.with_raw_response.create(
            model=model, prompt=req.prompt, max_tokens=req.max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={TRACE_HEADER: "1"})
        rec.headers_s = time.perf_counter() - t0
        if raw.headers.get(TRACE_HEADER):
            rec.trace = [[k, v] for k, v in parse_trace(raw.headers[TRACE_HEADER])]
        stream = raw.parse()
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                rec.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices or []:
                if choice.text:
                    rec.token_times_s.append(now - t0)
                    parts.append(choice.text)
        rec.ok = bool(rec.token_times_s)
        if not rec.ok:
            rec.error = "no token streamed"
    except Exception as exc:  # noqa: BLE001 - a failed request is a record
        rec.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    rec.end_s = time.perf_counter() - phase_t0
    if rec.token_times_s:
        rec.ttft_s = rec.token_times_s[0]
    rec.text = "".join(parts)
    return rec


async def low_load(base_url: str, model: str, requests: list[Request], timeout_s: float,
                   after_each: Callable[[Record], None] | None = None) -> list[Record]:
    """One request at a time; `after_each(record)` runs once a request has ended, before the next is
    sent (raypd's fault counters are read there, so the read never overlaps a request)."""
    client = make_client(base_url, timeout_s)
    try:
        t0 = time.perf_counter()
        out = []
        for req in requests:
            req.at_s = time.perf_counter() - t0
            out.append(await send(client, model, req, t0))
            if after_each is not None:
                after_each(out[-1])
        return out
    finally:
        await client.close()


async def poisson(base_url: str, model: str, requests: list[Request], timeout_s: float,
                  drain_s: float) -> tuple[list[Record], float]:
    """Send each request at its arrival time; give up on what is unfinished `drain_s` after the last arrival.

    Returns the records and the phase's duration (first send -> last completion,
    or the give-up time).
    """
    client = make_client(base_url, timeout_s)
    t0 = time.perf_counter()

    async def at(req: Request) -> Record:
        await asyncio.sleep(max(0.0, req.at_s - (time.perf_counter() - t0)))
        return await send(client, model, req, t0)

    tasks = [asyncio.ensure_future(at(r)) for r in requests]
    try:
        limit = (requests[-1].at_s if requests else 0.0) + drain_s
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, limit - (time.perf_counter() - t0)))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
        out = []
        for req, t in zip(requests, tasks):
            if t in done and not t.cancelled() and t.exception() is None:
                out.append(t.result())
            else:
                out.append(Record(req.idx, req.length, req.at_s, error=f"unfinished {drain_s:.0f}s after the "
                                  "last arrival (cancelled)"))
        ends = [r.end_s for r in out if r.ok and r.end_s is not None]
        if not pending and ends:
            duration = max(ends)
        return out, duration
    finally:
        await client.close()
