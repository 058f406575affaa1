"""`raypd bench`: closed-loop load through the OpenAI-compatible streaming API, and the front's overhead.

Load mode (any OpenAI-compatible server):

  raypd bench --url http://127.0.0.1:8000 --concurrency 1,4,16 --prompt-len 128 --output-len 32 \
      --requests 64 --plot bench.png

For each concurrency C, C workers send streaming completions back to back until
`--requests` have been sent; per request we record time to first token, the
gaps between streamed chunks (ITL) and end-to-end latency. Printed per level:
p50/p90/p99 of each, request and output-token throughput, and goodput (requests
per second that met both `--slo-ttft-ms` and `--slo-itl-ms`, the mean ITL of the
request). `--plot` writes a PNG (matplotlib, Agg).

Chat mode (`--workload chat`): multi-turn conversations sharing system prompts,
see serving/bench/chat.py.

Overhead mode (`--overhead`): see `serving.bench.overhead`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
         "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server (without /v1)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="Bearer key when the server requires one")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in words (~tokens)")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens of every request")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput SLO: time to first token")
    p.add_argument("--slo-itl-ms", type=float, default=200.0, help="goodput SLO: mean inter-token latency")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--json-out", default=None, help="write the results as JSON here")
    p.add_argument("--overhead", action="store_true",
                   help="measure the front's own overhead against direct actor calls (synthetic backend)")
    p.add_argument("--config", default="configs/synthetic.yaml", help="--overhead: the synthetic deployment")
    p.add_argument("--overhead-concurrency", type=int, default=16, help="--overhead: concurrency of the rps runs")
    p.add_argument("--results", default="benchmarks/results/front_overhead.json",
                   help="--overhead: write the results here (JSON, and the printed table as .txt); '' for none")
    from serving.bench.chat import add_chat_arguments

    add_chat_arguments(p)


# ---------------------------------------------------------------- statistics
def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Sample:
    ok: bool
    ttft: float = float("nan")
    e2e: float = float("nan")
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def mean_itl(self) -> float:
        return sum(self.itls) / len(self.itls) if self.itls else 0.0


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    ttft_ms: dict
    itl_ms: dict
    e2e_ms: dict
    req_per_s: float
    output_tok_per_s: float
    goodput_req_per_s: float
    first_error: str | None = None


def summarize(concurrency: int, samples: list[Sample], wall_s: float, slo_ttft_s: float,
              slo_itl_s: float) -> LevelResult:
    ok = [s for s in samples if s.ok]

    def pct(values: list[float]) -> dict:
        return {f"p{q}": round(percentile(values, q) * 1000, 3) for q in (50, 90, 99)}

    good = [s for s in ok if s.ttft <= slo_ttft_s and s.mean_itl <= slo_itl_s]
    errors = [s for s in samples if not s.ok]
    return LevelResult(
        concurrency=concurrency, requests=len(samples), errors=len(errors), wall_s=round(wall_s, 3),
        ttft_ms=pct([s.ttft for s in ok]), itl_ms=pct([x for s in ok for x in s.itls]),
        e2e_ms=pct([s.e2e for s in ok]),
        req_per_s=round(len(ok) / wall_s, 3) if wall_s else 0.0,
        output_tok_per_s=round(sum(s.output_tokens for s in ok) / wall_s, 3) if wall_s else 0.0,
        goodput_req_per_s=round(len(good) / wall_s, 3) if wall_s else 0.0,
        first_error=errors[0].error if errors else None,
    )


def make_prompt(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n_words)))


# ------------------------------------------------------------------ HTTP load
async def one_request(client: Any, url: str, body: dict, headers: dict, chat: bool) -> Sample:
    t0 = time.perf_counter()
    last = None
    sample = Sample(ok=False)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with client.stream("POST", url + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                sample.error = f"HTTP {r.status_code}: {text[:200]}"
                return sample
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    sample.error = obj["error"].get("message")
                    return sample
                if obj.get("usage"):
                    sample.output_tokens = obj["usage"].get("completion_tokens", sample.output_tokens)
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        now = time.perf_counter()
                        if last is None:
                            sample.ttft = now - t0
                        else:
                            sample.itls.append(now - last)
                        last = now
        sample.e2e = time.perf_counter() - t0
        sample.ok = last is not None
        if not sample.ok:
            sample.error = "no content streamed"
    except Exception as exc:  # noqa: BLE001 - a failed request is a sample
        sample.error = f"{type(exc).__name__}: {exc}"
    return sample


async def closed_loop(worker: Any, concurrency: int, total: int) -> tuple[list[Any], float]:
    """`concurrency` workers call `worker(i)` back to back until `total` calls were made."""
    counter = iter(range(total))
    results: list[Any] = []

    async def loop() -> None:
        for i in counter:
            results.append(await worker(i))

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


async def run_load(args: argparse.Namespace) -> list[LevelResult]:
    import httpx

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get(url + "/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        chat = args.endpoint == "chat"

        def body() -> dict:
            b: dict[str, Any] = {"model": model, "max_tokens": args.output_len, "stream": True,
                                 "stream_options": {"include_usage": True}, "temperature": 0.0,
                                 "ignore_eos": True}
            prompt = make_prompt(args.prompt_len, rng)
            if chat:
                b["messages"] = [{"role": "user", "content": prompt}]
            else:
                b["prompt"] = prompt
            return b

        await one_request(client, url, body(), headers, chat)  # warm-up (handshakes, connections)
        results = []
        for c in levels:
            samples, wall = await closed_loop(lambda i: one_request(client, url, body(), headers, chat),
                                              c, args.requests)
            res = summarize(c, samples, wall, args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
            results.append(res)
            print_level(res)
    return results


def print_level(r: LevelResult) -> None:
    def fmt(d: dict) -> str:
        return " / ".join(f"{d[k]:8.2f}" for k in ("p50", "p90", "p99"))

    print(f"concurrency {r.concurrency:>3}: {r.requests} requests, {r.errors} errors, {r.wall_s:.2f}s"
          + (f"  (first error: {r.first_error})" if r.first_error else ""))
    print(f"  TTFT ms p50/p90/p99 {fmt(r.ttft_ms)}")
    print(f"  ITL  ms p50/p90/p99 {fmt(r.itl_ms)}")
    print(f"  e2e  ms p50/p90/p99 {fmt(r.e2e_ms)}")
    print(f"  throughput {r.req_per_s:.2f} req/s, {r.output_tok_per_s:.1f} output tok/s; "
          f"goodput {r.goodput_req_per_s:.2f} req/s", flush=True)


def plot(results: list[LevelResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.concurrency for r in results]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, key, name in ((axes[0][0], "ttft_ms", "TTFT (ms)"), (axes[0][1], "itl_ms", "ITL (ms)"),
                          (axes[1][0], "e2e_ms", "end-to-end (ms)")):
        for q in ("p50", "p90", "p99"):
            ax.plot(xs, [getattr(r, key)[q] for r in results], marker="o", label=q)
        ax.set_title(name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.legend()
    ax = axes[1][1]
    ax.plot(xs, [r.req_per_s for r in results], marker="o", label="throughput")
    ax.plot(xs, [r.goodput_req_per_s for r in results], marker="s", label="goodput (SLO met)")
    ax.set_title("requests/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.overhead:
        from serving.bench.overhead import run_overhead

        return run_overhead(args)
    if args.workload == "chat":
        from serving.bench.chat import run_chat

        return run_chat(args)
    results = asyncio.run(run_load(args))
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump([asdict(r) for r in results], fh, indent=2)
    if args.plot:
        plot(results, args.plot, f"{args.url} prompt={args.prompt_len} output={args.output_len}")
        print(f"plot written to {args.plot}")
    return 0 if all(r.errors == 0 for r in results) else 1


def write_results(path: str, out: dict[str, Any], table: str) -> None:
    """`out` as JSON at `path` and `table` beside it (.txt) under a header of the command and host."""
    with open(path, "w") as fh:
        json.dump(out, fh, indent=2)
    h = out["host"]
    with open(os.path.splitext(path)[0] + ".txt", "w") as fh:
        fh.write(f"# {out['command']}\n# {out['date']}; host: {h['cpus']} CPUs, load average before "
                 f"{h['loadavg'][0]:.2f} / after {h['loadavg_after'][0]:.2f}, "
                 f"{h['memory_available_gib']} GiB available\n{table}\n")
    print(f"results written to {path} (+ .txt)")


if __name__ == "__main__":
    from serving.cli.main import main

    sys.exit(main(["bench", *sys.argv[1:]]))

