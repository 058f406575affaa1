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
import random
from dataclasses import asdict
from typing import Any

from serving.bench.samples import LevelResult, Sample, closed_loop, make_prompt, print_level, summarize
from serving.bench.sse import stream_request, target


async def run_load(args: argparse.Namespace) -> list[LevelResult]:
    rng = random.Random(args.seed)
    async with target(args) as t:
        client, url, headers, model = t.client, t.url, t.headers, t.model
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

        await stream_request(client, url, body(), headers, chat, Sample(ok=False))  # warm-up (handshakes)
        results = []
        for c in t.levels:
            samples, wall = await closed_loop(
                lambda i: stream_request(client, url, body(), headers, chat, Sample(ok=False)), c, args.requests)
            res = summarize(c, samples, wall, args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
            results.append(res)
            print_level(res)
    return results


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


def run_random(args: argparse.Namespace) -> int:
    results = asyncio.run(run_load(args))
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump([asdict(r) for r in results], fh, indent=2)
    if args.plot:
        plot(results, args.plot, f"{args.url} prompt={args.prompt_len} output={args.output_len}")
        print(f"plot written to {args.plot}")
    return 0 if all(r.errors == 0 for r in results) else 1
